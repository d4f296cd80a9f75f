"""reduce_over_replicas: average every gradient over the data-parallel replicas, each reduction placed where the
gradient is final. A per-rank pass, after reduce_shared_grads.

A parameter's gradient is final at its SET_GRAD: accumulate_grads puts it right after the last W (or BW) that
adds to it, reduce_shared_grads after the sum of a tied or mirrored parameter's copies. The gradients that
become final together (one stage's, after its last W) go into buckets, by dtype and at most `bucket_bytes`
each, and each bucket's all-reduce is posted right there, before the next op of the step. The step then goes on
with the remaining B and W work while the reduction runs on the data-parallel group's stream; the waits, and
the SET_GRADs of the averaged gradients, come at the end of the program, where the optimizer needs them:

    [1W7] acc7.grad:param:w = stage1_w_acc(...)            [1W7] acc7.grad:param:w = stage1_w_acc(...)
    set_grad(param:w, acc7.grad:param:w; True)     ->      h:dp2 = dp_reduce(acc7.grad:param:w; bucket 2)
    [0B7] ...                                              [0B7] ...
                                                           ...
                                                           dp.grad:param:w = wait_dp(h:dp2)
                                                           set_grad(param:w, dp.grad:param:w; True)

A bucket closes when the gradients finished together end (the compiler knows no more arrive before the next
compute op), not when it fills as DDP's do: holding a bucket open across compute would only delay it.
`overlap=False` posts every bucket at the end of the step instead (the exposed reduction a step without
overlap has; the benchmark's baseline). A vocabulary shard is reduced like any parameter: the replicas of a rank
hold the same rows.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from zbcompile.errors import LoweringError
from zbcompile.passes.lower.reduce import grad_types
from zbcompile.ir.program import RankProgram
from zbcompile.ir.program.ops import DPArgs, Op, OpKind, SetGradArgs, TensorType
from zbcompile.ir.program.values import handle, parse

__all__ = ["DataParallel", "reduce_over_replicas", "DEFAULT_BUCKET_MB"]

# DDP's default bucket cap: large enough that a bucket's all-reduce is bandwidth-bound, small enough to pipeline
DEFAULT_BUCKET_MB = 25.0


@dataclasses.dataclass(frozen=True)
class DataParallel:
    """How the lowering reduces gradients over data-parallel replicas.

    bucket_mb: at most this many MiB of gradients in one all-reduce (0: one all-reduce per gradient).
    overlap: post each bucket right after its gradients are final (True) or all at the end of the step (False).
    """

    bucket_mb: float = DEFAULT_BUCKET_MB
    overlap: bool = True

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * 2**20)


def reduce_over_replicas(choice: DataParallel):
    """The pass over all programs for `choice` (named reduce_over_replicas)."""
    def run(programs: Sequence[RankProgram]) -> tuple[RankProgram, ...]:
        types = grad_types(programs)
        return tuple(_reduce(p, types, choice) for p in programs)
    run.__name__ = "reduce_over_replicas"
    return run


def _reduce(program: RankProgram, types: dict[str, TensorType], choice: DataParallel) -> RankProgram:
    ops: list[Op] = []
    at_end: list[Op] = []     # posts held back to the end (overlap=False)
    waits: list[Op] = []
    finished: list[Op] = []   # SET_GRADs of the gradients that just became final together
    buckets = 0

    def close() -> None:
        nonlocal buckets
        for bucket in _buckets(program.rank, finished, types, choice.bucket_bytes):
            h = handle(f"dp{buckets}")
            grads = tuple(op.ins[1] for op in bucket)
            averaged = tuple(f"dp.grad:param:{parse(op.ins[0]).key}" for op in bucket)
            nbytes = sum(types[parse(op.ins[0]).key].nbytes for op in bucket)
            what = f"{len(bucket)} gradients" if len(bucket) > 1 else "1 gradient"
            (ops if choice.overlap else at_end).append(
                Op(OpKind.DP_REDUCE, grads, (h,), DPArgs(buckets), note=f"{what}, {nbytes} bytes"))
            waits.append(Op(OpKind.WAIT_DP, (h,), averaged))
            waits.extend(Op(OpKind.SET_GRAD, (op.ins[0], avg), args=SetGradArgs(True), note="averaged over dp")
                         for op, avg in zip(bucket, averaged))
            buckets += 1
        finished.clear()

    for op in program.ops:
        if op.kind is OpKind.SET_GRAD:
            finished.append(op)
            continue
        if finished:
            close()
        ops.append(op)
    if finished:
        close()
    return program.replace(ops=tuple(ops + at_end + waits))


def _buckets(rank: int, finished: list[Op], types: dict[str, TensorType], cap: int) -> list[list[Op]]:
    """The SET_GRADs of `finished` in buckets: one dtype each (a flat all-reduce), at most `cap` bytes unless one
    gradient alone is larger, in program order within a dtype."""
    by_dtype: dict = {}
    for op in finished:
        fqn = parse(op.ins[0]).key
        if fqn not in types:
            raise LoweringError(f"rank {rank}: parameter {fqn!r} has no known gradient type (no stage graph declares "
                                "its shape), so its data-parallel bucket cannot be sized")
        by_dtype.setdefault(types[fqn].dtype, []).append((op, types[fqn].nbytes))
    out: list[list[Op]] = []
    for grads in by_dtype.values():
        current: list[Op] = []
        size = 0
        for op, nbytes in grads:
            if current and size + nbytes > cap:
                out.append(current)
                current, size = [], 0
            current.append(op)
            size += nbytes
        out.append(current)
    return out
