"""Schedules on the V placement: rank r holds stage r (chunk 0, going down) and stage 2p-1-r (chunk 1,
coming back), so the loss and the first input both sit on rank 0 and the turn is local to rank p-1.

A chunk is half a 1F1B stage: it costs half and holds half the activations (memory 0.5 per F).

    zbv      the handcrafted ZB-V: peak p, zero bubble once m >= 2p (reordered under peak p for m < 2p)
    v-zb     the Controllable Memory paper's V-ZB point (peak p); its order is zbv's
    v-half   building block with peak (p+2)//2, reordered under that peak (v_blocks)
    v-min    building block with peak (p+4)//3 (repeat and squeeze only)
"""

from __future__ import annotations

from collections import deque

from zbcompile.errors import ScheduleError
from zbcompile.ir.schedule import Action, Kind, Schedule, build, v_placement

from ._common import B, F, W, check_microbatches, check_pp
from .v_blocks import block_schedule, reorder_schedule
from .v_polish import polish


def zbv(pp: int, microbatches: int, costs=None) -> Schedule:
    """Handcrafted ZB-V. Rank r, with n = max(2p-1, m) microbatches (those >= m are dropped at the end):

        1. 2(p-r)-1 x F0
        2. r x (F1, F0)
        3. p-r x (F1, B1, W1)
        4. steady, until every F is placed: (F0 while any are left, B0, W0, F1, B1, W1)
        5. cool-down: r x (B0, B1), then p-r x (B0, W0)
        6. the remaining W1's, then the remaining W0's, oldest first

    F0/B0/W0 act on chunk 0 (stage r), F1/B1/W1 on chunk 1 (stage 2p-1-r). Padding to n >= 2p-1 keeps
    the warm-up counts meaningful for small m; dropping every action of a padded microbatch keeps the
    order deadlock-free, so any m >= 1 is admitted. Peak memory p and zero bubble hold for m >= 2p.

    For m < 2p the padded order leaves holes, so it is reordered under the same peak p
    (`v_blocks.reorder_schedule`: passes moved into free slots without raising memory, W's refilled
    into the gaps): 12.73% instead of 22.58% at p=8, m=8, as the authors' greedy ZB-V.

    With `costs` (a `zbcompile.simulate.Costs`) other than unit-like ones, the order is then polished for
    them under the same peak (`v_polish.polish`: bounded local moves, kept only when the makespan drops).
    """
    check_pp("zbv", pp)
    check_microbatches("zbv", pp, microbatches, 1, "1", "")
    return _zbv("zbv", pp, microbatches, costs)


def _zbv(name: str, pp: int, m: int, costs=None) -> Schedule:
    n = max(2 * pp - 1, m)
    ranks = [[a for a in _zbv_rank(pp, r, n) if a.microbatch < m] for r in range(pp)]
    schedule = build(name, m, v_placement(pp), ranks)
    if m < 2 * pp:
        schedule = reorder_schedule(schedule, budget=2 * pp)
    return polish(schedule, costs)


class _Chunk:
    """Counters for one chunk on one rank: the next F and B to place, and the W's waiting for their turn."""

    def __init__(self, stage: int) -> None:
        self.stage, self.f, self.b = stage, 0, 0
        self.pending: deque[int] = deque()

    def fwd(self) -> Action:
        self.f += 1
        return F(self.stage, self.f - 1)

    def bwd(self) -> Action:
        self.pending.append(self.b)
        self.b += 1
        return B(self.stage, self.b - 1)

    def wgt(self) -> Action:
        return W(self.stage, self.pending.popleft())


def _zbv_rank(pp: int, r: int, n: int) -> list[Action]:
    c0, c1 = _Chunk(r), _Chunk(2 * pp - 1 - r)
    row = [c0.fwd() for _ in range(2 * (pp - r) - 1)]
    for _ in range(r):
        row += [c1.fwd(), c0.fwd()]
    for _ in range(pp - r):
        row += [c1.fwd(), c1.bwd(), c1.wgt()]
    while c1.f < c0.f or c0.f < n:
        if c0.f < n:
            row.append(c0.fwd())
        row += [c0.bwd(), c0.wgt(), c1.fwd(), c1.bwd(), c1.wgt()]
    for _ in range(r):
        row += [c0.bwd(), c1.bwd()]
    for _ in range(pp - r):
        row += [c0.bwd(), c0.wgt()]
    while c1.pending:
        row.append(c1.wgt())
    while c0.pending:
        row.append(c0.wgt())
    return row


