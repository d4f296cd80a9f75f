"""Before the joint trace (step 1 of the split): a stage's inputs as fake tensors, its forward made fit for aot's
joint trace and for the wire, and the F, B, W, BW of a stage with nothing to differentiate."""

from __future__ import annotations

import operator
from typing import Mapping, Sequence

import torch
from torch import fx

from zbcompile._torch_private import FakeTensorMode, OpOverload, op_schema
from zbcompile.ir.names import Role, role_of
from zbcompile.ir.stages import Graph
from zbcompile.passes.analysis.aliases import may_alias_input
from zbcompile.passes.forward_only import views_as_reshapes
from zbcompile.passes.split_fbw.common import _aten, _identifier, _placeholder

__all__ = ["_fake_arg", "_differentiable_forward", "_trivial_program"]


def _fake_arg(mode: FakeTensorMode, name: str, ph: fx.Node, requires_grad: bool,
              device: torch.device | None) -> torch.Tensor:
    """A fake tensor for stage input `name`: the traced layout, except a received activation, which is
    contiguous, as every boundary tensor is on the wire (see _differentiable_forward)."""
    val = ph.meta["val"]
    if device is None or val.device.type != "meta":
        device = val.device
    stride = torch.empty(val.shape, device="meta").stride() if role_of(name) is Role.ACT else val.stride()
    with mode:
        t = torch.empty_strided(val.shape, stride, dtype=val.dtype, device=device)
    return t.requires_grad_(requires_grad and (val.is_floating_point() or val.is_complex()))


def _differentiable_forward(stage: Graph) -> tuple[tuple[str, ...], fx.GraphModule]:
    """The stage forward made fit for aot's joint trace and for the wire:

    - without pass-through outputs (F re-sends those inputs by hand);
    - outputs that are views or inputs are cloned (aot forbids outputs aliasing inputs), a value returned
      twice is cloned the second time;
    - sent activations are contiguous (`aten.contiguous`: a copy only where the traced layout is not);
    - every `aten.view` is an `aten.reshape`, which views where the layout allows and copies where not;
    - every functional `aten.copy` (what export makes of a slice assignment `q[:, :k] = x`) is an
      `expand_copy` of its source (`_differentiable_copy`): autograd has no derivative for aten.copy.
    - linalg.inv, solve, cholesky, lu_factor, ldl_factor are their `_ex` forms with an `_assert_async` of their
      error check (`_unchecked_linalg`).

    Why contiguous sends and reshape, rather than recording strides in the boundary spec and restoring them
    with as_strided on receive: the layouts export recorded are not the layouts the stage graphs produce. Export
    traces without autograd, and ops such as SDPA on CPU pick another kernel, with another output layout,
    when their inputs require grad; export has by then dropped a `.contiguous()` that looked redundant
    (T5: `attn.transpose(1, 2).contiguous().view(...)`), so the recorded strides are not worth restoring and a
    `view` can fail ("Cannot view a tensor with shape ... and strides ..."). A graph that does not depend on
    strides works for any layout; a contiguous wire needs no strides in the boundary spec, the P2P send needs
    contiguous tensors anyway, and a received tensor is then exactly what the receiver's joint was traced on
    (`_fake_arg`). The cost is a copy on the sender for a permuted view that crosses a cut.
    """
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in stage.gm.graph.nodes:
        if node.target is _aten.copy.default:
            env[node] = _differentiable_copy(g, node, env)
        elif node.target in _CHECKED_LINALG:
            env[node] = _unchecked_linalg(g, node, env)
        elif node.op != "output":
            env[node] = g.node_copy(node, lambda n: env[n])
    views_as_reshapes(g)
    names, results, seen = [], [], set()
    for name, node in zip(stage.outputs, stage.gm.graph.output_node().args[0]):
        if name in stage.passthrough:
            continue
        value = env[node]
        sent = role_of(name) is Role.ACT
        if value in seen or may_alias_input(value):
            kwargs = {"memory_format": torch.contiguous_format} if sent else {}
            value = g.call_function(_aten.clone.default, (value,), kwargs)
            value.meta["val"] = node.meta["val"]
        elif sent:
            decomposes = _may_decompose_to_view(value)
            value = g.call_function(_aten.contiguous.default, (value,))
            value.meta["val"] = node.meta["val"]
            if decomposes:   # e.g. aten.linear on 3-d input: view(addmm(view(x))), a view of an intermediate
                value = g.call_function(_aten._unsafe_view.default, (value, list(node.meta["val"].shape)))
                value.meta["val"] = node.meta["val"]
        seen.add(value)
        names.append(name)
        results.append(value)
    g.output(tuple(results))
    return tuple(names), fx.GraphModule(stage.gm, g, class_name=f"Stage{stage.index}Diff")


def _views_as_reshapes(g):
    """Graph `g` (F, B, W or BW of a stage, as aot made it) with every `aten.view` an `aten.reshape`, in place
    (forward_only.views_as_reshapes: aot made its views on fake layouts)."""
    if getattr(g, "gm", None) is not None and views_as_reshapes(g.gm.graph):
        g.gm.recompile()
    return g


def _may_decompose_to_view(node: fx.Node) -> bool:
    """True for a call of a composite aten op (one autograd decomposes, such as `aten.linear`, which returns a
    `view` of its `addmm` for 3-d input): its result may be a view of an intermediate, an output aot's joint
    export rejects; `_unsafe_view` of it (no copy) hides the alias as aot itself does."""
    target = node.target
    return (isinstance(target, OpOverload) and not target.is_view
            and torch._C._dispatch_has_kernel_for_dispatch_key(target.name(), "CompositeImplicitAutograd"))


