"""Time a schedule under a cost model: start and end of every action, bubbles and activation memory.

    Schedule + Costs + MemoryModel  ->  simulate  ->  SimResult (frozen)

The simulator is list scheduling, the same model the Zero Bubble authors' generators carry inside them:
every rank runs its actions in the given order, and an action starts at

    start = max(rank free, max over deps of  dep end + (comm if the dep ran on another rank else 0))

Units. Costs are given per *1F1B stage*, one rank's share of the model. A schedule that cuts the model into
S model stages over p ranks gives each stage p/S of that share, so every action's cost is scaled by p/S (a
chunk of a V schedule, S = 2p, costs half). Memory counts in the same unit: 1 = the activations one 1F1B
stage keeps for one microbatch, so an F adds p/S.

Bubble rates. `bubble_rate` is the papers' number: for each rank, 1 - busy/span where span runs from the
rank's first start to its last end, maximised over ranks. `bubble_share` is the idle share of the whole
p x makespan rectangle, warm-up included.

Errors. A schedule whose order deadlocks, or that consumes a result no rank produces, raises
`SimulationError` with the rank x step grid, the stuck actions in brackets.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Iterator, Mapping, Sequence

from zbcompile.errors import SimulationError
from zbcompile.ir.costs import Costs, MemoryModel
from zbcompile.ir.schedule import Action, Schedule
from zbcompile.ir.schedule_problem import ScheduleProblem, list_schedule

__all__ = ["Costs", "MemoryModel", "SimResult", "simulate", "list_schedule"]


@dataclass(frozen=True, eq=False)
class SimResult:
    """When every action ran, and what that costs in bubbles and memory. Times are in cost units."""

    schedule: Schedule
    costs: Costs
    memory: MemoryModel
    start: Mapping[Action, float]
    end: Mapping[Action, float]
    makespan: float
    busy: tuple[float, ...]         # per rank: sum of action times
    span: tuple[float, ...]         # per rank: last end - first start (0 for an idle rank)
    peak_memory: tuple[float, ...]  # per rank, units
    peak_bytes: tuple[float, ...] | None = None  # per rank, when the memory model knows the bytes

    @property
    def rank_bubbles(self) -> tuple[float, ...]:
        """Per rank: 1 - busy/span (0 for a rank with nothing to do)."""
        return tuple(1.0 - b / s if s > 0 else 0.0 for b, s in zip(self.busy, self.span))

    @property
    def bubble_rate(self) -> float:
        """The papers' bubble rate: the worst rank's idle share of its own span."""
        return max(self.rank_bubbles, default=0.0)

    @property
    def bubble_share(self) -> float:
        """Idle share of all ranks over the whole makespan, warm-up and cool-down included."""
        total = self.schedule.num_ranks * self.makespan
        return 1.0 - sum(self.busy) / total if total > 0 else 0.0

    def timed(self, rank: int) -> Iterator[tuple[Action, float, float]]:
        """(action, start, end) for every action of `rank`, in order."""
        for a in self.schedule.ranks[rank]:
            yield a, self.start[a], self.end[a]


def simulate(schedule: Schedule, costs: Costs = Costs(), memory: MemoryModel = MemoryModel(), *,
             rank_start: Sequence[float] | None = None) -> SimResult:
    """List-schedule `schedule` under `costs`; see the module docstring for the model. rank_start: when each
    rank is free to start (default 0 everywhere: the step boundary of zbcompile/plan_boundary.py sets it).

    A schedule with `Overlap` steps is timed as its `flatten()` (sub-actions back to back on the rank, no
    speed-up from the overlap), and the result's `schedule` is that flat form.

    Does not call `schedule.validate()` (the caller decides), but every dependency must be produced by some
    rank and the order must not deadlock, else SimulationError.
    """
    costs = Costs() if costs is None else Costs.of(costs)   # (a string too: "F=1,B=1,W=1")
    _check_arguments(schedule, rank_start)
    schedule = schedule.flatten()  # an Overlap's sub-actions run back to back (see Overlap)
    # Work on integer codes (ScheduleProblem): hashing an Action hashes its Kind enum in Python, which would
    # dominate the run time of large schedules.
    problem, orders = ScheduleProblem.of_schedule(schedule, costs, memory, SimulationError)
    start, end, done = problem.list_schedule(orders, rank_start)
    if any(done[r] < len(orders[r]) for r in range(schedule.num_ranks)):
        ran = {a for row, codes in zip(schedule.ranks, orders) for a, c in zip(row, codes) if end[c] is not None}
        raise _deadlock(schedule, done, ran)
    return _result(schedule, costs, memory, problem, orders, start, end)


def _check_arguments(schedule, rank_start) -> None:
    """SimulationError for what is not a Schedule, or a rank_start that is not one finite, non-negative time per
    rank (a NaN would time every action at NaN, without a word)."""
    if not isinstance(schedule, Schedule):
        raise SimulationError(f"simulate takes a Schedule, got a {type(schedule).__name__} ({schedule!r:.60}): "
                              "build one with zbcompile.generate(name, pp, microbatches) or Schedule.from_text")
    if rank_start is None:
        return
    starts = list(rank_start)
    if len(starts) != schedule.num_ranks or not all(
            isinstance(t, numbers.Real) and not isinstance(t, bool) and math.isfinite(t) and t >= 0 for t in starts):
        raise SimulationError(f"rank_start={starts!r}: give one finite, non-negative start time per rank "
                              f"({schedule.num_ranks} for {schedule.name!r})")


def _deadlock(schedule: Schedule, steps: list[int], done: set[Action]) -> SimulationError:
    return SimulationError(schedule.describe_deadlock(steps, done))


def _result(schedule: Schedule, costs: Costs, memory: MemoryModel, problem: ScheduleProblem,
            orders: list[list[int]], start: list[float], end: list[float]) -> SimResult:
    busy, span, peak = [], [], []
    for row in orders:
        busy.append(sum(end[i] - start[i] for i in row))
        span.append(end[row[-1]] - start[row[0]] if row else 0.0)
        peak.append(round(problem.peak(row), 9))  # float noise from fractional frees
    peak_bytes = None
    if memory.bytes_per_microbatch is not None:
        peak_bytes = tuple(u * memory.bytes_per_microbatch for u in peak)
    actions = [a for row in schedule.ranks for a in row]
    codes = [c for row in orders for c in row]
    return SimResult(schedule, costs, memory, {a: start[c] for a, c in zip(actions, codes)},
                     {a: end[c] for a, c in zip(actions, codes)}, max((end[c] for c in codes), default=0.0),
                     tuple(busy), tuple(span), tuple(peak), peak_bytes)
