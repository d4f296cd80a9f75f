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
from dataclasses import dataclass
from typing import Iterator, Mapping

from zbcompile.errors import ScheduleError, SimulationError
from zbcompile.schedule import COST_KEYS, KIND_SPECS, VOCAB_COST_KEYS, Action, Kind, Schedule
from zbcompile.schedule_problem import ScheduleProblem, list_schedule

__all__ = ["Costs", "MemoryModel", "SimResult", "simulate", "list_schedule"]


_COSTS_FORM = ("expected comma-separated KEY=VALUE pairs with keys F, B, W, comm, and S, T, I for vocabulary "
               "parallelism (any subset, any case) and non-negative numbers, e.g. 'F=1,B=1.1,W=0.6,comm=0.05'")
_PARSED_KEYS = ("f", "b", "w", "comm") + VOCAB_COST_KEYS


def _check_cost(name: str, value: float) -> float:
    value = float(value)
    if math.isnan(value) or math.isinf(value) or value < 0:
        raise ScheduleError(f"cost {name}={value} must be a finite non-negative number; {_COSTS_FORM}")
    return value


@dataclass(frozen=True)
class Costs:
    """Time of one F, B, W per 1F1B stage, and of one cross-rank hop.

    `per_stage`, when given, holds one (f, b, w) triple per *model* stage and overrides the uniform costs
    for that stage. These are the stage's own measured times, so they are not scaled by p/S.
    A BW costs b + w.
    """

    f: float = 1.0
    b: float = 1.0
    w: float = 1.0
    comm: float = 0.0
    per_stage: tuple[tuple[float, float, float], ...] | None = None
    s: float = 0.0   # vocabulary parallelism, per shard: an S, a T, an IF or IB (not scaled by p/S)
    t: float = 0.0
    i: float = 0.0

    def __post_init__(self) -> None:
        for name in ("f", "b", "w", "comm", "s", "t", "i"):
            object.__setattr__(self, name, _check_cost(name, getattr(self, name)))
        if self.per_stage is not None:
            rows = []
            for s, triple in enumerate(self.per_stage):
                if len(triple) != 3:
                    raise ScheduleError(f"per_stage[{s}] = {triple!r}: expected an (f, b, w) triple")
                rows.append(tuple(_check_cost(f"per_stage[{s}].{k}", v) for k, v in zip("fbw", triple)))
            object.__setattr__(self, "per_stage", tuple(rows))

    @staticmethod
    def parse(text: str) -> Costs:
        """`"F=1,B=1.1,W=0.6,comm=0.05"` -> Costs; keys are case-insensitive, missing ones keep defaults.
        `S=..,T=..,I=..` set the per-shard times of vocabulary parallelism's S, T and IF/IB."""
        values: dict[str, float] = {}
        for part in text.split(","):
            if not part.strip():
                continue
            key, eq, raw = part.partition("=")
            key = key.strip().lower()
            if not eq or key not in _PARSED_KEYS:
                raise ScheduleError(f"cannot parse costs {text!r} at {part.strip()!r}: {_COSTS_FORM}")
            if key in values:
                raise ScheduleError(f"cannot parse costs {text!r}: {key} given twice; {_COSTS_FORM}")
            try:
                values[key] = float(raw)
            except ValueError:
                raise ScheduleError(f"cannot parse costs {text!r}: {raw.strip()!r} is not a number; "
                                    f"{_COSTS_FORM}") from None
        return Costs(**values)

    def __str__(self) -> str:
        text = f"F={self.f:g},B={self.b:g},W={self.w:g},comm={self.comm:g}"
        if any(getattr(self, key) for key in VOCAB_COST_KEYS):
            text += "".join(f",{key.upper()}={getattr(self, key):g}" for key in VOCAB_COST_KEYS)
        return text + (" (per-stage overrides)" if self.per_stage else "")

    def action_costs(self, schedule: Schedule) -> dict[tuple[Kind, int], float]:
        """(kind, stage) -> time of that action in `schedule`."""
        model_stages = _check_per_stage(self.per_stage, schedule, "costs give", "triples")
        scale = schedule.num_ranks / model_stages
        table = {}
        for s in range(schedule.num_stages):
            if self.per_stage is not None:
                times = dict(zip(COST_KEYS, self.per_stage[schedule.model_stage(s)]))
            else:
                times = {key: getattr(self, key) * scale for key in COST_KEYS}
            times.update((key, getattr(self, key)) for key in VOCAB_COST_KEYS)
            for kind, spec in KIND_SPECS.items():
                table[kind, s] = _total(times[key] for key in spec.cost)
        return table


