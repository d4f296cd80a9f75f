"""Step-boundary ops: post-validation's prefix chain and its verdict (passes/lower/step_boundary.py).

A post-validated step ends with PREFIX: this rank's partial values (the gradient norm's partial power sum or
maximum, an inf / NaN flag, its loss sum) added to the prefix received from rank r-1 and sent on to r+1, so
that rank p-1 holds the totals. The next step's program starts its warm-up forwards on the optimistically
updated parameters and, at its deadline, VALIDATE reads the totals (received from r+1, or on rank p-1 the
TOTALS it kept) and either lets the step go on or rolls the update back, applies the right one, drains the
messages its upstream's warm-up sent and raises for the runtime to run the step again. The messages
themselves are plain RECV / SEND ops, so the deadlock and pair-order checks see them. Each kind's args
record, text form, rules and row.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch

from zbcompile.errors import LoweringError
from zbcompile.ir.program.ops._spec import Op, OpKind, OpSpec, Stream, TensorType, split_values, values_text
from zbcompile.ir.program.ops.p2p import Message

__all__ = ["ValidateArgs", "VALUES", "UP", "PREFIX", "TOTALS", "ROWS"]

# the values that travel: [norm partial, found inf / NaN, loss sum, the least and the greatest call number, 1 where
# some rank trained a parameter], float64 on the rank's device
VALUES = TensorType((6,), torch.float64)
UP, PREFIX, TOTALS = "pv.up", "pv.prefix", "pv.totals"   # from rank r-1; this rank's prefix; the totals

_NOT_CAPTURED = ("post-validation decides on the host between two steps (optimistic update, rollback, the step "
                 "run again): a captured step cannot branch")
_FIX = "step synchronously (step(..., post_validate=False)) where the step runs as a CUDA graph"


def _small(op: Op, nbytes, ranks: int) -> tuple[int, ...]:
    return (VALUES.nbytes,) * len(op.outs)


# ---- PREFIX: this rank's partial values added to the prefix from r-1 --------------------------------------
_PREFIX = OpSpec(OpKind.PREFIX, "this rank's partial values (norm partial, inf flag, loss sum) added to the prefix "
                 f"from rank r-1; ins = ([{UP}], [loss]), outs = ({PREFIX},)", text="prefix", stream=Stream.COMPUTE,
                 emit="prefix", runtime=("prefix",), fresh=_small, capture=_NOT_CAPTURED, fix=_FIX)

# ---- TOTALS: rank p-1's prefix of the last step, which is the totals ---------------------------------------
_TOTALS = OpSpec(OpKind.TOTALS, f"the last step's totals this rank (the last) kept; outs = ({TOTALS},)",
                 text="totals", stream=Stream.HOST, emit="boundary_call", runtime=("totals",), fresh=_small,
                 capture=_NOT_CAPTURED, fix=_FIX)


# ---- VALIDATE: the verdict on the last step's optimistic update -------------------------------------------------
class ValidateArgs(NamedTuple):
    """VALIDATE: the messages this rank's upstream sent before its own VALIDATE that this rank has not received
    before its VALIDATE: received and dropped when the step runs again (the upstream sends them anew)."""

    drains: tuple[Message, ...] = ()


def _format_validate(op: Op) -> str:
    drains = ", ".join(f"{m.peer} tag {m.tag} {m.type}" for m in op.args.drains)
    return values_text(op) + (f"; drain {drains}" if drains else "")


_DRAIN_RE = re.compile(r"(\d+) tag (\d+) (\[[\d,\s]*\] \w+)")


def _parse_validate(inner: str, outs) -> tuple[tuple[str, ...], ValidateArgs]:
    values, _, drains = inner.partition("; drain ")
    found = _DRAIN_RE.findall(drains)
    if ", ".join(f"{p} tag {t} {ty}" for p, t, ty in found) != drains.strip():
        raise LoweringError(f"cannot read validate({inner}): expected 'TOTALS[; drain PEER tag TAG [SHAPE] DTYPE, "
                            "...]'")
    return split_values(values), ValidateArgs(tuple(Message(int(p), int(t), TensorType.parse(ty))
                                                    for p, t, ty in found))


_VALIDATE = OpSpec(OpKind.VALIDATE, "the last step's verdict from the totals: go on, or roll its update back, apply "
                   "the right one, drain and run this step again", text="validate", stream=Stream.HOST,
                   emit="validate", runtime=("validate",), args=ValidateArgs, format=_format_validate,
                   parse=_parse_validate, capture=_NOT_CAPTURED, fix=_FIX)

ROWS = (_PREFIX, _TOTALS, _VALIDATE)
