"""GPipe and 1F1B: one stage per rank, fused backward (BW).

GPipe, rank r:   F0 F1 ... F(m-1)  BW0 BW1 ... BW(m-1)        peak memory m
1F1B,  rank r:   (p-1-r) x F  |  (F, BW) x rest  |  BW x (p-1-r)   peak memory min(p-r, m)

Both admit any m >= 1. Under unit costs (F=B=W=1, so BW=2) both have bubble rate (p-1)/(m+p-1).
"""

from __future__ import annotations

from zbcompile.ir.schedule import Schedule, build, loop_placement

from ._common import BW, F, check_microbatches, check_pp


def gpipe(pp: int, microbatches: int) -> Schedule:
    """All forwards, then all backwards; simple, but every rank holds all m activations at once."""
    check_pp("gpipe", pp)
    check_microbatches("gpipe", pp, microbatches, 1, "1", "")
    m = microbatches
    ranks = [[F(r, i) for i in range(m)] + [BW(r, i) for i in range(m)] for r in range(pp)]
    return build("gpipe", m, loop_placement(pp), ranks)


def one_f_one_b(pp: int, microbatches: int) -> Schedule:
    """Warm-up forwards until the first backward can arrive, then alternate F and BW, then drain."""
    check_pp("1f1b", pp)
    check_microbatches("1f1b", pp, microbatches, 1, "1", "")
    m = microbatches
    ranks = []
    for r in range(pp):
        warmup = min(pp - 1 - r, m)
        row = [F(r, i) for i in range(warmup)]
        for i in range(warmup, m):  # steady: the F for microbatch i, then the backward of the oldest one
            row += [F(r, i), BW(r, i - warmup)]
        row += [BW(r, i) for i in range(m - warmup, m)]
        ranks.append(row)
    return build("1f1b", m, loop_placement(pp), ranks)
