"""insert_frees and insert_stamps: make memory release and timing points explicit in the program.

insert_frees puts one FREE after each op that is the last reader of activation-memory values (act:,
saved:, wsaved:, grad:act:). The emitted code then drops the program's references right there, so after a
B the F-saved tensors only W still needs survive, and after W the rest go:

    [0B0] s0.mb0.grad:act:x, s0.mb0.wsaved:0 = stage0_b(s0.mb0.saved:1, s1.mb0.grad:act:h)
    free(s0.mb0.saved:1)    # last use by 0B0
    ...
    [0W0] s0.mb0.grad:param:l0.weight = stage0_w(s0.mb0.saved:0, s0.mb0.wsaved:0)
    free(s0.mb0.saved:0, s0.mb0.wsaved:0)    # last use by 0W0

A value sent to another rank is also held by its send handle until the matching WAIT_SEND.
insert_stamps brackets every RUN op with STAMP ops (slots 2j and 2j+1 for the j-th action): the runtime
turns them into per-action start / end times.
"""

from __future__ import annotations

from zbcompile.ir.program import RankProgram
from zbcompile.ir.program.ops import Op, OpKind, StampArgs
from zbcompile.ir.program.values import parse

__all__ = ["insert_frees", "insert_stamps"]


def insert_frees(program: RankProgram) -> RankProgram:
    last: dict[str, int] = {}
    for i, op in enumerate(program.ops):
        for v in op.ins:
            value = parse(v)
            if value.scope in ("stage", "vocab", "whole") and value.role.is_activation_memory:
                last[v] = i
    at: dict[int, list[str]] = {}
    for v, i in last.items():
        at.setdefault(i, []).append(v)
    ops: list[Op] = []
    for i, op in enumerate(program.ops):
        ops.append(op)
        if i in at:
            why = f"last use by {op.action}" if op.kind is OpKind.RUN else f"last use by {op.spec.text}"
            ops.append(Op(OpKind.FREE, tuple(at[i]), note=why))
    return program.replace(ops=tuple(ops))


def insert_stamps(program: RankProgram) -> RankProgram:
    ops: list[Op] = []
    j = 0
    for op in program.ops:
        if op.kind is OpKind.RUN:
            ops += [Op(OpKind.STAMP, args=StampArgs(2 * j)), op, Op(OpKind.STAMP, args=StampArgs(2 * j + 1))]
            j += 1
        else:
            ops.append(op)
    return program.replace(ops=tuple(ops))
