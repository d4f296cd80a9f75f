"""build_compute and accumulate_grads: the compute skeleton of a rank program.

build_compute turns the rank's action list into RUN ops, wiring every stage-graph input to a global value
name; values produced on another rank stay undefined here (insert_p2p receives them):

    0F0 0F1 0B0 ...   ->   s0.mb0.act:h, s0.mb0.saved:0 = stage0.f(param:l0.weight, mb0.data:0)
                           s0.mb1.act:h, ...            = stage0.f(param:l0.weight, mb1.data:0)
                           s0.mb0.grad:act:x, ...       = stage0.b(s0.mb0.saved:0, s1.mb0.grad:act:h)

It also copies updated buffers right after their F and sums the microbatch losses at the end.
accumulate_grads chains each parameter's per-microbatch gradients into one sum and hands it to .grad.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import fx

from zbcompile.errors import LoweringError
from zbcompile.passes.analysis.aliases import graph_output_owned
from zbcompile.program import Op, OpKind, RankProgram, data_id, python_name, split_value_id, value_id
from zbcompile.schedule import Action, Kind
from zbcompile.stages import Graph, Stage

__all__ = ["build_compute", "accumulate_grads", "stage_graph", "graph_module_name", "run_graph",
           "accumulating_graph", "ACCUMULATING"]

# RUN op arg: the op runs the stage graph's accumulating variant (see accumulating_graph)
ACCUMULATING = "accumulate"

_GRAPH_ATTR = {Kind.F: "f", Kind.B: "b", Kind.W: "w", Kind.BW: "bw"}


def stage_graph(program: RankProgram, action: Action) -> tuple[Stage, Graph]:
    stage = program.staged.stages[program.schedule.model_stage(action.stage)]
    return stage, getattr(stage, _GRAPH_ATTR[action.kind])


def run_graph(program: RankProgram, op: Op) -> fx.GraphModule:
    """The GraphModule RUN op `op` calls: its stage graph, or that graph's accumulating variant."""
    _, g = stage_graph(program, op.action)
    return accumulating_graph(g) if op.arg == ACCUMULATING else g.gm


def accumulating_graph(g: Graph) -> fx.GraphModule:
    """Stage graph `g` taking, after its own inputs, the running sum of each parameter gradient it returns
    (in output order); it adds the gradient into the sum in place and returns the sum in its place:

        def forward(self, saved_0, grad_act_h, acc_grad_param_w):
            mm = aten.mm(...)
            add_ = aten.add_.Tensor(acc_grad_param_w, mm)
            return (add_,)

    The sum is then the gradient accumulator autograd's AccumulateGrad would keep: the program calls no
    separate add, holds no per-microbatch gradient tensor, and the gradient's memory goes inside the graph.
    """
    cached = g.gm.meta.get("zb_accumulating")
    if cached is None:
        cached = g.gm.meta["zb_accumulating"] = _build_accumulating(g)
    return cached


def _build_accumulating(g: Graph) -> fx.GraphModule:
    graph = fx.Graph()
    outs = list(graph.graph_copy(g.gm.graph, {}))
    anchor = [n for n in graph.nodes if n.op == "placeholder"][-1]
    sums = {}
    for i, name in enumerate(g.outputs):
        if name.startswith("grad:param:"):
            with graph.inserting_after(anchor):
                anchor = sums[i] = graph.placeholder("acc_" + python_name(name))
    for i, acc in sums.items():
        outs[i] = _sum_into(graph, acc, outs[i], anchor, outs)
    graph.output(tuple(outs))
    graph.lint()
    return fx.GraphModule(g.gm, graph, class_name=type(g.gm).__name__ + "Accumulating")


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


def graph_module_name(program: RankProgram, action: Action) -> str:
    return f"stage{program.schedule.model_stage(action.stage)}_{_GRAPH_ATTR[action.kind]}"


def _resolve_input(program: RankProgram, action: Action, name: str) -> str:
    """The global value a stage-graph input named `name` reads, for `action`."""
    _, s, mb = action
    sched = program.schedule
    if name.startswith(("param:", "buffer:")):
        return name
    if name.startswith("data:"):
        return data_id(mb, int(name[5:]))
    if name == "grad:loss":
        return "grad_loss"
    if name.startswith("act:"):
        if sched.is_first(s):
            raise LoweringError(f"{action}: stage {s} is a first stage but its graph reads {name!r}; "
                                f"the split must feed first stages from data:<i> inputs only")
        return value_id(s - 1, mb, name)
    if name.startswith("grad:act:"):
        if sched.is_last(s):
            raise LoweringError(f"{action}: stage {s} is a last stage but its graph reads {name!r}; "
                                f"last stages are seeded by grad:loss")
        return value_id(s + 1, mb, name)
    if name.startswith(("saved:", "wsaved:")) or name == "loss":
        return value_id(s, mb, name)
    raise LoweringError(f"{action}: stage graph input {name!r} has no known meaning; "
                        f"see zbcompile.stages for the value names")


