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

The package, in the order a stage goes through it:

    __init__.py   the pass: split_fbw over the partition, split_stage for one stage
    joint.py      the stage forward made fit for aot's joint trace (1.), and the trivial stages
    diagnose.py   SplitError's text when the joint trace fails
    fbw.py        F and BW from the min-cut partition (2.)
    b_w.py        BW cut into B and W (3.)
    common.py     what they share: aten, placeholders by position, value names as identifiers
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Callable, Mapping, Sequence

import torch
from torch import fx

from zbcompile._torch_private import FakeTensorMode, aot_export_joint_simple, min_cut_rematerialization_partition
from zbcompile.errors import SplitError
from zbcompile.ir.names import VOCAB_EMB, Role, key_of, role_of
from zbcompile.ir.stages import Graph, Partition, Stage, StagedModel, TensorSpec
from zbcompile.passes.forward_only import output_graph
from zbcompile.passes.split_fbw.b_w import _split_b_w
from zbcompile.passes.split_fbw.common import _aten, _placeholder
from zbcompile.passes.split_fbw.diagnose import _explain_joint_failure
from zbcompile.passes.split_fbw.fbw import _backward_graph, _forward_graph, _zeros
from zbcompile.passes.split_fbw.joint import (_differentiable_forward, _fake_arg, _trivial_program,
                                             _views_as_reshapes)

__all__ = ["split_fbw", "split_stage"]


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

    # sent without a gradient: what later stages read only detached, known up front (which spares the second
    # pass `_unanswered` would otherwise take for them), then what no stage's backward returns
    read, detached = _reads(cut.stages)
    gradless = frozenset(n for n in detached if n not in read)
    memo: dict = {}
    while True:   # twice at most where a stage sends on only what carries no gradient (below)
        stages = []
        for sg in cut.stages:
            dropped = frozenset(n for n in sg.outputs if n in gradless)
            key = (sg.index, dropped, tuple(requires_grad(n) for n in sg.inputs))
            if key not in memo:
                memo[key] = split_stage(sg, requires_grad, device=traced.device, no_grad_sends=dropped)
            stages.append(memo[key])
            acts.update((spec.name, spec.requires_grad) for spec in stages[-1].send)
        unanswered = _unanswered(stages)
        if not unanswered:
            break
        if unanswered <= gradless:   # (each pass detaches them at their sender: never twice the same)
            raise SplitError(f"activations {sorted(unanswered)} are sent with a gradient no stage returns")
        gradless |= unanswered
    # the loss stage's forward returning the model's outputs, kept for an evaluation step that asks for them
    meta = {"split_points": cut.split_points, "outputs": output_graph(cut)}
    sharded = frozenset(cut.vocab.params) if cut.vocab is not None else frozenset()
    stages = _grade_shared(stages, traced.frozen, traced.device)
    return StagedModel(_hold_unused(tuple(stages), traced, sharded), traced.num_inputs, traced.num_targets,
                       traced.tied, meta, cut.vocab)


def _grade_shared(stages: list[Stage], frozen, device) -> list[Stage]:
    """`stages` where a stage that reads a trained parameter without a gradient (under torch.no_grad(), through
    a detach) while another stage differentiates it returns a zero gradient for it. Its rank holds a copy of the
    parameter: without a gradient of its own it would take no part in the sum of the copies' gradients, keep
    `.grad` None, and its copy would never move while the others do. A parameter no stage differentiates keeps
    no gradient anywhere, as in eager."""
    graded = {key_of(n) for st in stages for n in st.w.outputs if role_of(n) is Role.GRAD_PARAM}
    out = []
    for st in stages:
        missing = [p for p in st.params if p in graded and p not in frozen and f"grad:param:{p}" not in st.w.outputs]
        if missing:
            likes = [_placeholder(st.f.gm, st.f.inputs.index(f"param:{p}")).meta["val"] for p in missing]
            names = tuple(f"grad:param:{p}" for p in missing)
            st = dataclasses.replace(st, w=_with_zeros(st.w, names, likes, device),
                                     bw=_with_zeros(st.bw, names, likes, device))
        out.append(st)
    return out


