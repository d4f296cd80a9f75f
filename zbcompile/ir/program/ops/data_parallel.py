"""Data-parallel ops: a bucket of finished gradients reduced over the replicas, and (sharded data parallelism) a
bucket of parameter shards gathered into whole parameters, each posted on the data-parallel group's stream, and
their waits (passes/lower/dp_reduce.py, passes/lower/dp_shard.py). Each kind's args record, text form, rules and
row.

    h:dp0 = dp_reduce(acc3.grad:param:w, acc3.grad:param:b; bucket 0)
    ...                                                     (the rest of the step overlaps the reduction)
    dp.grad:param:w, dp.grad:param:b = wait_dp(h:dp0)

The post copies the bucket's gradients into one fresh flat tensor and all-reduces it; the wait divides by the
number of replicas and returns one view of the flat tensor per gradient (they become Parameter.grad, as DDP's
gradient_as_bucket_view makes them). Sharded (`scatter over N`), the flat tensor is laid out replica by
replica and reduce-scattered: each replica's wait returns views of its own rows of each gradient (dim-0 shards,
as torch.chunk cuts them: what FSDP2 and DTensor's Shard(0) hold).

    h:ag0 = dp_gather(zero.param:w, zero.param:b; bucket 0 over 2: [16, 16] float32, [16] float32)
    ...
    ag0.param:w, ag0.param:b = wait_gather(h:ag0; bucket 0 over 2: [16, 16] float32, [16] float32)

dp_gather all-gathers the replicas' shards (`zero.param:`, each padded to ceil(rows / N) rows) of the whole
parameters whose types it lists; wait_gather copies each whole parameter out of the gathered tensor into a
tensor of its own, which the stage graphs read and the program drops after its last reader.

The replicas run this same program, so they post the same buckets in the same order (`bucket`): the
collectives match by order on the group.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from zbcompile.errors import LoweringError
from zbcompile.ir.program.ops._spec import (SAFE, UNTIMED_WAIT_FIX, Op, OpKind, OpSpec, Stream, Sync, TensorType,
                                            split_values, values_text, wait_capture)

__all__ = ["DPArgs", "GatherArgs", "shard_rows", "padded_shard_bytes", "ROWS"]


def shard_rows(rows: int, replicas: int) -> int:
    """Rows of each replica's padded shard of a dim-0 size `rows` (torch.chunk's chunk size)."""
    return -(-rows // replicas)


def padded_shard_bytes(t: TensorType, replicas: int) -> int:
    """Bytes of one replica's padded shard of a tensor of type `t`."""
    if not t.shape:
        return t.nbytes
    return t.nbytes // max(t.shape[0], 1) * shard_rows(t.shape[0], replicas) if t.shape[0] else 0


class DPArgs(NamedTuple):
    """DP_REDUCE: the bucket's position in the program's sequence of buckets (0, 1, ...); scatter: the number of
    replicas the gradients are reduce-scattered over (sharded data parallelism), 0 for an all-reduce."""

    bucket: int
    scatter: int = 0


class GatherArgs(NamedTuple):
    """DP_GATHER: the bucket's position in the program's sequence of gathers, the number of replicas, and the
    whole parameters' types, one per input shard."""

    bucket: int
    replicas: int
    types: tuple[TensorType, ...]


# ---- DP_REDUCE ------------------------------------------------------------------------------------------
def _format_reduce(op: Op) -> str:
    scatter = f", scatter over {op.args.scatter}" if op.args.scatter else ""
    return f"{values_text(op)}; bucket {op.args.bucket}{scatter}"


_REDUCE_RE = re.compile(r"(.*);\s*bucket (\d+)(?:,\s*scatter over (\d+))?")


def _parse_reduce(inner: str, outs) -> tuple[tuple[str, ...], DPArgs]:
    m = _REDUCE_RE.fullmatch(inner.strip())
    if not m:
        raise LoweringError(f"cannot read dp_reduce({inner}): expected 'GRADIENTS; bucket N[, scatter over R]'")
    return split_values(m.group(1)), DPArgs(int(m.group(2)), int(m.group(3) or 0))