_CHECKED_LINALG = {   # op -> (its `_ex` form, returning `info` last; how many results the op returns)
    _aten.linalg_inv.default: (_aten.linalg_inv_ex.default, 1),
    _aten.inverse.default: (_aten.linalg_inv_ex.default, 1),
    _aten.linalg_solve.default: (_aten.linalg_solve_ex.default, 1),
    _aten.linalg_cholesky.default: (_aten.linalg_cholesky_ex.default, 1),
    _aten.linalg_lu_factor.default: (_aten.linalg_lu_factor_ex.default, 2),
    _aten.linalg_ldl_factor.default: (_aten.linalg_ldl_factor_ex.default, 2),
    **{ex: (ex, None) for ex in (_aten.linalg_inv_ex.default, _aten.linalg_solve_ex.default,
                                 _aten.linalg_cholesky_ex.default, _aten.linalg_lu_factor_ex.default,
                                 _aten.linalg_ldl_factor_ex.default)},
}


def _unchecked_linalg(g: fx.Graph, node: fx.Node, env: Mapping[fx.Node, fx.Node]) -> fx.Node:
    """A linalg op that raises on a singular matrix (or one not positive-definite), as its `_ex` form without
    the check and an `_assert_async` on the `info` it returns. The check itself (`_linalg_check_errors`, which
    the op's composite calls) is an ordered side effect to aot, which threads it through the joint as an
    effect token: an extra input and output that the stage programs have no place for."""
    ex, results = _CHECKED_LINALG[node.target]
    if results is None and not node.kwargs.get("check_errors", False):
        return g.node_copy(node, lambda n: env[n])   # an `_ex` form that does not check: nothing to do
    kwargs = {**node.kwargs, "check_errors": False}
    call = g.call_function(ex, tuple(env[a] if isinstance(a, fx.Node) else a for a in node.args), kwargs)
    info = g.call_function(operator.getitem, (call, len(op_schema(ex).returns) - 1))
    ok = g.call_function(_aten.all.default, (g.call_function(_aten.eq.Scalar, (info, 0)),))
    g.call_function(_aten._assert_async.msg, (ok, f"{ex.overloadpacket.__name__.removesuffix('_ex')}: the "
                                              "matrix is singular (or, for a Cholesky factorization, not "
                                              "positive-definite); eager torch raises a LinAlgError here"))
    if results == 1:
        call = g.call_function(operator.getitem, (call, 0))
        call.meta = dict(node.meta)
    return call


def _differentiable_copy(g: fx.Graph, node: fx.Node, env: Mapping[fx.Node, fx.Node]) -> fx.Node:
    """`aten.copy(dst, src)` as ops autograd differentiates: the result is `src` converted to dst's dtype and
    broadcast to dst's shape, in fresh memory; dst's values are overwritten, so no grad flows into dst (the
    slice_scatter that follows puts the result back into the base tensor, as in eager)."""
    dst, src = node.args[0], node.args[1]
    want, have = dst.meta["val"], src.meta["val"]   # aten.copy's source is a Tensor: always a node here
    value = env[src]
    if have.dtype != want.dtype or have.device != want.device:
        value = g.call_function(_aten._to_copy.default, (value,), {"dtype": want.dtype, "device": want.device})
        value.meta["val"] = have.to(want.dtype)
    out = g.call_function(_aten.expand_copy.default, (value, list(want.shape)))
    out.meta = dict(node.meta)
    return out


def _trivial_program(stage: Graph, diff_names, diff_gm, in_rg) -> tuple[Graph, Graph, Graph, Graph]:
    """F, B, W, BW of a stage with no backward of its own: F runs the forward and re-sends its pass-throughs;
    B and BW hand each pass-through's incoming grad straight back (none where nothing requires grad); W is
    empty."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for name, node in zip(stage.inputs, diff_gm.graph.find_nodes(op="placeholder")):
        env[node] = g.placeholder(node.name)
        env[node].meta = dict(node.meta)
    for node in diff_gm.graph.nodes:
        if node.op not in ("placeholder", "output"):
            env[node] = g.node_copy(node, lambda n: env[n])
    results = [env[n] for n in diff_gm.graph.output_node().args[0]]
    results += [env[_placeholder(diff_gm, stage.inputs.index(p))] for p in stage.passthrough]
    g.output(tuple(results))
    f = Graph(fx.GraphModule(diff_gm, g, class_name=f"Stage{stage.index}F"), stage.inputs,
              diff_names + stage.passthrough)
    grads = tuple(f"grad:{p}" for p in stage.passthrough if in_rg[p])
    bw = _identity_graph(stage, grads, f"Stage{stage.index}BW") if grads else _empty_graph(f"Stage{stage.index}Empty")
    return f, bw, _empty_graph(f"Stage{stage.index}Empty"), bw


def _identity_graph(stage: Graph, names: Sequence[str], class_name: str) -> Graph:
    """A graph returning its inputs, named `names` in and out (grad:act:<x> of pass-throughs)."""
    g = fx.Graph()
    nodes = []
    for name in names:
        nodes.append(g.placeholder(_identifier(name)))
        nodes[-1].meta = dict(_placeholder(stage.gm, stage.inputs.index(name[len("grad:"):])).meta)
    g.output(tuple(nodes))
    return Graph(fx.GraphModule(torch.nn.Module(), g, class_name=class_name), tuple(names), tuple(names))


def _empty_graph(class_name: str) -> Graph:
    g = fx.Graph()
    g.output(())
    return Graph(fx.GraphModule(torch.nn.Module(), g, class_name=class_name), (), ())
