"""Data-parallel ops: a bucket of finished gradients averaged over the replicas (passes/lower/dp_reduce.py), posted
on the data-parallel group's stream, and its wait. Each kind's args record, text form, rules and row.

    h:dp0 = dp_reduce(acc3.grad:param:w, acc3.grad:param:b; bucket 0)
    ...                                                     (the rest of the step overlaps the reduction)
    dp.grad:param:w, dp.grad:param:b = wait_dp(h:dp0)

The post copies the bucket's gradients into one fresh flat tensor and all-reduces it; the wait divides by the
number of replicas and returns one view of the flat tensor per gradient (they become Parameter.grad, as DDP's
gradient_as_bucket_view makes them). The replicas run this same program, so they post the same buckets in the
same order (`bucket`): the all-reduces match by order on the group.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from zbcompile.errors import LoweringError
from zbcompile.ir.program.ops._spec import (SAFE, UNTIMED_WAIT_FIX, Op, OpKind, OpSpec, Stream, Sync, split_values,
                                            values_text, wait_capture)

__all__ = ["DPArgs", "ROWS"]


class DPArgs(NamedTuple):
    """DP_REDUCE: the bucket's position in the program's sequence of buckets (0, 1, ...)."""

    bucket: int


# ---- DP_REDUCE ------------------------------------------------------------------------------------------
def _format_reduce(op: Op) -> str:
    return f"{values_text(op)}; bucket {op.args.bucket}"


_REDUCE_RE = re.compile(r"(.*);\s*bucket (\d+)")


def _parse_reduce(inner: str, outs) -> tuple[tuple[str, ...], DPArgs]:
    m = _REDUCE_RE.fullmatch(inner.strip())
    if not m:
        raise LoweringError(f"cannot read dp_reduce({inner}): expected 'GRADIENTS; bucket N'")
    return split_values(m.group(1)), DPArgs(int(m.group(2)))


def _reduce_fresh(op: Op, nbytes, ranks: int) -> tuple[int, ...]:
    return (sum(nbytes(v) for v in op.ins),)   # the flat bucket, held by the handle until the wait


_DP_REDUCE = OpSpec(OpKind.DP_REDUCE, "copy finished gradients into one flat bucket and post its all-reduce over "
                    "the data-parallel replicas; outs = (handle,)", text="dp_reduce", stream=Stream.DP,
                    emit="dp_reduce", runtime=("dp_reduce",), args=DPArgs, format=_format_reduce,
                    parse=_parse_reduce, sync=Sync.REPLICAS, fresh=_reduce_fresh, capture=SAFE)


# ---- WAIT_DP --------------------------------------------------------------------------------------------
def _views_of_bucket(op: Op, graph_aliases) -> list[tuple[str, str]]:
    return [(op.ins[0], v) for v in op.outs]   # each averaged gradient is a view of the handle's flat bucket


_WAIT_DP = OpSpec(OpKind.WAIT_DP, "wait for a bucket's all-reduce and divide by the replicas; ins = (handle,), "
                  "outs = the averaged gradients (views of the bucket)", text="wait_dp", stream=Stream.DP,
                  emit="wait_dp", runtime=("wait_dp",), aliases=_views_of_bucket, sync=Sync.REPLICAS,
                  capture=wait_capture, fix=UNTIMED_WAIT_FIX)

ROWS = (_DP_REDUCE, _WAIT_DP)
