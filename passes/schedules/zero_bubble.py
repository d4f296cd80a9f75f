"""The handcrafted Zero Bubble schedules ZB-H1 and ZB-H2: one stage per rank, backward split into B and W.

Both follow one per-rank program, parameterised by how many forwards run before the first B (`warmup`)
and how many W's the rank holds back (`defer`):

    warm-up    `warmup` x F
    steady     (F, B) for each remaining microbatch, then a W once more than `defer` are pending
    cool-down  B for each remaining microbatch, then a W once more than `defer` are pending
    flush      the pending W's, oldest first

Holding W's back lets the B's, which are on the critical path, travel down the pipeline at once; the
pending W's later fill what would otherwise be idle time at the end.

    schedule  warm-up      defer  peak memory (rank r)        unit-cost bubble
    ZB-H1     p-1-r        r      (p-r) + r = p               (p-1)/(3m+p-1)
    ZB-H2     2(p-1-r)     2r     (2p-2r-1) + 2r = 2p-1       0 once m >= 2p

Both admit any m >= 1 (with m < 2p ZB-H2 has no room to fill and keeps a bubble).
"""

from __future__ import annotations

from zbcompile.ir.schedule import Schedule, build, loop_placement

from ._common import B, F, W, check_microbatches, check_pp


def zb_h1(pp: int, microbatches: int) -> Schedule:
    """ZB-H1: 1F1B's memory (p), a third of its bubble."""
    check_pp("zb-h1", pp)
    check_microbatches("zb-h1", pp, microbatches, 1, "1", "")
    ranks = [_rank_program(r, microbatches, warmup=pp - 1 - r, defer=r) for r in range(pp)]
    return build("zb-h1", microbatches, loop_placement(pp), ranks)


def zb_h2(pp: int, microbatches: int) -> Schedule:
    """ZB-H2: twice the warm-up forwards and deferred W's; zero bubble for m >= 2p at peak memory 2p-1."""
    check_pp("zb-h2", pp)
    check_microbatches("zb-h2", pp, microbatches, 1, "1", "")
    ranks = [_rank_program(r, microbatches, warmup=2 * (pp - 1 - r), defer=2 * r) for r in range(pp)]
    return build("zb-h2", microbatches, loop_placement(pp), ranks)


def _rank_program(stage: int, m: int, *, warmup: int, defer: int) -> list:
    warmup = min(warmup, m)
    row = [F(stage, i) for i in range(warmup)]
    pending: list[int] = []  # microbatches whose B ran and whose W has not, oldest first

    def backward(mb: int) -> None:
        row.append(B(stage, mb))
        pending.append(mb)
        if len(pending) > defer:
            row.append(W(stage, pending.pop(0)))

    for i in range(warmup, m):
        row.append(F(stage, i))
        backward(i - warmup)
    for mb in range(m - warmup, m):
        backward(mb)
    row += [W(stage, mb) for mb in pending]
    return row
