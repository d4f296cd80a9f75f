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

from zbcompile.errors import LoweringError
from zbcompile.program import Op, OpKind, RankProgram, data_id, split_value_id, value_id
from zbcompile.schedule import Action, Kind
from zbcompile.stages import Graph, Stage

__all__ = ["build_compute", "accumulate_grads", "stage_graph", "graph_module_name"]

_GRAPH_ATTR = {Kind.F: "f", Kind.B: "b", Kind.W: "w", Kind.BW: "bw"}


def stage_graph(program: RankProgram, action: Action) -> tuple[Stage, Graph]:
    stage = program.staged.stages[program.schedule.model_stage(action.stage)]
    return stage, getattr(stage, _GRAPH_ATTR[action.kind])


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

    The first gradient is taken by reference ("first"), the second summed out of place ("add", so the sum
    owns its storage and never aliases a tensor another op still reads) and later ones in place ("add_").
    One ACCUM op covers every gradient of one RUN op with the same mode, so the emitted program makes one
    foreach call per W instead of one add per parameter (host time per action on small stages):

        acc2.grad:param:a, acc2.grad:param:b = accum(acc1.grad:param:a, acc1.grad:param:b,
                                                     s0.mb2.grad:param:a, s0.mb2.grad:param:b; add_)
    """
    counts: dict[str, int] = {}
    for op in program.run_ops():
        for v in op.outs:
            name = split_value_id(v)[2]
            if name.startswith("grad:param:"):
                counts[name] = counts.get(name, 0) + 1
    seen: dict[str, int] = {}
    acc: dict[str, str] = {}
    ops: list[Op] = []
    inputs = list(program.inputs)
    for op in program.ops:
        ops.append(op)
        if op.kind is not OpKind.RUN:
            continue
        groups: dict[str, list[tuple[str, str, str]]] = {}   # mode -> [(param grad name, new value, old sum)]
        for v in op.outs:
            name = split_value_id(v)[2]
            if not name.startswith("grad:param:"):
                continue
            k = seen[name] = seen.get(name, 0) + 1
            mode = "first" if k == 1 else "add" if k == 2 else "add_"
            groups.setdefault(mode, []).append((v, f"acc{k - 1}.{name}", acc.get(name, "")))
            acc[name] = f"acc{k - 1}.{name}"
        for mode, items in groups.items():
            olds = () if mode == "first" else tuple(old for _, _, old in items)
            ops.append(Op(OpKind.ACCUM, olds + tuple(v for v, _, _ in items), tuple(new for _, new, _ in items),
                          action=op.action, arg=mode))
        for v in op.outs:
            name = split_value_id(v)[2]
            if name.startswith("grad:param:") and seen[name] == counts[name]:
                param = name[len("grad:"):]
                if param not in inputs:
                    inputs.append(param)
                ops.append(Op(OpKind.SET_GRAD, (param, acc[name]), arg=counts[name] > 1,
                              note=f"{counts[name]} microbatches"))
    return program.replace(ops=tuple(ops), inputs=tuple(inputs))
