"""build_compute and accumulate_grads: the compute skeleton of a rank program.

build_compute is the lowering's front end: it turns the rank's action list into RUN ops, wiring every
stage-graph input to a global value name, and copies the stage graphs those ops call into the program's
graph table. Values produced on another rank stay undefined here (insert_p2p receives them):

    0F0 0F1 0B0 ...   ->   [0F0] s0.mb0.act:h, s0.mb0.saved:0 = stage0_f(param:l0.weight, mb0.data:0)
                           [0F1] s0.mb1.act:h, ...            = stage0_f(param:l0.weight, mb1.data:0)
                           [0B0] s0.mb0.grad:act:x, ...       = stage0_b(s0.mb0.saved:0, s1.mb0.grad:act:h)

It also copies updated buffers right after their F and sums the microbatch losses at the end.
accumulate_grads chains each parameter's per-microbatch gradients into one sum and hands it to .grad.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import fx

from zbcompile.errors import LoweringError
from zbcompile.passes.analysis.aliases import graph_output_owned
from zbcompile.ir.program import ProgramGraph, RankProgram
from zbcompile.ir.program.ops import AccumArgs, AccumMode, Op, OpKind, RunArgs, SetGradArgs, TensorType
from zbcompile.ir.names import key_of, primal_of
from zbcompile.ir.program.values import (GRAD_LOSS, LOSS, OUTPUTS, Role, acc_value, data_value, parse, python_name,
                                         role_of, stage_value, vocab_value)
from zbcompile.passes.lower.vocab import check_vocab, reports_loss, vocab_input, vocab_run
from zbcompile.ir.schedule import KIND_SPECS, Action, Kind, Schedule
from zbcompile.ir.stages import Graph, Stage, StagedModel

__all__ = ["build_compute", "accumulate_grads", "graph_key", "ACCUMULATING"]

# key suffix of a stage graph's accumulating variant (see accumulating_graph)
ACCUMULATING = "_acc"

_GRAPH_ATTR = {Kind.F: "f", Kind.B: "b", Kind.W: "w", Kind.BW: "bw"}


def graph_key(schedule: Schedule, action: Action) -> str:
    """`stage{model stage}_{f|b|w|bw}`: the key of the graph `action` runs (DualPipe's mirrored stages share)."""
    return f"stage{schedule.model_stage(action.stage)}_{_GRAPH_ATTR[action.kind]}"


def _program_graph(stage: Stage, g: Graph) -> ProgramGraph:
    """A stage graph with the types a pass needs of its outputs: boundary tensors and parameter gradients."""
    sent = {s.name: s for s in stage.send}
    received = {s.name: s for s in stage.recv}
    types = []
    for name in g.outputs:
        role = role_of(name)
        spec = (sent.get(name) if role is Role.ACT else received.get(primal_of(name))
                if role is Role.GRAD_ACT else None)
        if spec is not None:
            types.append(TensorType(tuple(spec.shape), spec.dtype))
        elif role is Role.GRAD_PARAM:
            types.append(_param_type(stage, primal_of(name)))
        else:
            types.append(None)
    return ProgramGraph(g.gm, g.inputs, g.outputs, types=tuple(types))


def _param_type(stage: Stage, param: str) -> TensorType | None:
    """Shape and dtype of a parameter, read off the fx metadata of a stage graph that takes it."""
    for g in (stage.f, stage.w, stage.bw):
        node = g.input_nodes().get(param)
        if node is not None:
            val = node.meta.get("val", node.meta.get("tensor_meta"))
            if val is None:
                raise LoweringError(f"stage {stage.index} graph placeholder {node.name} ({param}) carries no "
                                    f"meta['val']; trace stage graphs with make_fx / export so shapes are recorded")
            return TensorType(tuple(val.shape), val.dtype)
    return None


def _resolve_input(schedule: Schedule, action: Action, name: str) -> str:
    """The global value a stage-graph input named `name` reads, for `action`."""
    _, s, mb = action
    role = role_of(name)
    if role in (Role.PARAM, Role.BUFFER):
        return name
    if role is Role.DATA:
        return data_value(mb, int(key_of(name)))
    if role is Role.GRAD_LOSS:
        return GRAD_LOSS
    vocab = vocab_input(name, mb)
    if vocab is not None:
        return vocab
    if role is Role.ACT:
        if schedule.is_first(s):
            raise LoweringError(f"{action}: stage {s} is a first stage but its graph reads {name!r}; "
                                f"the split must feed first stages from data:<i> inputs only")
        return stage_value(s - 1, mb, name)
    if role is Role.GRAD_ACT:
        if schedule.is_last(s):
            raise LoweringError(f"{action}: stage {s} is a last stage but its graph reads {name!r}; "
                                f"last stages are seeded by grad:loss")
        return stage_value(s + 1, mb, name)
    if role in (Role.SAVED, Role.WSAVED, Role.LOSS):
        return stage_value(s, mb, name)
    raise LoweringError(f"{action}: stage graph input {name!r} has no known meaning; "
                        f"see zbcompile.ir.stages for the value names")


def build_compute(schedule: Schedule, staged: StagedModel, rank: int) -> RankProgram:
    """Rank `rank`'s program: one RUN op per action (the vocabulary layers' sharded ones included, without their
    collectives: passes/lower/vocab.py inserts those), buffer copies after F, and the loss sum at the end."""
    ops: list[Op] = []
    losses: list[str] = []
    outputs: list[tuple[int, int, str]] = []   # (microbatch, leaf, value) of a forward returning the outputs
    graphs: dict[str, ProgramGraph] = {}
    vocab = check_vocab(schedule, staged.vocab) if schedule.vocab_shards else None
    for action in schedule.ranks[rank]:
        if KIND_SPECS[action.kind].sharded:
            ops.append(vocab_run(vocab, action, graphs))
            if reports_loss(action):
                losses.append(vocab_value(action.microbatch, LOSS))
            continue
        stage = staged.stages[schedule.model_stage(action.stage)]
        g = getattr(stage, _GRAPH_ATTR[action.kind])
        key = graph_key(schedule, action)
        if key not in graphs:
            graphs[key] = _program_graph(stage, g)
        ins = tuple(_resolve_input(schedule, action, n) for n in g.inputs)
        outs = tuple(stage_value(action.stage, action.microbatch, n) for n in g.outputs)
        ops.append(Op(OpKind.RUN, ins, outs, RunArgs(action, key)))
        if action.kind is not Kind.F:
            continue
        for name, vid in zip(g.outputs, outs):
            if name == LOSS:
                losses.append(vid)
            elif role_of(name) is Role.OUTPUT:
                outputs.append((action.microbatch, int(key_of(name)), vid))
            elif role_of(name) is Role.BUFFER:
                ops.append(Op(OpKind.COPY_BUFFER, (name, vid), note="buffer update"))
    if losses:  # one sum of every microbatch's (0-dim) loss: one call, not one add per microbatch
        ops.append(Op(OpKind.ADD_LOSS, tuple(losses), (LOSS,), note=f"{len(losses)} microbatches"))
    if outputs:
        ops.append(Op(OpKind.KEEP_OUTPUTS, tuple(v for *_, v in sorted(outputs)), (OUTPUTS,),
                      note=f"{len(outputs)} output tensors"))
    output = OUTPUTS if outputs else LOSS if losses else None
    return RankProgram(schedule.name, rank, schedule.num_microbatches, inputs=_program_inputs(ops),
                       ops=tuple(ops), output=output, graphs=graphs)


def _program_inputs(ops: list[Op]) -> tuple[str, ...]:
    """grad_loss, params, buffers, then data, each in order of first use."""
    seen: dict[str, None] = {}
    for op in ops:
        for v in op.ins:
            if parse(v).scope in ("seed", "state", "data", "shard"):
                seen.setdefault(v)
    order = {Role.GRAD_LOSS: 0, Role.PARAM: 1, Role.BUFFER: 2, Role.VOCAB: 3}
    return tuple(sorted(seen, key=lambda v: order.get(parse(v).role, 4)))


# ---- the accumulating variant of a stage graph ----------------------------------------------------------
def accumulating_graph(g: ProgramGraph) -> ProgramGraph:
    """Stage graph `g` taking, after its own inputs, the running sum of each parameter gradient it returns
    (in output order); it adds the gradient into the sum in place and returns the sum in its place:

        def forward(self, saved_0, grad_act_h, acc_grad_param_w):
            mm = aten.mm(...)
            add_ = aten.add_.Tensor(acc_grad_param_w, mm)
            return (add_,)

    The sum is then the gradient accumulator autograd's AccumulateGrad would keep: the program calls no
    separate add, holds no per-microbatch gradient tensor, and the gradient's memory goes inside the graph.
    """
    graph = fx.Graph()
    outs = list(graph.graph_copy(g.gm.graph, {}))
    # (a graph without inputs returns only zeros: a parameter its stage reads without a gradient, see split_fbw)
    anchor = ([n for n in graph.nodes if n.op == "placeholder"] or [None])[-1]
    sums = {}
    extra = []
    for i, name in enumerate(g.outputs):
        if role_of(name) is Role.GRAD_PARAM:
            where = graph.inserting_after(anchor) if anchor is not None else graph.inserting_before(
                next(iter(graph.nodes)))
            with where:
                anchor = sums[i] = graph.placeholder("acc_" + python_name(name))
            if "val" in outs[i].meta:   # the sum is shaped as the gradient; a compiler reads placeholders' vals
                sums[i].meta["val"] = outs[i].meta["val"]
            extra.append("acc:" + name)
    for i, acc in sums.items():
        outs[i] = _sum_into(graph, acc, outs[i], anchor, outs)
    graph.output(tuple(outs))
    graph.lint()
    gm = fx.GraphModule(g.gm, graph, class_name=type(g.gm).__name__ + "Accumulating")
    return dataclasses.replace(g, gm=gm, inputs=g.inputs + tuple(extra))


def _sum_into(graph: fx.Graph, acc: fx.Node, grad: fx.Node, last_input: fx.Node, outs: list) -> fx.Node:
    """`acc += grad`, placed right after grad is computed (its memory goes as soon as it is summed) and, where
    grad is made by a GEMM or an embedding's backward that nothing else reads, fused into it:

        t(mm(a, b))                           ->  addmm_(acc, t(b), t(a))     no temporary, one pass less
        embedding_dense_backward(go, ids, ..) ->  index_add_(acc, 0, ids, go)  no dense zeros + scatter
    """
    aten = torch.ops.aten
    where = [last_input if grad.op == "placeholder" else grad]

    def emit(target, args):   # each new node after the previous one (fx's inserting_after does not advance)
        with graph.inserting_after(where[0]):
            where[0] = graph.call_function(target, args)
        return where[0]

    chain = _private_chain(grad, outs) if grad.op != "placeholder" else []
    root = chain[-1] if chain else None
    if root is not None and root.target is aten.mm.default:
        a, b = root.args
        if len(chain) % 2 == 0:   # an odd number of transposes above the mm: (a b)^T = b^T a^T
            a, b = emit(aten.t.default, (b,)), emit(aten.t.default, (a,))
        fused = emit(aten.addmm_.default, (acc, a, b))
    elif root is not None and _plain_embedding_backward(root) and len(chain) == 1:
        go, ids = root.args[:2]
        rows = emit(aten.flatten.using_ints, (go, 0, -2))
        fused = emit(aten.index_add_.default, (acc, 0, emit(aten.reshape.default, (ids, [-1])), rows))
    else:
        return emit(aten.add_.Tensor, (acc, grad))
    for node in chain:   # grad first: each one's only reader is gone before it goes
        graph.erase_node(node)
    return fused


def _private_chain(grad: fx.Node, outs: list) -> list[fx.Node]:
    """grad, then the nodes below it through transposes (t(t(mm))), as long as each is read by nothing but
    the one above it (grad itself: by nothing but this output), so that fusing may delete them all."""
    aten = torch.ops.aten
    if grad.users or sum(o is grad for o in outs) != 1:
        return []
    chain = [grad]
    while chain[-1].target is aten.t.default:
        below = chain[-1].args[0]
        if not isinstance(below, fx.Node) or len(below.users) != 1 or any(o is below for o in outs):
            return []
        chain.append(below)
    return chain


def _plain_embedding_backward(node: fx.Node) -> bool:
    """embedding_dense_backward without a padding row or frequency scaling: a plain scatter-add of rows."""
    if node.target is not torch.ops.aten.embedding_dense_backward.default or node.kwargs:
        return False
    padding_idx, scale_by_freq = node.args[3], node.args[4]
    return padding_idx < 0 and not scale_by_freq


# ---- accumulate_grads ---------------------------------------------------------------------------------
def accumulate_grads(program: RankProgram) -> RankProgram:
    """Sum each parameter's per-microbatch gradients; after the last one, accumulate into .grad.

    The first gradient is taken by reference (FIRST). Once the running sum is memory of its own (the first
    gradient when the stage graph returns it fresh and unshared, see aliases.graph_output_owned; else the
    out-of-place sum of the first two, ADD), later gradients are added into it in place. Where every
    gradient a RUN op returns goes into such a sum, the op runs the stage graph's accumulating variant
    (graph key + "_acc", added to the graph table), which takes the sums and adds into them itself; otherwise
    one ACCUM op per mode follows it (ADD_: one foreach call into the sums). The hand-off to .grad waits
    until the RUN's sends are posted: a peer may be waiting on them (the last B of a pipeline), and setting
    .grad is host time.

        [0W2] acc2.grad:param:a, acc2.grad:param:b = stage0_w_acc(s0.mb2.saved:0, ..., acc1.grad:param:a,
                                                                   acc1.grad:param:b)
    """
    counts: dict[str, int] = {}
    for op in program.run_ops():
        for _, name in _grad_outputs(op):
            counts[name] = counts.get(name, 0) + 1
    state = _Sums(program, dict(program.graphs))
    ops: list[Op] = []
    inputs = list(program.inputs)
    handoff: list[Op] = []   # SET_GRADs of the last RUN, held back until its sends are posted
    for op in program.ops:
        if op.kind is not OpKind.RUN:
            if op.kind is not OpKind.SEND:
                ops.extend(handoff)
                handoff.clear()
            ops.append(op)
            continue
        ops.extend(handoff)
        handoff.clear()
        grads = _grad_outputs(op)
        ops.extend(state.accumulate(op, grads))
        for _, name in grads:
            if state.seen[name] == counts[name]:
                param = primal_of(name)
                if param not in inputs:
                    inputs.append(param)
                handoff.append(Op(OpKind.SET_GRAD, (param, state.acc[name]), args=SetGradArgs(counts[name] > 1),
                                  note=f"{counts[name]} microbatches"))
    ops.extend(handoff)
    return program.replace(ops=tuple(ops), inputs=tuple(inputs), graphs=state.graphs)


def _grad_outputs(op: Op) -> list[tuple[int, str]]:
    """(output position, local name) of each parameter gradient a RUN op returns."""
    out = []
    for i, v in enumerate(op.outs):
        value = parse(v)
        if value.role is Role.GRAD_PARAM:
            out.append((i, value.local))
    return out


class _Sums:
    """The running sums of accumulate_grads: per gradient its latest sum, how many microbatches it holds,
    and whether it is memory of its own (may be written in place)."""

    def __init__(self, program: RankProgram, graphs: dict[str, ProgramGraph]):
        self.program = program
        self.graphs = graphs
        self.seen: dict[str, int] = {}
        self.acc: dict[str, str] = {}
        self.owned: dict[str, bool] = {}

    def accumulate(self, op: Op, grads) -> list[Op]:
        g = self.graphs[op.args.graph]
        in_place = bool(grads) and all(self.owned.get(name, False) for _, name in grads) and _computed(g, grads)
        return [self._accumulating_run(op, grads)] if in_place else [op] + self._accum_ops(op, g, grads)

    def _accumulating_run(self, op: Op, grads) -> Op:
        key = op.args.graph + ACCUMULATING
        if key not in self.graphs:
            self.graphs[key] = accumulating_graph(self.graphs[op.args.graph])
        olds, outs = [], list(op.outs)
        for i, name in grads:
            k = self.seen[name] = self.seen[name] + 1
            olds.append(self.acc[name])
            outs[i] = self.acc[name] = acc_value(k - 1, name)
        return op._replace(ins=op.ins + tuple(olds), outs=tuple(outs), args=op.args._replace(graph=key))

    def _accum_ops(self, op: Op, g: ProgramGraph, grads) -> list[Op]:
        fresh = graph_output_owned(g.gm) if grads else ()
        groups: dict[AccumMode, list[tuple[str, str, str]]] = {}   # mode -> [(microbatch grad, new sum, old)]
        for i, name in grads:
            k = self.seen[name] = self.seen.get(name, 0) + 1
            mode = AccumMode.FIRST if k == 1 else AccumMode.ADD_ if self.owned[name] else AccumMode.ADD
            self.owned[name] = fresh[i] if k == 1 else True
            groups.setdefault(mode, []).append((op.outs[i], acc_value(k - 1, name), self.acc.get(name, "")))
            self.acc[name] = acc_value(k - 1, name)
        return [Op(OpKind.ACCUM, (() if mode is AccumMode.FIRST else tuple(old for _, _, old in items))
                   + tuple(v for v, _, _ in items), tuple(new for _, new, _ in items), AccumArgs(mode))
                for mode, items in groups.items()]


def _computed(g: ProgramGraph, grads) -> bool:
    """Every gradient output of the graph is a tensor the graph computes (not a constant / None)."""
    out = g.gm.graph.output_node().args[0]
    return all(isinstance(out[i], fx.Node) for i, _ in grads)
