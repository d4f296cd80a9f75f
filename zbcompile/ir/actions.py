"""The action IR: the kinds of work (`Kind`, one `KindSpec` each in `KIND_SPECS`), an action
(kind, stage, microbatch) that prints and parses as `2F0`, and the overlapped step `(2F3;1B1)`.

`zbcompile.ir.schedule` re-exports everything here; see its docstring for the glossary and docs/design.md,
"Adding an action kind", for what a kind's spec holds and who reads it.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Callable, Iterable, NamedTuple, Protocol, Sequence

from zbcompile.errors import ScheduleError

__all__ = ["Kind", "KindSpec", "DepContext", "MemoryRates", "KIND_SPECS", "COST_KEYS", "VOCAB_COST_KEYS",
           "SHARDED_KINDS", "CELL_FORMS", "Action", "Overlap", "parse_step"]


class Kind(str, enum.Enum):
    """What an action computes for one (stage, microbatch). A str enum: actions are hashed millions of
    times when large schedules are checked, and str's hash is C code where Enum's is Python.

    Each kind's meaning, text code, dependency rule, cost and memory effect live in its `KindSpec` in
    `KIND_SPECS`, the one place that gives a kind its meaning (see docs/design.md, "Adding an action kind").
    """

    F = "F"
    B = "B"
    W = "W"
    BW = "BW"
    # vocabulary parallelism: sharded kinds, run by every rank on its own shard (the action's stage field is
    # the shard, which is the rank)
    S = "S"
    T = "T"
    IF = "IF"
    IB = "IB"

    def __repr__(self) -> str:
        return f"Kind.{self.name}"

    @property
    def spec(self) -> KindSpec:
        return KIND_SPECS[self]


class DepContext(Protocol):
    """What a dependency rule may ask about the schedule (a `Schedule` is one)."""

    def is_first(self, stage: int) -> bool: ...

    def is_last(self, stage: int) -> bool: ...

    def backward_of(self, stage: int, microbatch: int) -> Action: ...

    @property
    def vocab_shards(self) -> int:
        """How many vocabulary shards the schedule's sharded actions run on (one per rank); 0 without any."""

    def first_of(self, microbatch: int) -> int:
        """The first stage on `microbatch`'s pipeline."""

    def last_of(self, microbatch: int) -> int:
        """The last stage on `microbatch`'s pipeline."""


class MemoryRates(Protocol):
    """What a memory rule may ask of the memory model (`zbcompile.simulate.MemoryModel` is one)."""

    @property
    def b_frees(self) -> float:
        """The share of an F's activations its B frees (its W frees the rest)."""

    @property
    def vocab(self) -> float:
        """Units an S holds until its T frees them (vocabulary parallelism, per shard)."""


DepRule = Callable[[DepContext, int, int], "tuple[Action, ...]"]
COST_KEYS = ("f", "b", "w")  # the per-stage times a `zbcompile.simulate.Costs` holds, in per_stage order
VOCAB_COST_KEYS = ("s", "t", "i")  # its per-shard times of the sharded kinds (an S, a T, an IF or an IB)


@dataclass(frozen=True)
class KindSpec:
    """Everything the schedule IR, the simulator and the searches know about one action kind.

    meaning   one line, for docs and error messages
    label     a few words for legends (`zbcompile.timeline`)
    code      the text code between stage and microbatch (`2F0`); codes must be unique
    torch     torch.distributed.pipelining's code for it in the compute-only CSV, or None if torch has none
    deps      (context, stage, microbatch) -> the actions this one consumes (their results must exist first)
    cost      the COST_KEYS (VOCAB_COST_KEYS for sharded kinds) whose times add up to this action's time (BW: b + w)
    memory    (rates, scale) -> activation units held after minus before: `rates` is the memory model
              (`MemoryRates`: `b_frees`, `vocab`), `scale` the units an F holds on this stage
    in_cell   whether the kind counts in `Schedule.validate`'s per-(stage, microbatch) check against CELL_FORMS
    sharded   run by every rank on its own vocabulary shard: the action's stage field is the shard (= the rank),
              and each comes with a collective every rank joins in the same order (vocabulary parallelism)
    forward   kept in a forward-only (evaluation) step, `Schedule.forward_only`: F, and with vocabulary
              parallelism IF, S and T (there T computes the loss only, from the gathered statistics)
    loss_only of the forward kinds, computes toward the loss alone (S, T): left out of a forward-only step that
              returns the model's outputs instead
    """

    meaning: str
    label: str
    code: str
    torch: str | None
    deps: DepRule
    cost: tuple[str, ...]
    memory: Callable[[MemoryRates, float], float]
    in_cell: bool = True
    sharded: bool = False
    forward: bool = False
    loss_only: bool = False


