"""The schedule as an integer-coded problem: the one place that times orders and counts their memory.

    Schedule + costs + memory model  ->  ScheduleProblem.of_schedule  ->  (problem, per-rank code orders)
    stages, microbatches, stage times ->  ScheduleProblem.chain        ->  problem (generators that build orders)

Every action is an integer code (`ActionCodes`), and per code the problem holds what the kind table
(`zbcompile.ir.schedule.KIND_SPECS`) says about it: the codes it consumes, its time, its memory delta, and the
rank it runs on. The simulator, zb-auto's search, the V builders (`v_blocks`) and the cost-aware polish
(`v_polish`) all time and check their orders here, so they cannot drift apart.

Timing model (list scheduling): each rank runs its order in sequence; an action starts at

    start = max(rank free, max over deps of  dep end + (comm if the dep ran on another rank else 0))

Memory model: a rank's held activations are the running sum of its actions' deltas; the peak is the
largest prefix sum (0 at the start).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence

from zbcompile.errors import ScheduleError
from zbcompile.ir.schedule import COST_KEYS, KIND_SPECS, Action, Kind, Schedule

__all__ = ["ActionCodes", "ScheduleProblem", "Timing", "list_schedule"]

KINDS: tuple[Kind, ...] = tuple(KIND_SPECS)
KIND_INDEX = {kind: i for i, kind in enumerate(KINDS)}
SPLIT_KINDS = (Kind.F, Kind.B, Kind.W)  # what the order-building generators place


@dataclass(frozen=True)
class ActionCodes:
    """The one integer encoding of actions: code = (microbatch * num_stages + stage) * len(KINDS) + kind index.

    Codes grow with (microbatch, stage, kind), so sorting codes sorts actions that way; the kind of a code
    is `code % width` (F=0, B=1, W=2, ... in KIND_SPECS order), the next stage's same action is `code + width`.
    """

    num_stages: int
    num_microbatches: int

    @property
    def width(self) -> int:
        return len(KINDS)

    @property
    def size(self) -> int:
        return self.num_stages * self.num_microbatches * len(KINDS)

    def code(self, kind: Kind, stage: int, microbatch: int) -> int:
        return (microbatch * self.num_stages + stage) * len(KINDS) + KIND_INDEX[kind]

    def of(self, action: Action) -> int:
        kind, stage, microbatch = action
        return (microbatch * self.num_stages + stage) * len(KINDS) + KIND_INDEX[kind]

    def action(self, code: int) -> Action:
        cell, kind = divmod(code, len(KINDS))
        microbatch, stage = divmod(cell, self.num_stages)
        return Action(KINDS[kind], stage, microbatch)

    def kind(self, code: int) -> Kind:
        return KINDS[code % len(KINDS)]


@dataclass(frozen=True)
class Timing:
    """List scheduling of complete orders: per code its start and end, the makespan and the papers' bubble
    rate (the worst rank's 1 - busy/span, busy being the sum of its actions' costs)."""

    start: list[float]
    end: list[float | None]
    makespan: float
    bubble: float

    @property
    def score(self) -> tuple[float, float]:
        return self.makespan, self.bubble


class _Chain:
    """The dependency context of a single pipeline 0..n-1 whose backwards are all split into B and W."""

    def __init__(self, num_stages: int):
        self.num_stages = num_stages

    def is_first(self, stage: int) -> bool:
        return stage == 0

    def is_last(self, stage: int) -> bool:
        return stage == self.num_stages - 1

    def backward_of(self, stage: int, microbatch: int) -> Action:
        return Action(Kind.B, stage, microbatch)

    vocab_shards = 0   # the order-building generators place no vocabulary actions

    def first_of(self, microbatch: int) -> int:
        return 0

    def last_of(self, microbatch: int) -> int:
        return self.num_stages - 1


class _ChainRates(NamedTuple):
    """The memory rates a chain's rules read (a chain has no vocabulary actions)."""

    b_frees: float
    vocab: float = 0.0


