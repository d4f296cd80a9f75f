"""Pass 3, split: differentiate each stage and cut its backward into B (input grads) and W (weight grads).

    Partition  ->  StagedModel                      (split_fbw: every stage, in order)
    Graph (a stage forward)  ->  Stage(f, b, w, bw, ...)   (split_stage: the four graphs of the stage IR)

Stage s+1's received activations require grad exactly where stage s's sent ones do, so the stages are split
first to last.

1. Joint: `aot_export_joint_simple` traces forward + backward of the stage's functional forward, with
   parameters and received activations requiring grad. Pass-through activations are left out of the traced
   function (an output aliasing an input is not allowed there) and wired in by hand: F re-sends the input, and
   the backward adds the incoming grad to whatever the stage itself contributes. Before the trace the stage
   forward is made fit for it (`_differentiable_forward`): outputs aliasing inputs cloned, boundary tensors
   contiguous, views as reshapes, slice assignments (aten.copy) as expand_copy. A stage with nothing to
   differentiate (no input requires grad, or it only re-sends what it received) gets a trivial backward.
2. F / BW: `min_cut_rematerialization_partition` picks what F saves (`saved:*`) and what the backward
   recomputes; its backward is BW, the fused backward of plain 1F1B.
3. B / W by dependency analysis on BW:

       B = every node the grad:act:* outputs need            (dx = dy @ W for a Linear)
       W = the rest of what grad:param:* needs               (dW = dy^T x, the bias sum)
       wsaved:* = B-computed values that W reads              (e.g. dy of each Linear inside the stage)

   Fused backward ops compute dX and dW in one node. `convolution_backward` is rewritten into two calls with
   complementary `output_mask` (exact), so the heavy dW goes to W; for the others (layer norm, batch norm)
   every `getitem` of a node in B stays in B, and W reads the small dW/db results as wsaved.

Random ops stay in F and their masks are saved, so F and B agree (dropout). Buffers are inputs; their updated
values are F outputs. Parameters are never constants of a graph.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Callable, Iterable, Mapping, Sequence

import torch
from torch import fx

from zbcompile._torch_private import (FakeTensorMode, OpOverload, aot_export_joint_simple,
                                      min_cut_rematerialization_partition)
from zbcompile.errors import SplitError
from zbcompile.ir.names import VOCAB_EMB, Role, key_of, role_of
from zbcompile.passes.analysis.aliases import graph_output_aliases, may_alias_input
from zbcompile.ir.stages import Graph, Partition, Stage, StagedModel, TensorSpec, module_path

__all__ = ["split_fbw", "split_stage"]

_aten = torch.ops.aten


def split_fbw(cut: Partition) -> StagedModel:
    """A split pass: every stage of `cut` as F, B, W and BW (see the module docstring)."""
    traced = cut.traced
    acts: dict[str, bool] = {}   # does each sent activation carry a gradient back
    if cut.vocab is not None:    # the summed lookup of the sharded embedding, which is trained
        acts[VOCAB_EMB] = True

    def requires_grad(name: str) -> bool:
        role = role_of(name)
        if role is Role.PARAM:
            return key_of(name) not in traced.frozen
        if role is Role.ACT:
            return acts[name]
        return False  # buffers and user data

    stages = []
    for sg in cut.stages:
        stage = split_stage(sg, requires_grad, device=traced.device)
        acts.update((spec.name, spec.requires_grad) for spec in stage.send)
        stages.append(stage)
    meta = {"split_points": cut.split_points}
    sharded = frozenset(cut.vocab.params) if cut.vocab is not None else frozenset()
    return StagedModel(_hold_unused(tuple(stages), traced, sharded), traced.num_inputs, traced.num_targets,
                       traced.tied, meta, cut.vocab)


def _hold_unused(stages: tuple[Stage, ...], traced, sharded: frozenset[str] = frozenset()) -> tuple[Stage, ...]:
    """`stages` where each parameter and buffer of the model that no stage reads (a rotary embedding's saved
    copy of its frequencies, a parameter of an unused head) is listed by exactly one stage: the one whose
    modules hold the longest prefix of its name, else the first. A rank keeps real storage only for what its
    stages list (zbcompile.distributed.keep_only), so without this such state would be dropped everywhere and
    vanish from the model's state dict; listed here, it stays real on that stage's rank, untouched. The
    vocabulary parameters (`sharded`) are every rank's, as shards: no stage lists them."""
    used = {name for st in stages for name in st.f.inputs} | {"param:" + n for n in sharded}
    unused = [n for n in traced.graph.inputs if role_of(n) in (Role.PARAM, Role.BUFFER) and n not in used]
    extra: list[list[str]] = [[] for _ in stages]
    for name in unused:
        extra[_holding_stage(stages, key_of(name))].append(name)
    return tuple(
        dataclasses.replace(st, params=st.params + tuple(key_of(n) for n in more if role_of(n) is Role.PARAM),
                            buffers=st.buffers + tuple(key_of(n) for n in more if role_of(n) is Role.BUFFER))
        if more else st
        for st, more in zip(stages, extra)
    )