def v_zb(pp: int, microbatches: int, costs=None) -> Schedule:
    """V-ZB: the zero-bubble end of the controllable-memory family, peak p; same order as `zbv` (and the
    same polish under `costs`)."""
    check_pp("v-zb", pp)
    check_microbatches("v-zb", pp, microbatches, 1, "1", "")
    return _zbv("v-zb", pp, microbatches, costs)


def v_min(pp: int, microbatches: int) -> Schedule:
    """V-Min: a third of 1F1B's activation memory, peak (p+4)//3, for about 2/3 of its bubble."""
    check_pp("v-min", pp)
    check_microbatches("v-min", pp, microbatches, 1, "1", "")
    gap = 2 if pp % 3 == 0 else 0  # keeps the four passes on distinct slots modulo the period 6
    offsets = [(r, 2 * pp - r - 1, 2 * pp + gap + r, 4 * pp + gap - r - 1) for r in range(pp)]
    return _building_block("v-min", pp, microbatches, offsets)


def v_half(pp: int, microbatches: int) -> Schedule:
    """V-Half: half of 1F1B's activation memory, peak (p+2)//2.

    The Controllable Memory paper's V-Half building block, repeated, then reordered under the block's
    peak (warm-up and cool-down passes moved into free slots without raising memory) with the W's refilled
    into the gaps (`v_blocks.block_schedule`). At unit costs this gives the authors' bubble rates
    (10.56% at p=8, m=24; 3p-7 idle chunk slots per rank for even p once m is large).
    """
    check_pp("v-half", pp)
    check_microbatches("v-half", pp, microbatches, 1, "1", "")
    gap = 3 if pp % 2 == 0 else 0  # keeps the four passes on distinct slots modulo the period 6
    offsets = [(2 * r, 3 * pp - r - 2, 3 * pp + gap + 2 * r - 1, 6 * pp + gap - r - 2) for r in range(pp)]
    return block_schedule("v-half", pp, microbatches, offsets, budget=2 * ((pp + 2) // 2))


_PERIOD = 6  # one microbatch is 6 chunk passes per rank: F0 F1 B1 B0 W1 W0


def _building_block(name: str, pp: int, m: int, offsets: list[tuple[int, int, int, int]]) -> Schedule:
    """Repeat a building block every period and read each rank's order off the slot times.

    `offsets[r]` gives the slot of (F0, F1, B1, B0) of microbatch 0 on rank r; microbatch k sits
    6k slots later. Each W takes the first free slot after its B. The block's lifespan fixes the peak
    memory; list scheduling the resulting order (the simulator) then squeezes out the empty slots.
    """
    ranks = []
    for r, (f0, f1, b1, b0) in enumerate(offsets):
        low, high = r, 2 * pp - 1 - r
        slots: dict[int, Action] = {}
        for k in range(m):
            shift = _PERIOD * k
            for kind, stage, t in ((Kind.F, low, f0), (Kind.F, high, f1), (Kind.B, high, b1), (Kind.B, low, b0)):
                if t + shift in slots:
                    raise ScheduleError(f"{name}: building block collides on rank {r} at slot {t + shift} "
                                        f"for pp={pp}; this pp is not supported by {name}, try v-half or zbv")
                slots[t + shift] = Action(kind, stage, k)
        for t in sorted(t for t, a in slots.items() if a.kind is Kind.B):
            free = t + 1
            while free in slots:
                free += 1
            slots[free] = W(slots[t].stage, slots[t].microbatch)
        ranks.append([slots[t] for t in sorted(slots)])
    return build(name, m, v_placement(pp), ranks)