@dataclass(frozen=True, eq=False)
class ScheduleProblem:
    """Per code: the codes it consumes (`deps`), its time (`cost`), its memory delta (`delta`) and its rank
    (`rank_of`); plus the cross-rank hop time `comm`. Codes that are not part of the problem have no deps,
    cost 0 and delta 0."""

    codes: ActionCodes
    deps: list[tuple[int, ...]]
    cost: list[float]
    delta: list[float]
    rank_of: list[int]
    comm: float

    # ---- construction -------------------------------------------------------------------------------
    @staticmethod
    def of_schedule(schedule: Schedule, costs: Any, memory: Any,
                    error: Callable[[str], Exception] = ScheduleError) -> tuple[ScheduleProblem, list[list[int]]]:
        """The problem of `schedule` under `costs` (a `zbcompile.simulate.Costs`) and `memory` (a
        `MemoryModel`), and its per-rank orders as codes.

        Raises `error` (with the grid) for an action on a stage that does not exist, a negative microbatch,
        an action that runs twice, or a dependency no rank runs."""
        m = max([schedule.num_microbatches] + [a.microbatch + 1 for row in schedule.ranks for a in row])
        codes = ActionCodes(schedule.num_stages, m)
        orders = _code_orders(schedule, codes, error)
        table = costs.action_costs(schedule)
        deltas = memory.action_deltas(schedule)
        size = codes.size
        deps: list[tuple[int, ...]] = [()] * size
        cost, delta, rank_of = [0.0] * size, [0.0] * size, [0] * size
        present = bytearray(size)
        for row in orders:
            for c in row:
                present[c] = 1
        for r, row in enumerate(orders):
            for i, c in enumerate(row):
                a = schedule.ranks[r][i]
                ids = []
                for d in schedule.deps(a):
                    j = codes.of(d)
                    if not present[j]:
                        raise error(schedule.at(r, i, f"broken dependency: {a} needs {d}, which no rank runs; "
                                                      f"fix: add {d} to rank {schedule.placement[d.stage]}"))
                    ids.append(j)
                deps[c] = tuple(ids)
                cost[c] = table[a.kind, a.stage]
                delta[c] = deltas[a.kind, a.stage]
                rank_of[c] = r
        return ScheduleProblem(codes, deps, cost, delta, rank_of, costs.comm), orders

    @staticmethod
    def chain(num_stages: int, num_microbatches: int, placement: Sequence[int],
              times: Sequence[Sequence[float]], comm: float = 0.0, scale: float = 1.0,
              b_frees: float = 0.0) -> ScheduleProblem:
        """F, B and W of every (stage, microbatch) of one pipeline over `placement`, every backward split:
        the problem the order-building generators (zb-auto, the V builders) fill in.

        `times[s]` is stage s's (f, b, w); memory deltas follow KIND_SPECS with `b_frees` and `scale`."""
        codes = ActionCodes(num_stages, num_microbatches)
        size, width = codes.size, codes.width
        deps: list[tuple[int, ...]] = [()] * size
        cost, delta, rank_of = [0.0] * size, [0.0] * size, [0] * size
        context, rates = _Chain(num_stages), _ChainRates(b_frees)
        for kind in SPLIT_KINDS:
            spec, k = KIND_SPECS[kind], KIND_INDEX[kind]
            change = spec.memory(rates, scale)
            for s in range(num_stages):
                t = dict(zip(COST_KEYS, times[s]))
                took = t[spec.cost[0]]
                for key in spec.cost[1:]:
                    took += t[key]
                base = _shift_invariant_deps(spec.deps, context, codes, s)
                for mb in range(num_microbatches):
                    c = (mb * num_stages + s) * width + k
                    shift = mb * num_stages * width
                    deps[c] = tuple(d + shift for d in base)
                    cost[c], delta[c], rank_of[c] = took, change, placement[s]
        return ScheduleProblem(codes, deps, cost, delta, rank_of, comm)

    # ---- timing ----------------------------------------------------------------------------------------
    def list_schedule(self, orders: Sequence[Sequence[int]], rank_start: Sequence[float] | None = None
                      ) -> tuple[list[float], list[float | None], list[int]]:
        """`list_schedule` over this problem's tables."""
        return list_schedule(orders, self.deps, self.cost, self.rank_of, self.comm, rank_start)

    def retime(self, orders: Sequence[Sequence[int]]) -> Timing | None:
        """Time complete per-rank orders; None when they deadlock."""
        start, end, done = list_schedule(orders, self.deps, self.cost, self.rank_of, self.comm)
        if any(done[r] < len(row) for r, row in enumerate(orders)):
            return None
        cost, bubble = self.cost, 0.0
        for row in orders:
            if row:
                busy = sum(cost[i] for i in row)
                span = end[row[-1]] - start[row[0]]
                if span > 0:
                    bubble = max(bubble, 1.0 - busy / span)
        return Timing(start, end, max((end[row[-1]] for row in orders if row), default=0.0), bubble)

    # ---- memory and same-rank order ----------------------------------------------------------------------
    def peak(self, row: Sequence[int]) -> float:
        """The most a rank running `row` holds at once (0 before its first action)."""
        delta = self.delta
        held = top = 0.0
        for i in row:
            held += delta[i]
            if held > top:
                top = held
        return top

    def fits(self, row: Sequence[int], cap: float) -> bool:
        """Whether a rank running `row` never holds more than `cap`."""
        delta = self.delta
        held = 0.0
        for i in row:
            held += delta[i]
            if held > cap:
                return False
        return True

    def in_rank_order(self, row: Sequence[int]) -> bool:
        """Whether every dependency that runs on the same rank comes earlier in `row` (B after its F, W
        after its B, ...); cross-rank dependencies are the timing's business."""
        deps, rank_of = self.deps, self.rank_of
        seen = set()
        for c in row:
            r = rank_of[c]
            for d in deps[c]:
                if rank_of[d] == r and d not in seen:
                    return False
            seen.add(c)
        return True