def _holding_stage(stages: Sequence[Stage], fqn: str) -> int:
    """The stage whose module paths are the longest prefix of `fqn` (0 when none is)."""
    best, best_len = 0, -1
    for st in stages:
        for path in st.modules:
            if fqn.startswith(path + ".") and len(path) > best_len:
                best, best_len = st.index, len(path)
    return best


def split_stage(stage: Graph, requires_grad: Callable[[str], bool], device: torch.device | None = None) -> Stage:
    """Build F, B, W and BW for `stage` (a stage forward of the partition); `requires_grad(name)` says which
    inputs are differentiable.

    `device` replaces the meta device of inputs traced on meta (autograd does not trace meta tensors).
    """
    placeholders = list(stage.gm.graph.find_nodes(op="placeholder"))
    mode = FakeTensorMode(allow_non_fake_inputs=True)  # lifted constants are real tensors
    args = tuple(
        _fake_arg(mode, name, ph, requires_grad(name), device) for name, ph in zip(stage.inputs, placeholders)
    )
    diff_names, diff_gm = _differentiable_forward(stage)
    with mode, torch.enable_grad():
        outs = diff_gm(*args)
    out_rg = {name: bool(o.requires_grad) for name, o in zip(diff_names, outs)}
    in_rg = {name: bool(a.requires_grad) for name, a in zip(stage.inputs, args)}
    rg = {**in_rg, **out_rg, **{p: in_rg[p] for p in stage.passthrough}}
    if not any(in_rg.values()) or not diff_names:
        # nothing to differentiate: no input requires grad, or the stage only re-sends what it received (a
        # stage that returns its input, e.g. one doing nothing but `.to(dtype)`); aot cannot trace a joint
        # without outputs
        return _stage(stage, *_trivial_program(stage, diff_names, diff_gm, in_rg), rg)
    try:
        joint = aot_export_joint_simple(diff_gm, args, trace_joint=True)
        fw, bw = min_cut_rematerialization_partition(joint, args, num_fwd_outputs=len(diff_names))
    except Exception as exc:  # torch's errors name aot internals; ours names the stage, the node and the fix
        raise SplitError(_explain_joint_failure(stage, diff_gm, exc)) from exc
    f, saved = _forward_graph(stage, fw, diff_names)
    tangents = [f"grad:{n}" for n in diff_names if out_rg[n]]
    bw_graph = _backward_graph(stage, bw, saved, tangents, in_rg)
    b, w = _split_b_w(bw_graph)
    return _stage(stage, f, b, w, bw_graph, rg)


