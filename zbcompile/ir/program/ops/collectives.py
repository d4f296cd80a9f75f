"""Collective ops: a broadcast, reduce or all-gather over every rank (the vocabulary layers, passes/lower/vocab.py),
posted on the collective group's stream, and its join. Each kind's args record, text form, rules and row."""

from __future__ import annotations

import enum
import re
from typing import NamedTuple

from zbcompile.errors import LoweringError
from zbcompile.ir.program.ops._spec import (SAFE, UNTIMED_WAIT_FIX, Op, OpKind, OpSpec, Stream, Sync, TensorType,
                                            split_values, values_text, wait_capture)

__all__ = ["Coll", "CollArgs", "ROWS"]


class Coll(str, enum.Enum):
    """What a COLLECTIVE does (over every rank, on the collective group)."""

    BROADCAST = "broadcast"     # root's tensor to every rank: ins = (tensor,) on the root, () elsewhere
    REDUCE = "reduce"           # sum of every rank's tensor onto the root (in place there): ins = (tensor,)
    ALL_GATHER = "all_gather"   # every rank's tensor stacked on a new first dim, on every rank: ins = (tensor,)


class CollArgs(NamedTuple):
    """COLLECTIVE: what it does, its root (-1 for none), its position `seq` in the group's sequence (every rank
    posts the same collectives in the same order, and the checks match them by seq) and the type of each
    rank's tensor."""

    op: Coll
    root: int
    seq: int
    type: TensorType


# ---- COLLECTIVE ---------------------------------------------------------------------------------------
def _format_coll(op: Op) -> str:
    a = op.args
    head = f"{values_text(op)}; " if op.ins else ""
    return f"{head}{a.op.value} root {a.root} seq {a.seq} {a.type}"


_COLL_RE = re.compile(r"(?:(.*);\s*)?(\w+) root (-?\d+) seq (\d+) (\[[\d,\s]*\] \w+)")


def _parse_coll(inner: str, outs) -> tuple[tuple[str, ...], CollArgs]:
    m = _COLL_RE.fullmatch(inner.strip())
    if not m or m.group(2) not in {c.value for c in Coll}:
        raise LoweringError(f"cannot read collective({inner}): expected '[VALUES; ]OP root ROOT seq SEQ [SHAPE] "
                            f"DTYPE' with OP one of {[c.value for c in Coll]}")
    return split_values(m.group(1) or ""), CollArgs(Coll(m.group(2)), int(m.group(3)), int(m.group(4)),
                                                    TensorType.parse(m.group(5)))


def _coll_aliases(op: Op, graph_aliases) -> list[tuple[str, str]]:
    return [(v, op.outs[0]) for v in op.ins]   # the handle holds the tensor until WAIT_COLL (the result, on a root)


def _coll_fresh(op: Op, nbytes, ranks: int) -> tuple[int, ...]:
    a = op.args
    if a.op is Coll.ALL_GATHER:
        return (ranks * a.type.nbytes,)
    return (0 if op.ins else a.type.nbytes,)   # a broadcast's receivers get a fresh buffer


_COLLECTIVE = OpSpec(OpKind.COLLECTIVE, "post a collective over every rank (broadcast, reduce, all-gather); "
                     "outs = (handle,)", text="collective", stream=Stream.COMM, emit="collective",
                     runtime=("collective",), args=CollArgs, format=_format_coll, parse=_parse_coll,
                     aliases=_coll_aliases, sync=Sync.COLLECTIVE, fresh=_coll_fresh, capture=SAFE)


# ---- WAIT_COLL ------------------------------------------------------------------------------------------
def _joined_aliases(op: Op, graph_aliases) -> list[tuple[str, str]]:
    return [(op.ins[0], op.outs[0])] if op.outs else []


_WAIT_COLL = OpSpec(OpKind.WAIT_COLL, "wait for a posted collective; ins = (handle,), outs = (its result,) or () "
                    "where this rank gets none (a reduce off its root)", text="wait_coll", stream=Stream.COMM,
                    emit="wait_coll", runtime=("wait_collective",), aliases=_joined_aliases, sync=Sync.JOIN,
                    capture=wait_capture, fix=UNTIMED_WAIT_FIX)

ROWS = (_COLLECTIVE, _WAIT_COLL)