def _shift_invariant_deps(rule: Callable, context: _Chain, codes: ActionCodes, stage: int) -> tuple[int, ...]:
    """The codes `rule` gives for (stage, microbatch 0). On a chain every kind's rule is the same for every
    microbatch up to a shift of the codes, which `chain` relies on (it evaluates each rule once per stage);
    checked here on microbatch 1 so that a rule that looks across microbatches cannot slip through."""
    base = tuple(codes.of(d) for d in rule(context, stage, 0))
    if codes.num_microbatches > 1:
        shift = codes.num_stages * codes.width
        if tuple(codes.of(d) for d in rule(context, stage, 1)) != tuple(d + shift for d in base):
            raise ScheduleError(f"ScheduleProblem.chain: a dependency rule for stage {stage} differs between "
                                f"microbatches 0 and 1 beyond the shift; build such problems with of_schedule")
    return base


def _code_orders(schedule: Schedule, codes: ActionCodes, error: Callable[[str], Exception]) -> list[list[int]]:
    seen = bytearray(codes.size)
    orders = []
    for r, row in enumerate(schedule.ranks):
        out = []
        for i, a in enumerate(row):
            if not 0 <= a.stage < schedule.num_stages:
                raise error(schedule.at(r, i, f"stage {a.stage} does not exist "
                                              f"(stages 0..{schedule.num_stages - 1})"))
            if a.microbatch < 0:
                raise error(schedule.at(r, i, f"microbatch {a.microbatch} does not exist (microbatches count "
                                              f"from 0)"))
            c = codes.of(a)
            if seen[c]:
                raise error(schedule.at(r, i, f"{a} runs twice"))
            seen[c] = 1
            out.append(c)
        orders.append(out)
    return orders


def list_schedule(orders: Sequence[Sequence[int]], deps: Sequence[Sequence[int]], cost: Sequence[float],
                  rank_of: Sequence[int], comm: float, rank_start: Sequence[float] | None = None
                  ) -> tuple[list[float], list[float | None], list[int]]:
    """The timing model on integer ids: each rank runs `orders[r]` in order; an action starts when its rank is
    free (from `rank_start[r]` on; default 0) and every dependency has ended (plus `comm` when the dependency
    ran on another rank).

    Returns (start, end, done): per id its start and end (None if it never ran), per rank how many of its
    actions ran; done[r] < len(orders[r]) on some rank means the order deadlocks. The result does not depend
    on the order in which ranks are visited: each start is fixed by the rank's previous action and the deps.
    """
    n = len(cost)
    start = [0.0] * n
    end: list[float | None] = [None] * n
    p = len(orders)
    free = [0.0] * p if rank_start is None else [float(t) for t in rank_start]
    done = [0] * p
    waiting: dict[int, list[int]] = {}
    ready = list(range(p))
    while ready:
        r = ready.pop()
        row = orders[r]
        while done[r] < len(row):
            i = row[done[r]]
            t = free[r]
            blocker = -1
            for d in deps[i]:
                e = end[d]
                if e is None:
                    blocker = d
                    break
                if rank_of[d] != r:
                    e += comm
                if e > t:
                    t = e
            if blocker >= 0:
                waiting.setdefault(blocker, []).append(r)
                break
            start[i] = t
            end[i] = free[r] = t + cost[i]
            done[r] += 1
            ready.extend(waiting.pop(i, ()))
    return start, end, done
