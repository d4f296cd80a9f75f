"""GPipe and 1F1B: one stage per rank, fused backward (BW).

GPipe, rank r:   F0 F1 ... F(m-1)  BW0 BW1 ... BW(m-1)        peak memory m
1F1B,  rank r:   (p-1-r) x F  |  (F, BW) x rest  |  BW x (p-1-r)   peak memory min(p-r, m)

Both admit any m >= 1. Under unit costs (F=B=W=1, so BW=2) both have bubble rate (p-1)/(m+p-1).
"""

from __future__ import annotations

from zbcompile.errors import ScheduleError
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


def one_rank(stages: int, microbatches: int) -> Schedule:
    """Every stage on one rank, in order: per microbatch the F of each stage, then its B from the last stage
    back; the W's after all B's. Not a pipeline: a multi-stage program on one device (one GPU runs a captured
    step across stage boundaries; NCCL refuses two ranks on one device)."""
    if stages < 1:
        raise ScheduleError(f"one_rank: stages must be >= 1, got {stages}")
    check_microbatches("one_rank", 1, microbatches, 1, "1", "")
    row = []
    for mb in range(microbatches):
        row += [f"{s}F{mb}" for s in range(stages)] + [f"{s}B{mb}" for s in reversed(range(stages))]
    row += [f"{s}W{mb}" for mb in range(microbatches) for s in reversed(range(stages))]
    return Schedule.from_text(f"# zbcompile schedule one-rank-{stages}: microbatches={microbatches} "
                              f"placement={','.join('0' * stages)} pipelines=1\nrank 0: {' '.join(row)}\n").validate()
