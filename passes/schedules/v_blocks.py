"""Controllable-memory V schedules: building block, repeat, reorder under a memory cap, refill the W's.

The passes on the V placement (rank r holds chunk 0 = stage r and chunk 1 = stage 2p-1-r) are laid out on
a grid of unit slots, one pass per slot per rank (unit costs; memory in chunk activations, F +1, W -1,
B 0, so a rank's memory depends on its order only):

    1. building block  `offsets[r]` = slots of (F0, F1, B1, B0) of microbatch 0 on rank r; microbatch k
                       sits 6k slots later (one period = the 6 passes of one microbatch). Each W goes to the
                       first free slot after its B. The block's lifespan fixes the peak memory `budget`.
                       Squeeze: every pass moves to the earliest slot its rank's order and inputs allow.
    2. reorder         walk the passes in slot order and move each into the earliest free slot of its rank
                       after its inputs where it does not raise that rank's memory above `budget`.
                       The tiled steady state is already dense, so in effect this reshapes the warm-up and
                       the cool-down, where the block leaves memory unused.
    3. reorder again   with the W's taken out (and the grid squeezed again), which lets the B's, and so the
                       critical path, move up further; memory is then the running count of F's, so F's
                       only move among the first `budget`.
    4. refill W's      list-schedule the F/B order slot by slot: run the next F/B when its inputs are there
                       (and, for an F, when the memory allows), otherwise the oldest pending W. A W then only
                       fills a gap or frees memory for an F, so it never delays the critical path.

The memory check in steps 2-3 first looks at occupied slots only: an F may land in the free slot just
before a W that makes room for it, and step 4 runs that W first. This reproduces the authors' V-Half
bubbles exactly. Should step 4 ever find an F waiting for memory with no W pending, steps 2-4 are redone
checking every slot, which cannot fail: then every F in step 2's order has at most `budget` F's without
their W (so without their B) before it, step 3 only moves B's up and F's within the first `budget`, so
step 4 always has a pending W when an F waits for memory.

`reorder_schedule` runs steps 2-4 on an existing V schedule (zbv uses it for m < 2p, where its padded
warm-up leaves holes). All bookkeeping is on the action codes of one `ScheduleProblem` (its `chain` over the
V placement, which also gives the dependencies and the memory deltas), not on `Action`s, so p=32, m=256
builds in about half a second.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import Sequence

from zbcompile.errors import ScheduleError
from zbcompile.ir.schedule import Kind, Schedule, build, v_placement
from zbcompile.ir.schedule_problem import ActionCodes, ScheduleProblem

__all__ = ["PERIOD", "block_schedule", "reorder_schedule"]

PERIOD = 6  # one microbatch is 6 chunk passes per rank: F0 F1 B1 B0 W1 W0

_F, _B, _W = 0, 1, 2  # kind indices of the codes (code % width)
_NONE = -1


def block_schedule(name: str, pp: int, m: int, offsets: Sequence[tuple[int, int, int, int]],
                   budget: int | None = None) -> Schedule:
    """Build a V schedule from a building block (see the module docstring).

    `budget` is the peak memory per rank in chunk activations (2p = 1F1B); None takes the block's own peak.
    A budget below the block's peak is refused: the tiled steady state would exceed it.
    """
    prob = _problem(pp, m)
    tiled, placed = _squeeze(_tile(name, pp, m, offsets, prob.codes), prob.deps)
    peak = max(_peak(prob, row) for row in tiled)
    if budget is None:
        budget = peak
    if peak > budget:
        raise ScheduleError(f"{name}: the building block needs peak memory {peak / 2:g} (1F1B-stage units) "
                            f"for pp={pp}, above the budget {budget / 2:g}")
    return _finish(name, pp, tiled, placed, prob, budget)


def reorder_schedule(schedule: Schedule, budget: int) -> Schedule:
    """Steps 2-4 on an existing V schedule (F/B/W, no BW), timed at unit costs: the same passes, reordered
    so that no rank holds more than `budget` chunk activations (the schedule itself must fit it)."""
    pp, m = schedule.num_ranks, schedule.num_microbatches
    if schedule.placement != v_placement(pp) or schedule.pipelines != 1:
        raise ScheduleError(f"{schedule.name}: reorder_schedule takes a V-placement schedule")
    prob = _problem(pp, m)
    orders = []
    for row in schedule.ranks:
        if any(a.kind is Kind.BW for a in row):
            raise ScheduleError(f"{schedule.name}: reorder_schedule needs B and W split, found a BW")
        orders.append([prob.codes.of(a) for a in row])
    grid, slot_of = _asap(orders, prob.deps)
    if max(_peak(prob, row) for row in grid) > budget:
        raise ScheduleError(f"{schedule.name}: the schedule already exceeds the memory budget {budget / 2:g}")
    return _finish(schedule.name, pp, grid, slot_of, prob, budget)


def _problem(pp: int, m: int) -> ScheduleProblem:
    """The V's passes on the integer grid: unit times, memory in chunk activations (F +1, W -1, B 0)."""
    return ScheduleProblem.chain(2 * pp, m, v_placement(pp), [(1.0, 1.0, 1.0)] * (2 * pp))


