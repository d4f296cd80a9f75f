"""The cost and memory models of a schedule: what one F, B, W (and S, T, I) costs per stage, and the
activation memory each action holds or frees. Plain data the schedule generators, the simulator and zb-auto
all read (units: see zbcompile/simulate.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from zbcompile.errors import ScheduleError
from zbcompile.ir.schedule import COST_KEYS, KIND_SPECS, VOCAB_COST_KEYS, Kind, Schedule

__all__ = ["Costs", "MemoryModel"]


_COSTS_FORM = ("expected comma-separated KEY=VALUE pairs with keys F, B, W, comm, and S, T, I for vocabulary "
               "parallelism (any subset, any case) and non-negative numbers, e.g. 'F=1,B=1.1,W=0.6,comm=0.05'")
_PARSED_KEYS = ("f", "b", "w", "comm") + VOCAB_COST_KEYS


def _check_cost(name: str, value: float) -> float:
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise ScheduleError(f"cost {name}={value!r} must be a number; {_COSTS_FORM}") from None
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
    def of(value) -> Costs | None:
        """`value` as Costs: a Costs or None as it is, a string parsed (`parse`); ScheduleError otherwise."""
        if value is None or isinstance(value, Costs):
            return value
        if isinstance(value, str):
            return Costs.parse(value)
        raise ScheduleError(f"costs={value!r}: give a zbcompile.Costs, a string ({_COSTS_FORM}) or None")

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