def _check_per_stage(per_stage, schedule: Schedule, who: str, what: str) -> int:
    """The schedule's model stages, after checking that `per_stage` (if given) has one entry for each."""
    model_stages = schedule.num_model_stages
    if per_stage is not None and len(per_stage) != model_stages:
        raise ScheduleError(f"{who} {len(per_stage)} per-stage {what} but schedule {schedule.name!r} has "
                            f"{model_stages} model stages")
    return model_stages


def _total(times) -> float:
    """Sum in the order given, starting from the first term (so one term is returned exactly)."""
    it = iter(times)
    total = next(it)
    for t in it:
        total += t
    return total


@dataclass(frozen=True)
class MemoryModel:
    """Activation memory: F holds p/S units; B frees the fraction `b_frees` of it, W the rest, BW all.

    The default (B frees nothing) is the authors' conservative model. `bytes_per_microbatch` converts a unit
    (one 1F1B stage's activations for one microbatch) to bytes for `SimResult.peak_bytes`.

    `per_stage`, when given, holds the units an F holds on each *model* stage, overriding p/S (a stage that
    also computes the output layer holds more). `vocab` is what vocabulary parallelism keeps per shard from an
    S until its T: the broadcast last-stage output and the shard's softmax, in the same units (not scaled).
    """

    b_frees: float = 0.0
    bytes_per_microbatch: float | None = None
    vocab: float = 0.0
    per_stage: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.b_frees <= 1.0:
            raise ScheduleError(f"b_frees={self.b_frees} must be a fraction between 0 and 1 (the share of an "
                                f"F's activations that its B frees)")
        if self.bytes_per_microbatch is not None and not self.bytes_per_microbatch >= 0:
            raise ScheduleError(f"bytes_per_microbatch={self.bytes_per_microbatch} must be non-negative")
        object.__setattr__(self, "vocab", _check_cost("vocab", self.vocab))
        if self.per_stage is not None:
            object.__setattr__(self, "per_stage", tuple(_check_cost(f"per_stage[{s}]", units)
                                                        for s, units in enumerate(self.per_stage)))

    def delta(self, kind: Kind, scale: float) -> float:
        """Units held after minus before an action of `kind` on a stage of size `scale` (its KindSpec's rule)."""
        return KIND_SPECS[kind].memory(self, scale)

    def action_deltas(self, schedule: Schedule) -> dict[tuple[Kind, int], float]:
        """(kind, stage) -> units held after minus before that action in `schedule`."""
        model_stages = _check_per_stage(self.per_stage, schedule, "memory model gives", "sizes")
        uniform = schedule.num_ranks / model_stages
        table = {}
        for s in range(schedule.num_stages):
            scale = uniform if self.per_stage is None else self.per_stage[schedule.model_stage(s)]
            for kind in KIND_SPECS:
                table[kind, s] = self.delta(kind, scale)
        return table


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


def simulate(schedule: Schedule, costs: Costs = Costs(), memory: MemoryModel = MemoryModel()) -> SimResult:
    """List-schedule `schedule` under `costs`; see the module docstring for the model.

    A schedule with `Overlap` steps is timed as its `flatten()` (sub-actions back to back on the rank, no
    speed-up from the overlap), and the result's `schedule` is that flat form.

    Does not call `schedule.validate()` (the caller decides), but every dependency must be produced by some
    rank and the order must not deadlock, else SimulationError.
    """
    schedule = schedule.flatten()  # an Overlap's sub-actions run back to back (see Overlap)
    # Work on integer codes (ScheduleProblem): hashing an Action hashes its Kind enum in Python, which would
    # dominate the run time of large schedules.
    problem, orders = ScheduleProblem.of_schedule(schedule, costs, memory, SimulationError)
    start, end, done = problem.list_schedule(orders)
    if any(done[r] < len(orders[r]) for r in range(schedule.num_ranks)):
        ran = {a for row, codes in zip(schedule.ranks, orders) for a, c in zip(row, codes) if end[c] is not None}
        raise _deadlock(schedule, done, ran)
    return _result(schedule, costs, memory, problem, orders, start, end)


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