def _with_zeros(graph: Graph, names: tuple[str, ...], likes, device) -> Graph:
    """`graph` returning zeros shaped as each of `likes` too, named `names`."""
    gm = fx.GraphModule(graph.gm, copy.deepcopy(graph.gm.graph), class_name=type(graph.gm).__name__)
    out = gm.graph.output_node()
    with gm.graph.inserting_before(out):
        zeros = [_zeros(gm.graph, like, device) for like in likes]
    out.args = (tuple(out.args[0]) + tuple(zeros),)
    gm.recompile()
    return dataclasses.replace(graph, gm=gm, outputs=graph.outputs + names)


def _unanswered(stages: Sequence[Stage]) -> frozenset[str]:
    """The activations sent with a gradient that the next stage's backward never returns: it reads them only
    through ops without a derivative (`h.argmax(-1)`) or for their shape, so no gradient reaches them. Their
    senders must not wait for one: they are split again sending them without, and in turn may have no backward
    left. Upstream of an argmax eager gives no gradient either (`.grad` None, which AdamW's weight decay skips:
    a zero gradient sent back instead would move those weights)."""
    missing = set()
    for st in stages[1:]:
        missing.update(spec.name for spec in st.recv
                       if spec.requires_grad and spec.name != VOCAB_EMB and f"grad:{spec.name}" not in st.bw.outputs)
    return frozenset(missing)


def _reads(stages: Sequence[Graph]) -> tuple[set[str], set[str]]:
    """The activations some stage reads other than through `detach` (a later stage's B returns their gradient),
    and those some stage reads through `detach` alone. A value computed under torch.no_grad() (an EMA buffer's
    new value read in a later stage) is read detached there, as the trace marks the region's reads: where no
    stage reads it otherwise, its sender must not wait for a gradient of it. (What the vocabulary layers read
    is in neither set, and keeps its gradient.)"""
    read, detached = set(), set()
    for sg in stages:
        for name, ph in zip(sg.inputs, sg.gm.graph.find_nodes(op="placeholder")):
            users = [u for u in ph.users if u.op != "output"]   # (sending it on to a later stage: theirs count)
            if role_of(name) is Role.ACT and users:
                plain = any(u.target is not _aten.detach.default for u in users)
                (read if plain else detached).add(name)
    return read, detached


def _hold_unused(stages: tuple[Stage, ...], traced, sharded: frozenset[str] = frozenset()) -> tuple[Stage, ...]:
    """`stages` where each parameter and buffer of the model that no stage reads (a rotary embedding's saved
    copy of its frequencies, a parameter of an unused head) is listed by exactly one stage: the one whose
    modules hold the longest prefix of its name, else the first. A rank keeps real storage only for what its
    stages list (zbcompile.distributed.keep_only), so without this such state would be dropped everywhere and
    vanish from the model's state dict; listed here, it stays real on that stage's rank, untouched. The
    vocabulary parameters (`sharded`) are every rank's, as shards: no stage lists them."""
    used = {name for st in stages for name in (*st.f.inputs, *st.f.outputs)} | {"param:" + n for n in sharded}
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