def _finish(name: str, pp: int, grid: list[list[int]], slot_of: list[int], prob: ScheduleProblem,
            budget: int) -> Schedule:
    """Reorder with W's, reorder without, refill the W's (module docstring, steps 2-4).

    The reorder first checks memory at occupied slots only (an F may then land just before the W that makes
    room for it, which the refill resolves by running that W first); in the rare case where the refill
    then finds no W to run, it is redone with every slot checked, which cannot fail.
    """
    deps, codes, width = prob.deps, prob.codes, prob.codes.width
    m = codes.num_microbatches
    for lax in (True, False):
        cells, where = [list(row) for row in grid], list(slot_of)
        _reorder(cells, where, deps, width, budget, with_w=True, lax=lax)
        for row in cells:
            for t, c in enumerate(row):
                if c != _NONE and c % width == _W:
                    row[t] = _NONE
        cells, where = _squeeze(cells, deps)
        _reorder(cells, where, deps, width, budget, with_w=False, lax=lax)
        ranks = _fill_w([[c for c in row if c != _NONE] for row in cells], deps, width, budget)
        if ranks is not None:
            break
    else:  # unreachable: the strict reorder keeps every F within budget (see the module docstring)
        raise ScheduleError(f"{name}: no order for pp={pp}, m={m} fits the memory budget {budget / 2:g}")
    return build(name, m, v_placement(pp), [[codes.action(c) for c in row] for row in ranks])


def _tile(name: str, pp: int, m: int, offsets: Sequence[tuple[int, int, int, int]],
          codes: ActionCodes) -> list[list[int]]:
    """Repeat the block every PERIOD slots; each W takes the first free slot after its B."""
    if len(offsets) != pp:
        raise ScheduleError(f"{name}: the building block gives {len(offsets)} ranks' offsets, expected {pp}")
    cells: list[list[int]] = []
    nst, width = codes.num_stages, codes.width
    for r, offs in enumerate(offsets):
        low, high = r, nst - 1 - r
        if min(offs) < 0:
            raise ScheduleError(f"{name}: building block offsets {offs} on rank {r} must be non-negative")
        row = [_NONE] * (max(offs) + (PERIOD + 2) * m)  # room for the W's behind the last B; trimmed below
        for k in range(m):
            shift = PERIOD * k
            for kind, stage, t in ((Kind.F, low, offs[0]), (Kind.F, high, offs[1]), (Kind.B, high, offs[2]),
                                   (Kind.B, low, offs[3])):
                if row[t + shift] != _NONE:
                    raise ScheduleError(f"{name}: building block collides on rank {r} at slot {t + shift} "
                                        f"for pp={pp}; this pp is not supported by {name}")
                row[t + shift] = codes.code(kind, stage, k)
        free = 0
        for t in range(len(row)):
            c = row[t]
            if c != _NONE and c % width == _B:
                free = max(free, t + 1)
                while row[free] != _NONE:
                    free += 1
                row[free] = c + _W - _B
        while row and row[-1] == _NONE:
            row.pop()
        cells.append(row)
    return cells


def _squeeze(cells: list[list[int]], deps: list[tuple[int, ...]]) -> tuple[list[list[int]], list[int]]:
    """Left-shift every pass to the earliest slot after its inputs and its rank's previous pass, keeping
    each rank's order (so the memory profile, which depends on the order only, is unchanged).

    Returns the new grid and slot_of: code -> its slot (-1 for codes not on the grid)."""
    pp = len(cells)
    slot_of = [_NONE] * len(deps)
    last = [-1] * pp
    placed: list[list[tuple[int, int]]] = [[] for _ in range(pp)]
    for t in range(max(map(len, cells), default=0)):
        for r in range(pp):
            row = cells[r]
            if t < len(row) and row[t] != _NONE:
                code = row[t]
                at = last[r] + 1
                for d in deps[code]:
                    if slot_of[d] >= at:
                        at = slot_of[d] + 1
                slot_of[code] = last[r] = at
                placed[r].append((at, code))
    out = [[_NONE] * (n + 1) for n in last]
    for r, pairs in enumerate(placed):
        row = out[r]
        for at, code in pairs:
            row[at] = code
    return out, slot_of