def _stage(sg: Graph, f: Graph, b: Graph, w: Graph, bw: Graph, rg: Mapping[str, bool]) -> Stage:
    """The stage IR record for stage forward `sg` and its four graphs; `rg` says which values carry grads."""

    def spec(name: str, val: torch.Tensor) -> TensorSpec:
        return TensorSpec(name, tuple(int(d) for d in val.shape), val.dtype, rg[name])

    def values(nodes: Mapping[str, fx.Node]) -> dict[str, torch.Tensor]:
        return {name: node.meta["val"] for name, node in nodes.items()}

    return Stage(
        index=sg.index,
        f=f,
        b=b,
        w=w,
        bw=bw,
        params=tuple(key_of(n) for n in sg.inputs if role_of(n) is Role.PARAM),
        buffers=tuple(key_of(n) for n in sg.inputs if role_of(n) is Role.BUFFER),
        recv=tuple(spec(n, v) for n, v in values(sg.input_nodes()).items() if role_of(n) is Role.ACT),
        send=tuple(spec(n, v) for n, v in values(sg.output_nodes()).items() if role_of(n) is Role.ACT),
        data=tuple(int(key_of(n)) for n in sg.inputs if role_of(n) is Role.DATA),
        modules=sg.modules,
        has_loss="loss" in sg.outputs,
    )


def _explain_joint_failure(stage: Graph, diff_gm: fx.GraphModule, exc: BaseException) -> str:
    """SplitError's text when aot cannot trace the stage's joint: where (stage, module, node with a window of
    the graph), what (torch's whole message) and how to fix it."""
    text = f"{type(exc).__name__}: {exc}".strip()
    culprits = _culprits(diff_gm, text)
    head = (f"stage {stage.index} ({', '.join(stage.modules) or 'no whole module'}) could not be differentiated: "
            "aot autograd's joint trace of its forward failed")
    lines = [head]
    if culprits:
        node = culprits[0]
        paths = [p for p in module_path(node) if p]
        where = f" in module `{paths[-1]}`" if paths else ""
        lines.append(f"at node `{node.name}` ({node.target}){where}:")
        lines.append(_window(diff_gm, node))
    else:
        lines.append("the error names no node of the stage graph; the stage forward begins:")
        lines.append(_window(diff_gm, None))
    lines.append("torch said:")
    lines += ["    " + line for line in text.splitlines()]
    lines.append(_fix(text, culprits))
    return "\n".join(lines)


def _culprits(gm: fx.GraphModule, text: str) -> list[fx.Node]:
    """Nodes of `gm` the error points at: outputs that alias an input when it complains about aliasing, else the
    nodes whose op it names (`mylib.op.default` or `mylib::op`)."""
    outs = gm.graph.output_node().args[0]
    aliasing = [n for n, roots in zip(outs, graph_output_aliases(gm)) if roots]
    if "alias" in text and aliasing:
        return aliasing
    return [n for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, OpOverload)
            and (str(n.target) in text or n.target.name() in text)]


def _window(gm: fx.GraphModule, mark: fx.Node | None, width: int = 4) -> str:
    """The graph's nodes around `mark` (marked `>>`), or its first nodes when there is none."""
    nodes = [n for n in gm.graph.nodes if n.op != "placeholder"]
    at = nodes.index(mark) if mark in nodes else 0
    lo, hi = max(0, at - width), min(len(nodes), at + width + 1)
    shown = [f"  {'>>' if n is mark else '  '} {n.format_node()}"[:200] for n in nodes[lo:hi]]
    return "\n".join(shown)


def _fix(text: str, culprits: Sequence[fx.Node]) -> str:
    if "alias" in text:
        return ("fix: a stage may not return its input or a view of it; return a copy (`.clone()`) of the value "
                "that crosses the cut, or move the split point so that the view stays inside one stage")
    if "autograd" in text and culprits:
        return (f"fix: give `{culprits[0].target}` a backward (torch.library.register_autograd for a custom op), "
                "or compute it outside the model")
    return ("fix: every op in a stage must be traceable by aot autograd with a backward; replace or move the op "
            "above, or choose other split_points to isolate it")


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
        elif node.op != "output":
            env[node] = g.node_copy(node, lambda n: env[n])
            if node.target is _aten.view.default:
                env[node].target = _aten.reshape.default
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


