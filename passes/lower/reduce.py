"""reduce_shared_grads: sum the gradient of a parameter that several ranks hold. A cross-rank pass.

A parameter is shared when more than one rank hands a gradient of it to .grad: a tied embedding / head on
the first and last stage, or DualPipe's mirrored copies of every stage. (Two stages on the *same* rank need
nothing here: accumulate_grads already summed them.) Each holder sends its finished sum to every other
holder right after its last microbatch, and at the end of the step adds all copies in rank order, so every
holder computes the bit-identical total:

    acc3.grad:param:wte = ...                     acc3.grad:param:wte = ...
    set_grad(param:wte, acc3...)          ->      h:sendR.wte = isend(acc3.grad:param:wte -> 1 tag T ...)
                                                  h:r1.grad:param:wte = irecv(from 1 tag T ...)
                                                  ...                              (rest of the step)
                                                  r1.grad:param:wte = wait_recv(h:r1.grad:param:wte)
                                                  sum.grad:param:wte = sum(acc3..., r1.grad:param:wte)
                                                  set_grad(param:wte, sum.grad:param:wte; True)

Tags come after every P2P tag (TagSpace.end), one per parameter in name order.
"""

from __future__ import annotations

from typing import Sequence

import torch

from zbcompile.errors import LoweringError
from zbcompile.passes.lower.p2p import TagSpace
from zbcompile.ir.program import RankProgram
from zbcompile.ir.program.ops import Message, Op, OpKind, RecvArgs, SendArgs, SetGradArgs, TensorType
from zbcompile.ir.program.values import Role, handle, key_of, parse, role_of
from zbcompile.ir.schedule import KIND_SPECS

__all__ = ["reduce_shared_grads", "grad_holders", "grad_types", "check_dense"]


def grad_holders(programs: Sequence[RankProgram]) -> dict[str, tuple[int, ...]]:
    """Parameter fqn -> the sorted ranks whose programs hand a gradient of it to .grad. A vocabulary parameter
    is no shared one: each rank holds its own shard of rows (read by the sharded actions' graphs)."""
    sharded = {parse(v).key for p in programs for op in p.run_ops() if KIND_SPECS[op.args.action.kind].sharded
               for v in op.ins if parse(v).role is Role.PARAM}
    holders: dict[str, set[int]] = {}
    for p in programs:
        for op in p.of_kind(OpKind.SET_GRAD):
            if parse(op.ins[0]).key not in sharded:
                holders.setdefault(parse(op.ins[0]).key, set()).add(p.rank)
    return {fqn: tuple(sorted(r)) for fqn, r in sorted(holders.items())}


def reduce_shared_grads(programs: Sequence[RankProgram]) -> tuple[RankProgram, ...]:
    holders = grad_holders(programs)
    check_dense(programs, {fqn: f"ranks {list(r)} each hold a copy of it (a tied weight, or DualPipe's mirrored "
                                f"stages)" for fqn, r in holders.items() if len(r) > 1})
    base = TagSpace.of(programs).end
    tags = {fqn: base + i for i, fqn in enumerate(holders)}
    types = grad_types(programs)
    return tuple(_reduce(p, holders, tags, types) for p in programs)


def _reduce(program: RankProgram, holders, tags, types) -> RankProgram:
    rank = program.rank
    ops: list[Op] = []
    tail_recv: list[Op] = []
    tail_sum: list[Op] = []
    tail_send: list[Op] = []
    for op in program.ops:
        fqn = parse(op.ins[0]).key if op.kind is OpKind.SET_GRAD else None
        if fqn is None or len(holders.get(fqn, ())) < 2:
            ops.append(op)
            continue
        acc = op.ins[1]
        others = [q for q in holders[fqn] if q != rank]
        t = types.get(fqn)
        if t is None:
            raise LoweringError(f"rank {rank}: parameter {fqn!r} (shared with ranks {others}) has no known "
                                f"gradient type: no stage graph declares its shape")
        send = handle(f"sendR.{fqn}")
        ops.append(Op(OpKind.SEND, (acc,) * len(others), (send,),
                      SendArgs(tuple(Message(q, tags[fqn], t) for q in others)),
                      note=f"shared with ranks {list(holders[fqn])}"))
        copies = {rank: acc}
        for q in others:
            copies[q] = f"r{q}.grad:param:{fqn}"
            h = handle(copies[q])
            ops.append(Op(OpKind.RECV, (), (h,), RecvArgs(q, tags[fqn], t)))
            tail_recv.append(Op(OpKind.WAIT_RECV, (h,), (copies[q],)))
        total = f"sum.grad:param:{fqn}"
        tail_sum.append(Op(OpKind.SUM, tuple(copies[q] for q in holders[fqn]), (total,), note="in rank order"))
        tail_sum.append(Op(OpKind.SET_GRAD, (op.ins[0], total), args=SetGradArgs(True)))
        tail_send.append(Op(OpKind.WAIT_SEND, (send,)))
    return program.replace(ops=tuple(ops + tail_recv + tail_sum + tail_send))


def check_dense(programs: Sequence[RankProgram], summed: dict[str, str]) -> None:
    """LoweringError where a parameter of `summed` (fqn -> whose gradients are summed) gets a sparse gradient
    (an embedding with sparse=True): sparse tensors are neither sent nor summed between ranks."""
    if not summed:
        return
    for p in programs:
        for g in p.graphs.values():
            if g.gm is None:
                continue
            for name, node in zip(g.outputs, g.gm.graph.output_node().args[0]):
                val = getattr(node, "meta", {}).get("val")
                fqn = key_of(name) if role_of(name) is Role.GRAD_PARAM else None
                if fqn in summed and val is not None and val.layout is not torch.strided:
                    raise LoweringError(
                        f"parameter {fqn!r} gets a sparse gradient (nn.Embedding(sparse=True) or "
                        f"F.embedding(..., sparse=True)) and {summed[fqn]}, so its gradients must be summed "
                        "between ranks, which sparse gradients cannot be. fix: sparse=False for it, or keep it on "
                        "one rank (untie it; a schedule without mirrored stages; no data parallelism)")


def grad_types(programs: Sequence[RankProgram]) -> dict[str, TensorType]:
    """Parameter fqn -> its gradient's type, as the graphs' grad:param outputs declare it."""
    out: dict[str, TensorType] = {}
    for p in programs:
        for g in p.graphs.values():
            for name, t in zip(g.outputs, g.types):
                if t is not None and role_of(name) is Role.GRAD_PARAM:
                    out.setdefault(key_of(name), t)
    return out
