"""reduce_shared_grads: sum the gradient of a parameter that several ranks hold.

A parameter is shared when the stages of more than one rank produce its gradient: a tied embedding / head
on the first and last stage, or DualPipe's mirrored copies of every stage. (Two stages on the *same*
rank need nothing here: accumulate_grads already summed them.) Each holder sends its finished sum to every
other holder right after its last microbatch, and at the end of the step adds all copies in rank order,
so every holder computes the bit-identical total:

    acc3.grad:param:wte = ...                     acc3.grad:param:wte = ...
    set_grad(param:wte, acc3...)          ->      h:sendR0 = isend(acc3.grad:param:wte -> 1 tag T)
                                                  h:r1.grad:param:wte = irecv(from 1 tag T)
                                                  ...                              (rest of the step)
                                                  r1.grad:param:wte = wait_recv(h:r1.grad:param:wte)
                                                  sum.grad:param:wte = sum(acc3..., r1.grad:param:wte)
                                                  set_grad(param:wte, sum.grad:param:wte)
"""

from __future__ import annotations

from zbcompile.errors import LoweringError
from zbcompile.program import Op, OpKind, RankProgram
from zbcompile.passes.lower.p2p import reduce_tag
from zbcompile.schedule import Schedule
from zbcompile.stages import StagedModel, TensorSpec

__all__ = ["reduce_shared_grads", "grad_holders"]


def grad_holders(schedule: Schedule, staged: StagedModel) -> dict[str, tuple[int, ...]]:
    """Parameter fqn -> the sorted ranks whose stages produce its gradient."""
    holders: dict[str, set[int]] = {}
    for s, rank in enumerate(schedule.placement):
        stage = staged.stages[schedule.model_stage(s)]
        for name in stage.w.outputs + stage.bw.outputs:
            if name.startswith("grad:param:"):
                holders.setdefault(name[len("grad:param:"):], set()).add(rank)
    return {fqn: tuple(sorted(r)) for fqn, r in sorted(holders.items())}


def reduce_shared_grads(program: RankProgram) -> RankProgram:
    holders = grad_holders(program.schedule, program.staged)
    index = {fqn: i for i, fqn in enumerate(holders)}
    rank = program.rank
    ops: list[Op] = []
    tail_recv: list[Op] = []
    tail_sum: list[Op] = []
    tail_send: list[Op] = []
    for op in program.ops:
        fqn = op.ins[0][len("param:"):] if op.kind is OpKind.SET_GRAD else None
        if fqn is None or len(holders.get(fqn, ())) < 2:
            ops.append(op)
            continue
        acc = op.ins[1]
        others = [q for q in holders[fqn] if q != rank]
        tag = reduce_tag(program.schedule, program.staged, index[fqn])
        send = f"h:sendR.{fqn}"
        spec = _grad_spec(program, fqn, others[0])
        ops.append(Op(OpKind.SEND, (acc,) * len(others), (send,), peers=tuple(others), tags=(tag,) * len(others),
                      specs=(spec,) * len(others), note=f"shared with ranks {list(holders[fqn])}"))
        copies = {rank: acc}
        for q in others:
            handle = f"h:r{q}.grad:param:{fqn}"
            ops.append(Op(OpKind.RECV, (), (handle,), peers=(q,), tags=(tag,), specs=(spec,)))
            copies[q] = f"r{q}.grad:param:{fqn}"
            tail_recv.append(Op(OpKind.WAIT_RECV, (handle,), (copies[q],)))
        total = f"sum.grad:param:{fqn}"
        tail_sum.append(Op(OpKind.SUM, tuple(copies[q] for q in holders[fqn]), (total,), note="in rank order"))
        tail_sum.append(Op(OpKind.SET_GRAD, (op.ins[0], total), arg=True))
        tail_send.append(Op(OpKind.WAIT_SEND, (send,)))
    return program.replace(ops=tuple(ops + tail_recv + tail_sum + tail_send))


def _grad_spec(program: RankProgram, fqn: str, peer: int) -> TensorSpec:
    """Shape and dtype of parameter `fqn`, read off the fx metadata of a stage graph that uses it."""
    for stage in program.staged.stages:
        for graph in (stage.f, stage.w, stage.bw):
            node = graph.input_nodes().get(f"param:{fqn}")
            if node is not None:
                return _spec_of(node, fqn)
    raise LoweringError(f"rank {program.rank}: parameter {fqn!r} (shared with rank {peer}) is read by no stage "
                        f"graph, so its gradient shape is unknown")


def _spec_of(node, fqn: str) -> TensorSpec:
    val = node.meta.get("val", node.meta.get("tensor_meta"))
    if val is None:
        raise LoweringError(f"stage graph placeholder {node.name} (param:{fqn}) carries no meta['val']; "
                            f"trace stage graphs with make_fx / export so shapes are recorded")
    return TensorSpec(f"grad:param:{fqn}", tuple(val.shape), val.dtype)