def _reduce_fresh(op: Op, nbytes, ranks: int) -> tuple[int, ...]:
    flat = sum(nbytes(v) for v in op.ins)   # the flat bucket, held by the handle until the wait
    return (flat + (flat // op.args.scatter if op.args.scatter else 0),)   # and the shard it scatters into


_DP_REDUCE = OpSpec(OpKind.DP_REDUCE, "copy finished gradients into one flat bucket and post its all-reduce (or "
                    "reduce-scatter) over the data-parallel replicas; outs = (handle,)", text="dp_reduce",
                    stream=Stream.DP, emit="dp_reduce", runtime=("dp_reduce",), args=DPArgs,
                    format=_format_reduce, parse=_parse_reduce, sync=Sync.REPLICAS, fresh=_reduce_fresh,
                    capture=SAFE)


# ---- WAIT_DP --------------------------------------------------------------------------------------------
def _views_of_bucket(op: Op, graph_aliases) -> list[tuple[str, str]]:
    return [(op.ins[0], v) for v in op.outs]   # each averaged gradient is a view of the handle's flat bucket


_WAIT_DP = OpSpec(OpKind.WAIT_DP, "wait for a bucket's reduction and divide by the replicas; ins = (handle,), "
                  "outs = the averaged gradients, or this replica's shards of them (views of the bucket)",
                  text="wait_dp", stream=Stream.DP, emit="wait_dp", runtime=("wait_dp",),
                  aliases=_views_of_bucket, sync=Sync.REPLICAS, capture=wait_capture, fix=UNTIMED_WAIT_FIX)


# ---- DP_GATHER --------------------------------------------------------------------------------------------
def _format_gather(op: Op) -> str:
    a = op.args
    return f"{values_text(op)}; bucket {a.bucket} over {a.replicas}: {', '.join(str(t) for t in a.types)}"


_GATHER_RE = re.compile(r"(.*);\s*bucket (\d+) over (\d+):\s*(.*)")
_TYPE_RE = re.compile(r"\[[\d,\s]*\]\s+\w+")


def _parse_gather(inner: str, outs) -> tuple[tuple[str, ...], GatherArgs]:
    m = _GATHER_RE.fullmatch(inner.strip())
    if not m:
        raise LoweringError(f"cannot read dp_gather({inner}): expected 'SHARDS; bucket N over R: TYPE, TYPE, ...'")
    types = tuple(TensorType.parse(t) for t in _TYPE_RE.findall(m.group(4)))
    return split_values(m.group(1)), GatherArgs(int(m.group(2)), int(m.group(3)), types)


def _gather_fresh(op: Op, nbytes, ranks: int) -> tuple[int, ...]:
    a = op.args
    shard = sum(padded_shard_bytes(t, a.replicas) for t in a.types)
    return (shard * (a.replicas + 1),)   # the flat shard it sends and the gathered tensor, until the wait


_DP_GATHER = OpSpec(OpKind.DP_GATHER, "copy this replica's parameter shards into one flat tensor and post its "
                    "all-gather over the data-parallel replicas; outs = (handle,)", text="dp_gather",
                    stream=Stream.DP, emit="dp_gather", runtime=("dp_gather",), args=GatherArgs,
                    format=_format_gather, parse=_parse_gather, sync=Sync.REPLICAS, fresh=_gather_fresh,
                    capture=SAFE)


# ---- WAIT_GATHER ------------------------------------------------------------------------------------------
def _whole_fresh(op: Op, nbytes, ranks: int) -> tuple[int, ...]:
    return tuple(t.nbytes for t in op.args.types)


_WAIT_GATHER = OpSpec(OpKind.WAIT_GATHER, "wait for a parameter bucket's all-gather; ins = (handle,), outs = the "
                      "whole parameters, each copied into a tensor of its own", text="wait_gather",
                      stream=Stream.DP, emit="wait_gather", runtime=("wait_gather",), args=GatherArgs,
                      format=_format_gather, parse=_parse_gather, sync=Sync.REPLICAS, fresh=_whole_fresh,
                      capture=wait_capture, fix=UNTIMED_WAIT_FIX)

ROWS = (_DP_REDUCE, _WAIT_DP, _DP_GATHER, _WAIT_GATHER)