def _all_shards(ctx: DepContext, kind: Kind, mb: int) -> tuple[Action, ...]:
    return tuple(Action(kind, shard, mb) for shard in range(ctx.vocab_shards))


def _forward_deps(ctx: DepContext, s: int, mb: int) -> tuple[Action, ...]:
    """An F needs the previous stage's F; with vocabulary parallelism a first stage needs every shard's IF
    (their partial embeddings are summed into its input)."""
    if ctx.is_first(s):
        return _all_shards(ctx, Kind.IF, mb)
    return (Action(Kind.F, s - 1, mb),)


def _input_grad_deps(ctx: DepContext, s: int, mb: int) -> tuple[Action, ...]:
    """A B or BW needs its own stage's F and the next stage's input gradient (its B, or its BW if fused); with
    vocabulary parallelism a last stage needs every shard's T (their shares of the gradient are summed)."""
    own_f = Action(Kind.F, s, mb)
    if ctx.is_last(s):
        return (own_f,) + _all_shards(ctx, Kind.T, mb)
    return (own_f, ctx.backward_of(s + 1, mb))


def _weight_grad_deps(ctx: DepContext, s: int, mb: int) -> tuple[Action, ...]:
    return (Action(Kind.B, s, mb),)


def _output_forward_deps(ctx: DepContext, shard: int, mb: int) -> tuple[Action, ...]:
    """S needs the last stage's output, broadcast to every rank."""
    return (Action(Kind.F, ctx.last_of(mb), mb),)


def _output_backward_deps(ctx: DepContext, shard: int, mb: int) -> tuple[Action, ...]:
    """T needs every shard's softmax statistics (gathered after their S)."""
    return _all_shards(ctx, Kind.S, mb)


def _input_forward_deps(ctx: DepContext, shard: int, mb: int) -> tuple[Action, ...]:
    return ()


def _input_backward_deps(ctx: DepContext, shard: int, mb: int) -> tuple[Action, ...]:
    """IB needs the first stage's input gradient, broadcast to every rank."""
    return (ctx.backward_of(ctx.first_of(mb), mb),)


KIND_SPECS: dict[Kind, KindSpec] = {
    Kind.F: KindSpec(
        meaning="forward: stage inputs -> stage outputs, saving what the backward needs", label="forward",
        code="F", torch="F", deps=_forward_deps, cost=("f",), memory=lambda rates, scale: scale, forward=True),
    Kind.B: KindSpec(
        meaning="backward for the stage input only (on the critical path)", label="backward (input)",
        code="B", torch="I", deps=_input_grad_deps, cost=("b",), memory=lambda rates, scale: -rates.b_frees * scale),
    Kind.W: KindSpec(
        meaning="backward for the weights only (free to move into idle slots)", label="backward (weights)",
        code="W", torch="W", deps=_weight_grad_deps, cost=("w",),
        memory=lambda rates, scale: -(1.0 - rates.b_frees) * scale),
    Kind.BW: KindSpec(
        meaning="B and W fused, as in plain 1F1B", label="fused backward",
        code="BW", torch="B", deps=_input_grad_deps, cost=("b", "w"), memory=lambda rates, scale: -scale),
    Kind.S: KindSpec(
        meaning="output layer forward on this rank's vocabulary shard: local logits and softmax statistics "
                "(after the last stage's output is broadcast; its statistics are then gathered by every rank)",
        label="vocab output (S)", code="S", torch=None, deps=_output_forward_deps, cost=("s",),
        memory=lambda rates, scale: rates.vocab, in_cell=False, sharded=True, forward=True,
        loss_only=True),
    Kind.T: KindSpec(
        meaning="output layer backward on this rank's shard: the loss, the shard's weight gradient and its share "
                "of the last stage's output gradient (summed onto the last stage's rank)",
        label="vocab output (T)", code="T", torch=None, deps=_output_backward_deps, cost=("t",),
        memory=lambda rates, scale: -rates.vocab, in_cell=False, sharded=True, forward=True,
        loss_only=True),
    Kind.IF: KindSpec(
        meaning="input embedding forward on this rank's shard: a partial lookup, summed onto the first stage's rank",
        label="vocab input (IF)", code="IF", torch=None, deps=_input_forward_deps, cost=("i",),
        memory=lambda rates, scale: 0.0, in_cell=False, sharded=True, forward=True),
    Kind.IB: KindSpec(
        meaning="input embedding backward on this rank's shard: the first stage's input gradient (broadcast) "
                "scattered into the shard's rows",
        label="vocab input (IB)", code="IB", torch=None, deps=_input_backward_deps, cost=("i",),
        memory=lambda rates, scale: 0.0, in_cell=False, sharded=True),
}