def _asap(orders: list[list[int]], deps: list[tuple[int, ...]]) -> tuple[list[list[int]], list[int]]:
    """Unit-time list scheduling of fixed per-rank orders: each pass in the first slot after its rank's
    previous pass and its inputs. Raises ScheduleError if the orders deadlock."""
    pp = len(orders)
    slot_of = [_NONE] * len(deps)
    pos = [0] * pp
    free = [0] * pp
    grid: list[list[int]] = [[] for _ in range(pp)]
    left = sum(map(len, orders))
    while left:
        moved = False
        for r in range(pp):
            order, row = orders[r], grid[r]
            while pos[r] < len(order):
                code = order[pos[r]]
                at = free[r]
                for d in deps[code]:
                    if slot_of[d] == _NONE:
                        break
                    if slot_of[d] >= at:
                        at = slot_of[d] + 1
                else:
                    slot_of[code] = at
                    free[r] = at + 1
                    row.extend([_NONE] * (at - len(row)))
                    row.append(code)
                    pos[r] += 1
                    left -= 1
                    moved = True
                    continue
                break
        if not moved:
            raise ScheduleError("reorder_schedule: the schedule's order deadlocks")
    return grid, slot_of


def _peak(prob: ScheduleProblem, row: list[int]) -> int:
    """The peak memory of a grid row (free slots skipped), in chunk activations."""
    return int(prob.peak([c for c in row if c != _NONE]))


# ---- reorder -----------------------------------------------------------------------------------------

def _reorder(cells: list[list[int]], slot_of: list[int], deps: list[tuple[int, ...]], width: int, budget: int,
             with_w: bool, lax: bool) -> None:
    """Move every pass, in slot order, to the earliest free slot after its inputs that keeps memory <= budget.

    Memory counts F +1 and, when `with_w`, W -1 (without W's it is the running count of F's, so F's then
    only move within the first `budget` of them). Moving a pass earlier never breaks what depends on it.
    """
    pp = len(cells)
    free: list[list[int]] = []
    held: list[list[int]] = []  # held[r][t]: memory after slot t
    for row in cells:
        free.append([t for t, c in enumerate(row) if c == _NONE])
        level, trace = 0, []
        for c in row:
            if c != _NONE:
                kind = c % width
                level += 1 if kind == _F else (-1 if kind == _W and with_w else 0)
            trace.append(level)
        held.append(trace)
    for t0 in range(max(map(len, cells), default=0)):
        for r in range(pp):
            row = cells[r]
            if t0 >= len(row) or row[t0] == _NONE:
                continue
            code = row[t0]
            gaps, trace = free[r], held[r]
            earliest = 0
            for d in deps[code]:
                if slot_of[d] >= earliest:
                    earliest = slot_of[d] + 1
            i = bisect_left(gaps, earliest)
            if i == len(gaps) or gaps[i] >= t0:
                continue  # no free slot to move into
            kind = code % width
            if kind == _F:
                # the F raises memory by one on every slot it jumps over; the slots where that still fits
                # form a suffix [x, t0) (lax: only occupied slots are checked), found by walking back
                x = t0
                while x > earliest and (trace[x - 1] < budget or (lax and row[x - 1] == _NONE)):
                    x -= 1
                i = bisect_left(gaps, x)
                if i == len(gaps) or gaps[i] >= t0:
                    continue
            c = gaps[i]
            step = 1 if kind == _F else (-1 if kind == _W and with_w else 0)
            if step:
                for t in range(c, t0):
                    trace[t] += step
            row[c], row[t0] = code, _NONE
            slot_of[code] = c
            del gaps[i]
            insort(gaps, t0)


# ---- W refill ----------------------------------------------------------------------------------------

def _fill_w(orders: list[list[int]], deps: list[tuple[int, ...]], width: int,
            budget: int) -> list[list[int]] | None:
    """Unit-time list scheduling of the F/B orders, slotting each rank's oldest pending W into every step
    where its next F/B cannot run (inputs not there yet, or an F that would exceed the budget).

    Returns None when an F waits for memory that no pending W can free (the order needs a bigger budget).
    """
    pp = len(orders)
    done_at: dict[int, int] = {}
    pos = [0] * pp
    mem = [0] * pp
    pending: list[list[int]] = [[] for _ in range(pp)]
    head = [0] * pp
    out: list[list[int]] = [[] for _ in range(pp)]
    left = sum(len(o) for o in orders)
    t = 0
    while left:
        finished = []
        for r in range(pp):
            order = orders[r]
            act = _NONE
            if pos[r] < len(order):
                code = order[pos[r]]
                kind = code % width
                if (kind != _F or mem[r] < budget) and all(done_at.get(d, t + 1) <= t for d in deps[code]):
                    act = code
                    pos[r] += 1
                    left -= 1
                    if kind == _F:
                        mem[r] += 1
                    else:
                        pending[r].append(code + _W - _B)
            if act == _NONE and head[r] < len(pending[r]):
                act = pending[r][head[r]]
                head[r] += 1
                mem[r] -= 1
            if act != _NONE:
                out[r].append(act)
                finished.append(act)
        if not finished:
            return None
        t += 1
        for c in finished:
            done_at[c] = t
    for r in range(pp):
        out[r].extend(pending[r][head[r]:])
    return out
