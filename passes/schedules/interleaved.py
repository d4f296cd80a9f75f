"""Interleaved 1F1B (Megatron's virtual pipeline): each rank holds `chunks` stages in a loop.

Stage c*p + r lives on rank r (loop placement), so a microbatch circles the ranks `chunks` times.
Work on rank r is a sequence of m*v virtual steps. Microbatches go in groups of p; within a group the
forwards run chunk 0 for every member, then chunk 1, ...; the backwards visit the chunks in reverse.

    warm-up   min(2(p-1-r) + (v-1)p, m*v) forwards
    steady    (F, BW) pairs
    cool-down the remaining BWs

Megatron requires m % p == 0; that is when the unit-cost bubble is exactly (p-1)/(v*m + p-1). We only
require m >= p: a shorter last group keeps the order deadlock-free and costs a little extra bubble.
"""

from __future__ import annotations

from zbcompile.errors import ScheduleError
from zbcompile.ir.schedule import Schedule, build, loop_placement

from ._common import BW, F, check_microbatches, check_pp


def interleaved_1f1b(pp: int, microbatches: int, chunks: int | None = None) -> Schedule:
    """Megatron VPP order with `chunks` (default 2) stages per rank; needs microbatches >= pp."""
    v = 2 if chunks is None else chunks
    check_pp("interleaved-1f1b", pp)
    if not isinstance(v, int) or v < 2:
        raise ScheduleError(f"interleaved-1f1b needs chunks >= 2 stages per rank; got {chunks!r}: "
                            f"pass --chunks 2 (or more), or use 1f1b for one stage per rank")
    check_microbatches("interleaved-1f1b", pp, microbatches, pp, "pp",
                       " (a multiple of pp gives the least bubble) or use 1f1b")
    m = microbatches
    forward = _virtual_order(pp, m, range(v))
    backward = _virtual_order(pp, m, reversed(range(v)))
    first_group = pp + m % pp
    ranks = []
    for r in range(pp):
        warmup = min(2 * (pp - 1 - r) + (v - 1) * first_group, m * v)
        row = [F(c * pp + r, mb) for c, mb in forward[:warmup]]
        for k in range(warmup, m * v):
            (cf, mf), (cb, mbb) = forward[k], backward[k - warmup]
            row += [F(cf * pp + r, mf), BW(cb * pp + r, mbb)]
        row += [BW(c * pp + r, mb) for c, mb in backward[m * v - warmup:]]
        ranks.append(row)
    return build("interleaved-1f1b", m, loop_placement(pp, v), ranks)


def _virtual_order(pp: int, m: int, chunk_order) -> list[tuple[int, int]]:
    """(chunk, microbatch) per virtual step: groups of pp microbatches, each group swept chunk by chunk."""
    chunk_order = list(chunk_order)
    ends = list(range(m, pp - 1, -pp))[::-1]  # the first group absorbs the m % pp leftover microbatches
    order = []
    for first, end in zip([0] + ends, ends):
        order += [(c, mb) for c in chunk_order for mb in range(first, end)]
    return order
