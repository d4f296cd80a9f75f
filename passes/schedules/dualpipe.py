"""DualPipe and DualPipeV (DeepSeek): the eight-phase per-rank program.

Every rank runs two "phases", each a stage of a pipeline, and in the steady state pairs the forward of one
phase with the backward of the other, so the communication of one hides under the compute of the other.
In our IR such an overlapped pair is just two consecutive actions (F first).

With `half` ranks on each side of the turn, `rr` this rank's distance from the nearer end and `n`
microbatches per phase, rank r runs:

    1. 2(half-rr-1)      x F0
    2. rr+1              x (F0, F1)
    3. half-rr-1         x (B1, W, F1)          B1 with its W deferred, then the oldest deferred W
    4. n-2*half+rr+1     x (F0, BW1, F1, BW0)   the overlapped steady state, full backwards
    5. half-rr-1         x (BW1, F1, BW0)
    6. rr+1              x (B1, B0)             full backwards in the first half, W deferred after
    7. half-rr-1         x (W, B0)              B0 with its W deferred
    8. the deferred W's, oldest first

DualPipeV: V placement, half = p, rr = r, phase 0 = stage r, phase 1 = stage 2p-1-r, n = m.
DualPipe: two mirrored pipelines over even p, half = p/2, rr = min(r, p-1-r); phase 0 is the pipeline in
which the rank sits in the first half, n = m/2 per pipeline.

The program needs n >= 2*half per phase. For fewer microbatches we run it on padded counts and drop
every action of a padded microbatch: dropping whole microbatches keeps the order deadlock-free, so any m
is admitted (m >= 1 for DualPipeV, m >= 2 for DualPipe), with more bubble below the papers' minimum.
"""

from __future__ import annotations

from collections import deque

from zbcompile.ir.schedule import Action, Schedule, build, dual_placement, v_placement

from ._common import B, BW, F, W, check_microbatches, check_pp


def dualpipev(pp: int, microbatches: int) -> Schedule:
    """DualPipeV on p ranks and 2p V-placed stages; zero-bubble steady state for m >= 2p."""
    check_pp("dualpipev", pp)
    check_microbatches("dualpipev", pp, microbatches, 1, "1", "")
    m = microbatches
    n = max(m, 2 * pp)
    ranks = []
    for r in range(pp):
        phases = (_Phase(r, range(n)), _Phase(2 * pp - 1 - r, range(n)))
        ranks.append([a for a in _program(pp, r, n, *phases) if a.microbatch < m])
    return build("dualpipev", m, v_placement(pp), ranks)


def dualpipe(pp: int, microbatches: int) -> Schedule:
    """DualPipe: microbatches 0..m/2-1 flow down stages 0..p-1, the rest up the mirrored stages p..2p-1."""
    check_pp("dualpipe", pp, even=True)
    check_microbatches("dualpipe", pp, microbatches, 2, "2", " (one per direction; 2*pp or more, even, "
                                                        "is the papers' setting)")
    m, half = microbatches, pp // 2
    sizes = (-(-m // 2), m // 2)  # Schedule.pipeline_of gives the first pipeline the odd one out
    n = max(sizes[0], pp)
    ranks = []
    for r in range(pp):
        down = _Phase(r, range(n), offset=0, keep=sizes[0])
        up = _Phase(2 * pp - 1 - r, range(n), offset=sizes[0], keep=sizes[1])
        rr = min(r, pp - 1 - r)
        first, second = (down, up) if r < half else (up, down)
        ranks.append([a for a in _program(half, rr, n, first, second) if a is not None])
    return build("dualpipe", m, dual_placement(pp), ranks, pipelines=2)


class _Phase:
    """One stage's counters on its rank. Local microbatch i is global `offset + i`; locals >= `keep` are
    padding, and their actions come out as None so the caller can drop them."""

    def __init__(self, stage: int, local: range, offset: int = 0, keep: int | None = None) -> None:
        self.stage, self.offset = stage, offset
        self.keep = len(local) if keep is None else keep
        self.f = self.b = 0

    def _act(self, make, i: int) -> Action | None:
        return make(self.stage, self.offset + i) if i < self.keep else None

    def fwd(self) -> Action | None:
        self.f += 1
        return self._act(F, self.f - 1)

    def bwd(self, deferred: deque | None) -> Action | None:
        """A full BW, or (when `deferred` is a queue) a B whose W joins the queue."""
        self.b += 1
        if deferred is None:
            return self._act(BW, self.b - 1)
        deferred.append(self._act(W, self.b - 1))
        return self._act(B, self.b - 1)


def _program(half: int, rr: int, n: int, p0: _Phase, p1: _Phase) -> list[Action | None]:
    wq: deque = deque()  # deferred W's of both phases, one FIFO
    row: list[Action | None] = [p0.fwd() for _ in range(2 * (half - rr - 1))]
    for _ in range(rr + 1):
        row += [p0.fwd(), p1.fwd()]
    for _ in range(half - rr - 1):
        row += [p1.bwd(wq), wq.popleft(), p1.fwd()]
    for _ in range(n - 2 * half + rr + 1):
        row += [p0.fwd(), p1.bwd(None), p1.fwd(), p0.bwd(None)]
    for _ in range(half - rr - 1):
        row += [p1.bwd(None), p1.fwd(), p0.bwd(None)]
    steps6 = rr + 1
    zb = None
    for i in range(steps6):
        # from the middle pair on, W's are deferred to fill the tail (odd ranks switch one action earlier)
        if i == steps6 // 2 and rr % 2 == 1:
            zb = wq
        row.append(p1.bwd(zb))
        if i == steps6 // 2 and rr % 2 == 0:
            zb = wq
        row.append(p0.bwd(zb))
    for _ in range(half - rr - 1):
        row += [wq.popleft(), p0.bwd(wq)]
    row += list(wq)
    return row