def build_compute(program: RankProgram) -> RankProgram:
    """One RUN op per action of this rank, buffer copies after F, and the loss sum at the end."""
    ops: list[Op] = []
    losses: list[str] = []
    for action in program.schedule.ranks[program.rank]:
        stage, graph = stage_graph(program, action)
        ins = tuple(_resolve_input(program, action, n) for n in graph.inputs)
        outs = tuple(value_id(action.stage, action.microbatch, n) for n in graph.outputs)
        ops.append(Op(OpKind.RUN, ins, outs, action=action, graph=graph_module_name(program, action)))
        if action.kind is not Kind.F:
            continue
        for name, vid in zip(graph.outputs, outs):
            if name == "loss":
                losses.append(vid)
            elif name.startswith("buffer:"):
                ops.append(Op(OpKind.COPY_BUFFER, (name, vid), action=action, note="buffer update"))
    if losses:  # one sum of every microbatch's (0-dim) loss: one call, not one add per microbatch
        ops.append(Op(OpKind.ADD_LOSS, tuple(losses), ("loss",), note=f"{len(losses)} microbatches"))
    inputs = _program_inputs(ops)
    return program.replace(ops=tuple(ops), inputs=inputs, output="loss" if losses else None)


def _program_inputs(ops: list[Op]) -> tuple[str, ...]:
    """grad_loss, params, buffers, then data, each in order of first use."""
    seen: dict[str, None] = {}
    for op in ops:
        for v in op.ins:
            if split_value_id(v) is None and v != "loss":
                seen.setdefault(v)
    order = {"grad_loss": 0, "param:": 1, "buffer:": 2}

    def rank_of(v: str) -> int:
        return next((k for p, k in order.items() if v.startswith(p)), 3)

    return tuple(sorted(seen, key=rank_of))


def accumulate_grads(program: RankProgram) -> RankProgram:
    """Sum each parameter's per-microbatch gradients; after the last one, accumulate into .grad.

    The first gradient is taken by reference ("first"). Once the running sum is memory of its own (the
    first gradient when the stage graph returns it fresh and unshared, see aliases.graph_output_owned;
    else the out-of-place sum of the first two, "add"), later gradients are added into it in place. Where
    every gradient a RUN op returns goes into such a sum, the op runs the stage graph's accumulating
    variant, which takes the sums and adds into them itself; otherwise one ACCUM op per mode follows it
    ("add_": one foreach call into the sums). The hand-off to .grad waits until the RUN's sends are posted:
    a peer may be waiting on them (the last B of a pipeline), and setting .grad is host time.

        [0W2] acc2.grad:param:a, acc2.grad:param:b = stage0_w.accumulate(s0.mb2.saved:0, ..., acc1.grad:param:a,
                                                                          acc1.grad:param:b)
    """
    counts: dict[str, int] = {}
    for op in program.run_ops():
        for v in op.outs:
            name = split_value_id(v)[2]
            if name.startswith("grad:param:"):
                counts[name] = counts.get(name, 0) + 1
    seen: dict[str, int] = {}
    acc: dict[str, str] = {}
    owned: dict[str, bool] = {}   # is the running sum memory of its own (may be written in place)?
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
        in_place = (bool(grads) and all(owned.get(name, False) for _, name in grads)
                    and _computed(program, op, grads))
        if in_place:
            ops.append(_accumulating_run(op, grads, acc, seen))
        else:
            ops.append(op)
            ops.extend(_accum_ops(program, op, grads, acc, seen, owned))
        for _, name in grads:
            if seen[name] == counts[name]:
                param = name[len("grad:"):]
                if param not in inputs:
                    inputs.append(param)
                handoff.append(Op(OpKind.SET_GRAD, (param, acc[name]), arg=counts[name] > 1,
                                  note=f"{counts[name]} microbatches"))
    ops.extend(handoff)
    return program.replace(ops=tuple(ops), inputs=tuple(inputs))


def _grad_outputs(op: Op) -> list[tuple[int, str]]:
    """(output position, name) of each parameter gradient a RUN op returns."""
    out = []
    for i, v in enumerate(op.outs):
        name = split_value_id(v)[2]
        if name.startswith("grad:param:"):
            out.append((i, name))
    return out


def _computed(program: RankProgram, op: Op, grads) -> bool:
    """Every gradient output of op's stage graph is a tensor the graph computes (not a constant / None)."""
    out = run_graph(program, op).graph.output_node().args[0]
    return all(isinstance(out[i], fx.Node) for i, _ in grads)


def _accumulating_run(op: Op, grads, acc: dict, seen: dict) -> Op:
    olds, outs = [], list(op.outs)
    for i, name in grads:
        k = seen[name] = seen[name] + 1
        olds.append(acc[name])
        outs[i] = acc[name] = f"acc{k - 1}.{name}"
    return dataclasses.replace(op, ins=op.ins + tuple(olds), outs=tuple(outs), arg=ACCUMULATING)


def _accum_ops(program: RankProgram, op: Op, grads, acc: dict, seen: dict, owned: dict) -> list[Op]:
    fresh = graph_output_owned(run_graph(program, op))
    groups: dict[str, list[tuple[str, str, str]]] = {}   # mode -> [(microbatch grad, new sum, old sum)]
    for i, name in grads:
        v = op.outs[i]
        k = seen[name] = seen.get(name, 0) + 1
        mode = "first" if k == 1 else "add_" if owned[name] else "add"
        owned[name] = fresh[i] if k == 1 else True
        groups.setdefault(mode, []).append((v, f"acc{k - 1}.{name}", acc.get(name, "")))
        acc[name] = f"acc{k - 1}.{name}"
    return [Op(OpKind.ACCUM, (() if mode == "first" else tuple(old for _, _, old in items))
               + tuple(v for v, _, _ in items), tuple(new for _, new, _ in items), action=op.action, arg=mode)
            for mode, items in groups.items()]