def split_stage(stage: Graph, requires_grad: Callable[[str], bool], device: torch.device | None = None,
                no_grad_sends: frozenset[str] = frozenset()) -> Stage:
    """Build F, B, W and BW for `stage` (a stage forward of the partition); `requires_grad(name)` says which
    inputs are differentiable; `no_grad_sends`, which sent activations no later stage reads with a gradient.

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
    graded_buffers = [n for n in diff_names if (role_of(n) is Role.BUFFER or n in no_grad_sends) and out_rg[n]]
    if graded_buffers:
        diff_gm = _detach_outputs(diff_gm, [diff_names.index(n) for n in graded_buffers])
        out_rg.update(dict.fromkeys(graded_buffers, False))
    in_rg = {name: bool(a.requires_grad) for name, a in zip(stage.inputs, args)}
    rg = {**in_rg, **out_rg, **{p: in_rg[p] for p in stage.passthrough}}
    if not any(in_rg.values()) or not any(out_rg.values()):
        # nothing to differentiate: no input requires grad, no output carries a gradient (the stage's work is
        # detached or under torch.no_grad(), as eager's is), or the stage only re-sends what it received (a
        # stage that returns its input, e.g. one doing nothing but `.to(dtype)`); aot cannot trace a joint
        # without a graded output
        return _stage(stage, *_trivial_program(stage, diff_names, diff_gm, in_rg), rg)
    try:
        joint = aot_export_joint_simple(diff_gm, args, trace_joint=True)
        fw, bw = min_cut_rematerialization_partition(joint, args, num_fwd_outputs=len(diff_names))
    except Exception as exc:  # torch's errors name aot internals; ours names the stage, the node and the fix
        raise SplitError(_explain_joint_failure(stage, diff_gm, exc)) from exc
    f, saved = _forward_graph(stage, fw, diff_names)
    tangents = [f"grad:{n}" for n in diff_names if out_rg[n]]
    bw_graph = _backward_graph(stage, bw, saved, tangents, in_rg, device)
    b, w = _split_b_w(bw_graph)
    return _stage(stage, f, b, w, bw_graph, rg)


def _detach_outputs(gm: fx.GraphModule, positions: Sequence[int]) -> fx.GraphModule:
    """`gm` with the outputs at `positions` detached: a buffer's new value computed from values that require grad
    (an update written under torch.no_grad(), whose region the trace does not keep, as spectral_norm's power
    iteration or a running average of activations). No gradient flows into a buffer's next value in eager
    either; reads of the new value later in the same step keep theirs (they read the value, not the output)."""
    out = gm.graph.output_node()
    results = list(out.args[0])
    with gm.graph.inserting_before(out):
        for i in positions:
            value = results[i]
            if any(_aliases(r, value) for j, r in enumerate(results) if j != i):   # also sent on to a later stage:
                value = gm.graph.call_function(_aten.clone.default, (value,))   # a detached alias of another
                value.meta["val"] = results[i].meta["val"].clone()                # output is one aot refuses
            node = gm.graph.call_function(_aten.detach.default, (value,))
            node.meta["val"] = results[i].meta["val"].detach()
            results[i] = node
    out.args = (tuple(results),)
    gm.recompile()
    return gm


def _aliases(node, value: fx.Node) -> bool:
    """Whether the output `node` is `value` or a view of it (an op whose schema returns an alias: contiguous,
    view, ...)."""
    if node is value:
        return True
    schema = getattr(getattr(node, "target", None), "_schema", None)
    return (schema is not None and value in node.args[:1] and bool(schema.returns)
            and schema.returns[0].alias_info is not None)


def _stage(sg: Graph, f: Graph, b: Graph, w: Graph, bw: Graph, rg: Mapping[str, bool]) -> Stage:
    """The stage IR record for stage forward `sg` and its four graphs; `rg` says which values carry grads."""

    def spec(name: str, val: torch.Tensor) -> TensorSpec:
        return TensorSpec(name, tuple(int(d) for d in val.shape), val.dtype, rg[name])

    def values(nodes: Mapping[str, fx.Node]) -> dict[str, torch.Tensor]:
        return {name: node.meta["val"] for name, node in nodes.items()}

    return Stage(
        index=sg.index,
        f=_views_as_reshapes(f),
        b=_views_as_reshapes(b),
        w=_views_as_reshapes(w),
        bw=_views_as_reshapes(bw),
        params=tuple(key_of(n) for n in sg.inputs if role_of(n) is Role.PARAM),
        # read, then only written (`self.last.copy_(x)`): the stage's rank must hold what its F writes back
        buffers=tuple(dict.fromkeys(key_of(n) for n in (*sg.inputs, *sg.outputs) if role_of(n) is Role.BUFFER)),
        recv=tuple(spec(n, v) for n, v in values(sg.input_nodes()).items() if role_of(n) is Role.ACT),
        send=tuple(spec(n, v) for n, v in values(sg.output_nodes()).items() if role_of(n) is Role.ACT),
        data=tuple(int(key_of(n)) for n in sg.inputs if role_of(n) is Role.DATA),
        modules=sg.modules,
        has_loss="loss" in sg.outputs,
    )