SHARDED_KINDS: tuple[Kind, ...] = tuple(kind for kind, spec in KIND_SPECS.items() if spec.sharded)

# The kind sets a (stage, microbatch) on a microbatch's pipeline may hold (kinds with in_cell=False aside).
CELL_FORMS: tuple[frozenset[Kind], ...] = (frozenset({Kind.F, Kind.BW}), frozenset({Kind.F, Kind.B, Kind.W}))

_BY_CODE = {spec.code: kind for kind, spec in KIND_SPECS.items()}
# Longest code first, so that `BW` is not read as `B` followed by a microbatch.
_ACTION_RE = re.compile(r"^\s*(\d+)(" + "|".join(sorted(map(re.escape, _BY_CODE), key=len, reverse=True))
                        + r")(\d+)\s*$")


class Action(NamedTuple):
    """One unit of work: `kind` for `stage` on `microbatch`. Prints and parses as `2F0`."""

    kind: Kind
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{KIND_SPECS[self.kind].code}{self.microbatch}"

    def __repr__(self) -> str:
        return f"Action({self})"

    @staticmethod
    def parse(text: str) -> Action:
        match = _ACTION_RE.match(text)
        if not match:
            raise ScheduleError(
                f"cannot parse action {text!r}: expected STAGE KIND MICROBATCH such as '2F0', '0B3', '1W3' "
                f"or '0BW2' (kinds: {', '.join(_BY_CODE)})"
            )
        stage, code, microbatch = match.groups()
        return Action(_BY_CODE[code], int(stage), int(microbatch))


class Overlap(NamedTuple):
    """A composite step: its sub-actions run overlapped on one rank (DualPipe's F&B pair, torch's
    `OVERLAP_F_B`). Prints and parses as `(2F3;1B1)`; in torch's CSV it is `(2F3;1I1)OVERLAP_F_B`.

    Generators emit flat schedules; composites appear only when asked for (`Schedule.from_text` of text that
    holds one, `from_torch_csv(keep_overlap=True)`). Everything that times or checks a schedule works on
    `Schedule.flatten()`, where an Overlap becomes its sub-actions in order, run back to back on the rank.
    A lowering must flatten (or fuse the sub-actions) itself: an Overlap does not unpack as (kind, stage, mb).
    """

    actions: tuple[Action, ...]

    def __str__(self) -> str:
        return "(" + ";".join(map(str, self.actions)) + ")"

    def __repr__(self) -> str:
        return f"Overlap({self})"

    @staticmethod
    def parse(text: str) -> Overlap:
        inner = text.strip()
        if not (inner.startswith("(") and inner.endswith(")")):
            raise ScheduleError(f"cannot parse overlapped step {text!r}: expected '(A;B)' such as '(2F3;1B1)'")
        return Overlap.of(tuple(Action.parse(part) for part in inner[1:-1].split(";")))

    @staticmethod
    def of(actions: Sequence[Action]) -> Overlap:
        """An Overlap of two or more plain actions; raises ScheduleError otherwise."""
        actions = tuple(actions)
        if len(actions) < 2 or not all(isinstance(a, Action) for a in actions):
            raise ScheduleError(f"an overlapped step needs two or more plain actions, got "
                                f"{', '.join(map(str, actions)) or 'none'}")
        return Overlap(actions)


def parse_step(text: str) -> Action | Overlap:
    """`2F0` -> Action, `(2F3;1B1)` -> Overlap."""
    return Overlap.parse(text) if text.strip().startswith("(") else Action.parse(text)


def _expand(row: Iterable[Action | Overlap]) -> Iterable[Action]:
    for a in row:
        if type(a) is Overlap:
            yield from a.actions
        else:
            yield a
