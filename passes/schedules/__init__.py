"""Schedule generators: pure functions from integers to a validated `Schedule`.

    generate("zb-h1", pp=4, microbatches=8)  ->  Schedule

Each hand-made generator lives with its family (gpipe_1f1b, interleaved, zero_bubble, v_shape, dualpipe);
`zb-auto` is the cost- and memory-aware search (`zb_auto/`). Every generator has one `ScheduleSpec` in
`SCHEDULES`: the function, its one-line description, how many stages a rank holds, which options it
reads, and the papers' closed form. `generate`, `list_schedules` and `zbcompile.plan` read that table only.
"""

from __future__ import annotations

import numbers
import operator
from dataclasses import dataclass
from typing import Callable

from zbcompile.errors import ScheduleError
from zbcompile.ir.costs import Costs
from zbcompile.ir.schedule import Schedule

from .dualpipe import dualpipe, dualpipev
from .gpipe_1f1b import gpipe, one_f_one_b, one_rank
from .interleaved import interleaved_1f1b
from .v_shape import v_half, v_min, v_zb, zbv
from .vocab import insert_vocab
from .zb_auto import zb_auto as _zb_auto  # keeps `schedules.zb_auto` the module
from .zero_bubble import zb_h1, zb_h2

__all__ = ["ScheduleSpec", "SCHEDULES", "GENERATORS", "generate", "list_schedules", "insert_vocab", "one_rank"]

OPTIONS = frozenset({"chunks", "costs", "mem_limit"})
# (pp, microbatches, chunks) -> (bubble rate, peak memory in 1F1B-stage units), None where the paper has none
ClosedForm = Callable[[int, int, int], "tuple[float | None, float | None]"]


@dataclass(frozen=True)
class ScheduleSpec:
    """One generator and what the registry knows about it.

    fn               (pp, microbatches, **options) -> Schedule, options being those named in `accepts`
    description      one line for `list_schedules` (the CLI prints it)
    stages_per_rank  stages a rank holds; None when `chunks` chooses it
    accepts          the options of `generate` the function reads: a subset of {"chunks", "costs", "mem_limit"}
    closed_form      the papers' (bubble rate, peak memory) under unit costs and no communication, either
                     part None where no closed form is stated; None for no closed form at all. The peak is the
                     steady state's: with fewer microbatches than it, a rank never holds more than m
                     (zbcompile.plan.closed_form caps it)
    """

    fn: Callable[..., Schedule]
    description: str
    stages_per_rank: int | None = 1
    accepts: frozenset[str] = frozenset()
    closed_form: ClosedForm | None = None

    def __post_init__(self) -> None:
        if not self.accepts <= OPTIONS:
            raise ScheduleError(f"ScheduleSpec for {self.fn.__name__}: unknown options {set(self.accepts) - OPTIONS}")
        if (self.stages_per_rank is None) != ("chunks" in self.accepts):
            raise ScheduleError(f"ScheduleSpec for {self.fn.__name__}: stages_per_rank is None exactly when "
                                f"the generator accepts chunks")


def _zero_once(p: int, m: int, peak: float, from_m: int | None = None) -> tuple[float | None, float]:
    """(0 bubble once m >= from_m (default 2p), else no closed form; `peak`)."""
    return (0.0 if m >= (2 * p if from_m is None else from_m) else None), peak