def _may_decompose_to_view(node: fx.Node) -> bool:
    """True for a call of a composite aten op (one autograd decomposes, such as `aten.linear`, which returns a
    `view` of its `addmm` for 3-d input): its result may be a view of an intermediate, an output aot's joint
    export rejects; `_unsafe_view` of it (no copy) hides the alias as aot itself does."""
    target = node.target
    return (isinstance(target, OpOverload) and not target.is_view
            and torch._C._dispatch_has_kernel_for_dispatch_key(target.name(), "CompositeImplicitAutograd"))


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


def _placeholder(gm: fx.GraphModule, i: int) -> fx.Node:
    return list(gm.graph.find_nodes(op="placeholder"))[i]


# ---------------------------------------------------------------------------------------------------------------
# F and BW from the min-cut partition


def _forward_graph(stage: Graph, fw: fx.GraphModule, diff_names) -> tuple[Graph, dict[str, str]]:
    """F with named inputs; outputs = stage outputs, pass-throughs, then saved:*. Returns saved renames too."""
    primals = {ph.name: ph for ph in fw.graph.find_nodes(op="placeholder")}
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, name in enumerate(stage.inputs):
        ph = g.placeholder(_identifier(name))
        old = primals.get(f"primals_{i + 1}")
        if old is not None:
            ph.meta = dict(old.meta)
            env[old] = ph
        else:  # min-cut drops unused primals; F still takes every stage input by name
            ph.meta = dict(_placeholder(stage.gm, i).meta)
    if len(env) != len(primals):
        raise SplitError(f"stage {stage.index}: unexpected forward placeholders {sorted(primals)}")
    for node in fw.graph.nodes:
        if node.op not in ("placeholder", "output"):
            env[node] = g.node_copy(node, lambda n: env[n])
    fw_outs = list(fw.graph.output_node().args[0])
    k = len(diff_names)
    results = [env[n] for n in fw_outs[:k]]
    if "loss" in diff_names:
        results[diff_names.index("loss")] = _own_scalar(g, results[diff_names.index("loss")])
    by_input = dict(zip(stage.inputs, g.find_nodes(op="placeholder")))
    results += [by_input[p] for p in stage.passthrough]
    saved: dict[str, str] = {}
    for node in fw_outs[k:]:
        if not isinstance(node, fx.Node) or not isinstance(node.meta.get("val"), torch.Tensor):
            raise SplitError(f"stage {stage.index}: the forward saves a non-tensor value {node!r} (dynamic shapes?)")
        saved[node.name] = f"saved:{env[node].name}"
        results.append(env[node])
    g.output(tuple(results))
    gm = fx.GraphModule(fw, g, class_name=f"Stage{stage.index}F")
    names = tuple(diff_names) + stage.passthrough + tuple(saved.values())
    return Graph(gm, stage.inputs, names), saved