SCHEDULES: dict[str, ScheduleSpec] = {
    "gpipe": ScheduleSpec(gpipe, "all forwards, then all backwards; peak memory m",
                          closed_form=lambda p, m, v: ((p - 1) / (m + p - 1), m)),
    "1f1b": ScheduleSpec(one_f_one_b, "one forward, one fused backward; peak p, bubble (p-1)/(m+p-1); any m >= 1",
                         closed_form=lambda p, m, v: ((p - 1) / (m + p - 1), p)),
    "interleaved-1f1b": ScheduleSpec(
        interleaved_1f1b, "Megatron virtual pipeline with --chunks v >= 2 (default 2); bubble (p-1)/(vm+p-1); m >= p",
        stages_per_rank=None, accepts=frozenset({"chunks"}),
        closed_form=lambda p, m, v: ((p - 1) / (v * m + p - 1), None)),
    "zb-h1": ScheduleSpec(zb_h1, "handcrafted zero bubble, B/W split; peak p, bubble (p-1)/(3m+p-1) once m >= p; "
                                 "any m >= 1",
                          closed_form=lambda p, m, v: ((p - 1) / (3 * m + p - 1) if m >= p else None, p)),
    "zb-h2": ScheduleSpec(zb_h2, "handcrafted zero bubble, B/W split; peak 2p-1, zero bubble once m >= 2p-1; "
                                 "any m >= 1",
                          closed_form=lambda p, m, v: _zero_once(p, m, 2 * p - 1, from_m=2 * p - 1)),
    "zbv": ScheduleSpec(zbv, "handcrafted ZB-V on the V placement; peak p, zero bubble once m >= 2p; any m >= 1",
                        stages_per_rank=2, accepts=frozenset({"costs"}),
                        closed_form=lambda p, m, v: _zero_once(p, m, p)),
    "v-min": ScheduleSpec(v_min, "controllable-memory V, peak (p+4)//3 (a third of 1F1B); any m >= 1",
                          stages_per_rank=2, closed_form=lambda p, m, v: (None, (p + 4) // 3)),
    "v-half": ScheduleSpec(v_half, "controllable-memory V, peak (p+2)//2 (half of 1F1B); any m >= 1",
                           stages_per_rank=2, closed_form=lambda p, m, v: (None, (p + 2) // 2)),
    "v-zb": ScheduleSpec(v_zb, "controllable-memory V at peak p (ZB-V's order); zero bubble once m >= 2p",
                         stages_per_rank=2, accepts=frozenset({"costs"}),
                         closed_form=lambda p, m, v: _zero_once(p, m, p)),
    # dualpipe's papers' bubble assumes overlapped F&B, which the simulator runs one after the other
    "dualpipe": ScheduleSpec(
        dualpipe, "DeepSeek DualPipe, two mirrored pipelines over even p; peak p+1; m >= 2 (2p for its steady state)",
        stages_per_rank=2),
    "dualpipev": ScheduleSpec(
        dualpipev, "DualPipe folded into a V (DualPipeV); peak p+0.5; m >= 1 (2p for its steady state)",
        stages_per_rank=2),
    # zb-auto's memory is its limit and its bubble depends on it: no closed form
    "zb-auto": ScheduleSpec(_zb_auto, "automatic zero-bubble search under --costs and --mem-limit",
                            accepts=frozenset({"costs", "mem_limit"})),
}

GENERATORS: dict[str, Callable[..., Schedule]] = {name: spec.fn for name, spec in SCHEDULES.items()}


def list_schedules() -> dict[str, str]:
    """Schedule name -> one-line description, in registry order (the CLI prints this)."""
    return {name: spec.description for name, spec in SCHEDULES.items()}


def generate(name: str, pp: int, microbatches: int, *, chunks: int | None = None, costs=None,
             mem_limit: float | None = None, vocab: bool = False) -> Schedule:
    """Build schedule `name` for `pp` ranks and `microbatches`; raises ScheduleError on bad input.

    Each generator reads only the options its `ScheduleSpec.accepts` names (`chunks`: interleaved-1f1b;
    `mem_limit`: zb-auto; `costs`: zb-auto, and zbv and v-zb, which polish their order for them under their
    own peak); the others are fixed orders whatever the costs. `chunks` equal to a fixed generator's own
    stages per rank is accepted and ignored.

    `vocab=True` adds vocabulary parallelism: `insert_vocab(schedule, costs)`, the S, T, IF and IB passes of
    every microbatch on every rank, named "{name}+vocab" (the base generator reads only costs' f, b, w,
    comm). Costs without the per-shard s, t, i (or None, unit costs) place them for an output layer as
    costly as one 1F1B stage's F + B + W; `vocab.vocab_costs` sets them from the output layer's real time.
    """
    spec = SCHEDULES.get(name)
    if spec is None:
        raise ScheduleError(f"unknown schedule {name!r}; valid names: {', '.join(SCHEDULES)}")
    pp, microbatches = _whole("pp", pp), _whole("microbatches", microbatches)
    chunks = None if chunks is None else _whole("chunks", chunks)
    if mem_limit is not None:
        mem_limit = _mem_limit(name, spec, mem_limit)
    if "chunks" not in spec.accepts and chunks is not None and chunks != spec.stages_per_rank:
        raise ScheduleError(f"schedule {name!r} holds {spec.stages_per_rank} stage(s) per rank and cannot take "
                            f"chunks={chunks} (--chunks on the command line): drop it, or pick interleaved-1f1b for a "
                            "chosen number of chunks")
    costs = Costs.of(costs)   # (a string too, as compile and the command line take it)
    given = {"chunks": chunks, "costs": costs, "mem_limit": mem_limit}
    schedule = spec.fn(pp, microbatches, **{key: given[key] for key in spec.accepts})
    return insert_vocab(schedule, costs) if vocab else schedule


def _whole(name: str, value) -> int:
    """`value` as an int: a Python or NumPy integer (operator.index); ScheduleError for anything else, a float
    or a bool included (8.0 microbatches is most likely a division that should have been //)."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise ScheduleError(f"{name}={value!r} must be a whole number (an int), got a {type(value).__name__}: pass "
                        f"int({name}) (or // where it comes from a division)")


def _mem_limit(name: str, spec: ScheduleSpec, value) -> float:
    """mem_limit as a float, for a schedule that reads it; ScheduleError for one with a fixed peak of its own (the
    value would be ignored without a word) and for a value that is not a number."""
    if "mem_limit" not in spec.accepts:
        readers = [n for n, s in SCHEDULES.items() if "mem_limit" in s.accepts]
        raise ScheduleError(f"schedule {name!r} runs a fixed order with a peak of its own and does not read "
                            f"mem_limit={value!r}: drop it, or pick {' / '.join(readers)}, which plans under it")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ScheduleError(f"mem_limit={value!r} must be a number of 1F1B-stage activation units (pp gives "
                            f"ZB-1p, 2*pp ZB-2p), got a {type(value).__name__}")
    return float(value)