def _backward_graph(stage, bw: fx.GraphModule, saved: Mapping[str, str], tangents: Sequence[str], in_rg) -> Graph:
    """BW with named inputs (saved:*, grad:<output>) and outputs (grad:<input> for differentiable inputs)."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    names: list[str] = []
    bw_placeholders = list(bw.graph.find_nodes(op="placeholder"))
    tangent_nodes = [ph for ph in bw_placeholders if ph.name.startswith("tangents")]
    if len(tangent_nodes) != len(tangents):
        raise SplitError(
            f"stage {stage.index}: the backward takes {len(tangent_nodes)} output grads, expected {len(tangents)}"
        )
    tangent_of = dict(zip(tangent_nodes, tangents))
    for ph in bw_placeholders:
        name = tangent_of.get(ph) or saved.get(ph.name)
        if name is None:
            raise SplitError(f"stage {stage.index}: backward input `{ph.name}` is neither saved nor a grad")
        env[ph] = g.placeholder(_identifier(name))
        env[ph].meta = dict(ph.meta)
        names.append(name)
    incoming = {}
    for p in stage.passthrough:
        if in_rg[p]:  # the grad coming back from the next stage for a value we only forwarded
            incoming[p] = g.placeholder(_identifier(f"grad:{p}"))
            incoming[p].meta = dict(_placeholder(stage.gm, stage.inputs.index(p)).meta)
            names.append(f"grad:{p}")
    for node in bw.graph.nodes:
        if node.op not in ("placeholder", "output"):
            env[node] = g.node_copy(node, lambda n: env[n])
    grads = list(bw.graph.output_node().args[0])
    out_names, results = [], []
    for name, grad in zip(stage.inputs, grads, strict=True):
        value = env[grad] if isinstance(grad, fx.Node) else None
        if name in incoming:
            value = incoming[name] if value is None else _add(g, value, incoming[name])
        if value is None:
            continue
        if not in_rg[name]:
            raise SplitError(f"stage {stage.index}: the backward produces a grad for `{name}`, which needs none")
        if role_of(name) is Role.ACT:  # sent back to the previous stage: contiguous on the wire
            value = _contiguous(g, value)
        out_names.append(f"grad:{name}")
        results.append(value)
    g.output(tuple(results))
    return Graph(fx.GraphModule(bw, g, class_name=f"Stage{stage.index}BW"), tuple(names), tuple(out_names))


def _own_scalar(g: fx.Graph, loss: fx.Node) -> fx.Node:
    """A copy of the 0-dim loss in memory of its own. Some loss kernels return a view of their elementwise buffer
    (aten.mse_loss on CPU: 4 bytes visible, the batch's [N, D] held): the step keeps every microbatch's loss
    until it sums them, and that buffer with it, which no tensor size (nor the memory plan) shows."""
    val = loss.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() != 0:
        return loss
    out = g.call_function(_aten.clone.default, (loss,))
    out.meta["val"] = val.clone()
    return out


def _contiguous(g: fx.Graph, value: fx.Node) -> fx.Node:
    """`value`, or a contiguous copy of it where its traced layout (meta["val"], from aot's fake run) is not."""
    val = value.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.is_contiguous():
        return value
    out = g.call_function(_aten.clone.default, (value,), {"memory_format": torch.contiguous_format})
    out.meta["val"] = val.contiguous()
    return out


def _add(g: fx.Graph, a: fx.Node, b: fx.Node) -> fx.Node:
    out = g.call_function(_aten.add.Tensor, (a, b))
    out.meta["val"] = a.meta.get("val")
    return out


# ---------------------------------------------------------------------------------------------------------------
# B / W


def _split_b_w(bw: Graph) -> tuple[Graph, Graph]:
    """Cut the fused backward into B (what grad:act:* needs) and W (the remaining param-grad work)."""
    gm = _split_conv_backward(bw.gm)
    graph = gm.graph
    outputs = list(zip(bw.outputs, graph.output_node().args[0]))
    b_roots = [n for name, n in outputs if role_of(name) is not Role.GRAD_PARAM]
    w_roots = [n for name, n in outputs if role_of(name) is Role.GRAD_PARAM]
    b_nodes = _with_fused_siblings(_ancestors(b_roots))
    w_nodes = _ancestors(w_roots, stop=b_nodes)
    # values W reads from B (or that W returns straight from B)
    w_reads = {i for n in w_nodes for i in n.all_input_nodes if i not in w_nodes}
    w_reads |= {n for n in w_roots if n not in w_nodes}
    placeholders = list(graph.find_nodes(op="placeholder"))
    name_of = dict(zip(placeholders, bw.inputs))
    wsaved = [n for n in graph.nodes if n in w_reads and n.op != "placeholder"]
    w_inputs = [(name_of[n], n) for n in placeholders if n in w_reads] + [(f"wsaved:{n.name}", n) for n in wsaved]
    b_reads = {i for n in b_nodes for i in n.all_input_nodes} | set(b_roots)
    b_inputs = [(name_of[n], n) for n in placeholders if n in b_reads]
    b_outputs = [(name, n) for name, n in outputs if role_of(name) is not Role.GRAD_PARAM]
    b_outputs += [(f"wsaved:{n.name}", n) for n in wsaved]
    w_outputs = [(name, n) for name, n in outputs if role_of(name) is Role.GRAD_PARAM]
    b = _extract(gm, b_nodes, b_inputs, b_outputs, "B")
    w = _extract(gm, w_nodes, w_inputs, w_outputs, "W")
    return b, w


def _ancestors(roots: Iterable[fx.Node], stop: set[fx.Node] = frozenset()) -> set[fx.Node]:
    """Computed (non-placeholder) nodes that `roots` depend on, not crossing `stop`."""
    seen: set[fx.Node] = set()
    stack = list(roots)
    while stack:
        n = stack.pop()
        if n in seen or n in stop or n.op == "placeholder":
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return seen


def _with_fused_siblings(nodes: set[fx.Node]) -> set[fx.Node]:
    """Add every getitem of a multi-output node in `nodes`: the fused op's other results are free there."""
    extra = {u for n in nodes for u in n.users if u.target is operator.getitem}
    return nodes | extra


def _split_conv_backward(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of `gm` where each convolution_backward computing both dX and dW/db becomes two calls."""
    convs = gm.graph.find_nodes(op="call_function", target=_aten.convolution_backward.default)
    if not any(_needs_split(n) for n in convs):
        return gm
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.target is _aten.convolution_backward.default and _needs_split(node):
            mask = list(node.args[10])
            val = node.meta.get("val")
            args = [env[a] if isinstance(a, fx.Node) else a for a in node.args]
            dx = g.call_function(node.target, tuple(args[:10]) + ([mask[0], False, False],))
            dw = g.call_function(node.target, tuple(args[:10]) + ([False, mask[1], mask[2]],))
            if isinstance(val, (tuple, list)):
                dx.meta["val"] = (val[0], None, None)
                dw.meta["val"] = (None, val[1], val[2])
            env[node] = (dx, dw)
            continue
        if node.target is operator.getitem and isinstance(env.get(node.args[0]), tuple):
            dx, dw = env[node.args[0]]
            src = dx if node.args[1] == 0 else dw
            env[node] = g.call_function(operator.getitem, (src, node.args[1]))
            env[node].meta = dict(node.meta)
            continue
        env[node] = g.node_copy(node, lambda n: env[n])
    return fx.GraphModule(gm, g, class_name=type(gm).__name__)


def _needs_split(node: fx.Node) -> bool:
    mask = node.args[10] if len(node.args) > 10 else None
    return mask is not None and bool(mask[0]) and (bool(mask[1]) or bool(mask[2]))


def _extract(gm: fx.GraphModule, nodes: set[fx.Node], inputs, outputs, kind: str) -> Graph:
    """A graph computing `outputs` from `inputs` ((value name, node) pairs) with the `nodes` of gm."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for name, node in inputs:
        env[node] = g.placeholder(_identifier(name))
        env[node].meta = dict(node.meta)
    for node in gm.graph.nodes:
        if node in nodes and node not in env:
            env[node] = g.node_copy(node, lambda n: env[n])
    g.output(tuple(env[n] for _, n in outputs))
    g.eliminate_dead_code()
    g.lint()
    class_name = type(gm).__name__.replace("BW", kind)
    return Graph(fx.GraphModule(gm, g, class_name=class_name), tuple(n for n, _ in inputs),
                 tuple(n for n, _ in outputs))


def _identifier(value_name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in value_name)
