"""Vocabulary parallelism for any schedule: insert every rank's S, T, IF and IB passes by simulated time.

    schedule (no sharded actions), costs  ->  insert_vocab  ->  "{name}+vocab"

Vocabulary parallelism (Yeung et al., MLSys 2025) shards the input embedding and the output layer (LM head
and cross-entropy) over all p ranks. Per microbatch k every rank r runs four sharded passes, each joining a
collective over all ranks (so every rank runs them in the same order):

    rIFk  its share of the input embedding; summed onto the first stage, whose F of k needs every IF of k
    rSk   the output layer forward on its shard, after the last stage's F of k (its output is broadcast)
    rTk   the shard's backward, after every S of k; the last stage's B of k needs every T of k
    rIBk  the embedding shard's backward, after the first stage's input gradient of k (broadcast)

The insertion is the paper's generic, timing-based method (its V-Half branch): time the schedule, give each
vocabulary pass one global time from the times of the passes it hangs off, and merge it into every rank's
list at that time, so the sharded sequence is the same on every rank and the base order is kept:

    S_k  in [end of the last stage's F_k, start of its B_k]      (the window its inputs allow)
    T_k  in [S_k, start of the last stage's B_k]
    IF_k some F lengths ahead of the first stage's F_k
    IB_k right after the first stage's input gradient of k

Any times inside these windows give a deadlock-free order: every dependency then runs from an earlier time
to a later one, and every rank's list is sorted by time. The pass tries a few placements inside the windows
(`_CANDIDATES`), some re-timed (the inserted passes move the base ones) and some merged by list scheduling
in time instead (`_interleave`), and keeps the shortest simulated makespan under the given costs, then the
least peak memory.

Extra warm-up. In 1F1B the last stage runs its B_k right after its F_k, so every rank's S_k and T_k, with
their collectives, sit on the critical path between them. The paper's 1F1B therefore runs one more warm-up
forward per rank (p - r instead of p - r - 1), so the last stage has F_{k+1} to run meanwhile. Here that is
`with_extra_warmup`, a general reordering of any schedule; `insert_vocab` tries 0, 1 and 2 extra warm-ups and
keeps what simulates best (1F1B and interleaved 1F1B gain 10-15%; the zero-bubble and V schedules keep their
order unless a hop cost makes the collectives slow).
"""

from __future__ import annotations

from typing import Iterable, Sequence

from zbcompile.errors import ScheduleError
from zbcompile.ir.schedule import KIND_SPECS, Action, Kind, Schedule
from zbcompile.ir.schedule_problem import ScheduleProblem
from zbcompile.ir.costs import Costs, MemoryModel

from ._interleave import interleave

__all__ = ["insert_vocab", "with_extra_warmup", "vocab_costs", "INPUT_SHARE"]

# The input embedding is a gather: its forward and backward per shard are a small fraction of an F.
INPUT_SHARE = 0.02

_ORDER = {Kind.IF: 0, Kind.S: 1, Kind.T: 2, Kind.IB: 3}  # ties at one time: the order of a microbatch's passes
_BEFORE, _BASE, _AFTER = -1, 0, 1  # at equal times: before the base pass that starts then, or after it


def vocab_costs(pp: int, output_layer: float, costs: Costs = Costs()) -> Costs:
    """`costs` with the per-shard times of an output layer whose F + B + W takes `output_layer` (in the units
    of `costs`) when it runs whole on one rank: each of the `pp` shards does 1/pp of it, S the forward third
    and T the rest (its weight gradient and its share of the input gradient); IF and IB, the input
    embedding's gather and scatter, cost `INPUT_SHARE` of an F each."""
    if pp < 1 or not output_layer >= 0:
        raise ScheduleError(f"vocab_costs needs pp >= 1 and a non-negative output layer time; got pp={pp}, "
                            f"output_layer={output_layer}")
    share = output_layer / pp
    return Costs(costs.f, costs.b, costs.w, costs.comm, costs.per_stage, s=share / 3, t=2 * share / 3,
                 i=INPUT_SHARE * costs.f)


def insert_vocab(schedule: Schedule, costs: Costs | None = None, memory: MemoryModel = MemoryModel(), *,
                 extra_warmup: int | None = None) -> Schedule:
    """`schedule` with S, T, IF and IB for every microbatch on every rank, placed by simulated time (see the
    module docstring); named f"{schedule.name}+vocab". Validated and checked for deadlocks.

    costs         the base passes' times plus the per-shard s, t, i (`vocab_costs` makes them from the output
                  layer's time). None means unit F, B, W. Without s, t, i (all 0) the output layer is taken
                  to cost one 1F1B stage's F + B + W, split as `vocab_costs` does: e.g. a 4-block stage of a
                  model whose output layer is 4-5 blocks' work (Gemma-2-9B-like).
    memory        breaks makespan ties by peak memory (its `vocab` counts what an S holds until its T).
    extra_warmup  forwards each rank runs ahead of its backwards beyond the base order (`with_extra_warmup`).
                  None: 0, 1 or 2, whichever simulates shortest (then with the least memory); each costs
                  one microbatch of activations per rank and gives the collectives time to complete.
                  0 keeps the base order.

    Raises ScheduleError if `schedule` already holds sharded actions, or if `extra_warmup` deadlocks.
    """
    base = schedule.flatten()
    if base.vocab_shards:
        raise ScheduleError(f"schedule {schedule.name!r} already holds vocabulary-parallel actions "
                            f"(S, T, IF, IB); insert_vocab takes a schedule without them")
    costs = costs or Costs()
    if not (costs.s or costs.t or costs.i):
        costs = vocab_costs(base.num_ranks, costs.f + costs.b + costs.w, costs)
    search = _Search(base, costs, memory)
    if extra_warmup is None:
        variants = [v for v in (search.orders(with_extra_warmup(base, n)) for n in _WARMUPS) if v is not None]
    else:
        variants = [search.orders(with_extra_warmup(base, extra_warmup).check_order())]
    # the warm-up is chosen with the first candidate alone; the others then refine the chosen order
    found = search.best(variants[0], _CANDIDATES[:1])
    for variant in variants[1:]:
        more = search.best(variant, _CANDIDATES[:1])
        if more[0][0] < found[0][0] * (1 - _WARMUP_GAIN):
            found = more
    orders = min([found, search.best(found[1], _CANDIDATES[1:])], key=lambda x: x[0])[2]
    ranks = tuple(tuple(map(search.codes.action, row)) for row in orders)
    return Schedule(f"{schedule.name}+vocab", base.num_microbatches, base.placement, ranks,
                    base.pipelines).validate().check_order()


def with_extra_warmup(schedule: Schedule, extra: int = 1) -> Schedule:
    """`schedule` with every rank running `extra` more forwards before its backwards: each F that follows a
    run of other passes on its rank moves ahead of that run, `extra` times over. For 1F1B this gives the
    vocabulary-parallel paper's p - r warm-up forwards (p - r + 1 for extra=2) instead of p - r - 1.

    Each extra warm-up holds one more microbatch's activations on every rank. The result may deadlock (see
    `check_order`); `insert_vocab` skips such variants."""
    if extra < 0:
        raise ScheduleError(f"extra_warmup must be 0 or more forwards, got {extra}")
    rows = schedule.flatten().ranks
    for _ in range(extra):
        rows = tuple(_forwards_ahead(row) for row in rows)
    return Schedule(schedule.name, schedule.num_microbatches, schedule.placement, rows, schedule.pipelines)


def _forwards_ahead(row: Sequence[Action]) -> tuple[Action, ...]:
    out: list[Action] = []
    run: list[Action] = []  # the other passes since the last F
    for a in row:
        if a.kind is Kind.F:
            out.append(a)
            out += run
            run = []
        else:
            run.append(a)
    return tuple(out + run)


# ---- the search over placements ------------------------------------------------------------------------
# Each candidate: (where S sits in its window, where T sits in its window, how many F lengths IF runs ahead
# of its F), how often the placement is re-timed (placed again from the times of its own simulation), and how
# each rank's list is merged: by the placement's times (None), or by list scheduling in time with the
# vocabulary passes first unless the base pass would wait (`interleave`, with that wait). Chosen on every
# hand-made schedule at p = 2, 3, 4, 8, m = p, 2p, 3p, output layer 1 and 4.6 blocks: together each time
# within 0.3% of the best simulated makespan of 108 such candidates.
_CANDIDATES: tuple[tuple[tuple[float, float, float], int, float | None], ...] = (
    ((0.0, 0.5, 1.0), 0, None),
    ((0.0, 0.0, 1.0), 2, 0.5),
    ((0.5, 1.0, 1.0), 0, 0.0),
    ((0.0, 0.0, 3.0), 1, 0.5),
    ((0.0, 1.0, 0.0), 0, None),
)
_WARMUPS = (0, 1, 2)
_WARMUP_GAIN = 0.01  # an extra warm-up (a microbatch of activations on every rank) must save 1% of the makespan


Orders = list[list[int]]  # per rank, action codes (`ScheduleProblem`)


class _Search:
    """Places the vocabulary passes into per-rank orders of the base passes and scores the result under
    `costs`: shortest makespan, then least peak memory. Works on action codes: every reordering of the base
    holds the same actions, so one `ScheduleProblem` times them all."""

    def __init__(self, base: Schedule, costs: Costs, memory: MemoryModel):
        self.costs, timing = costs, _timing_costs(costs)
        vocab = [[Action(kind, r, k) for k in range(base.num_microbatches) for kind in _ORDER]
                 for r in range(base.num_ranks)]
        whole = Schedule(base.name, base.num_microbatches, base.placement,
                         tuple(row + tuple(v) for row, v in zip(base.ranks, vocab)), base.pipelines)
        self.problem = ScheduleProblem.of_schedule(whole, costs, memory)[0]
        self.timing = self.problem if timing is costs else ScheduleProblem.of_schedule(whole, timing, memory)[0]
        self.alone = ScheduleProblem.of_schedule(base, timing, memory)[0]  # the base without vocabulary deps
        self.codes, self.f = self.problem.codes, timing.f
        self.hooks = [tuple(map(self.codes.of, (
            Action(Kind.F, base.first_of(k), k), base.backward_of(base.first_of(k), k),
            Action(Kind.F, base.last_of(k), k), base.backward_of(base.last_of(k), k))))
            for k in range(base.num_microbatches)]

    def orders(self, schedule: Schedule) -> Orders | None:
        """`schedule`'s per-rank codes, or None when it deadlocks."""
        orders = [[self.codes.of(a) for a in row] for row in schedule.ranks]
        done = self.alone.list_schedule(orders)[2]
        return orders if all(d == len(row) for d, row in zip(done, orders)) else None

    def best(self, base: Orders, candidates: Iterable) -> tuple[tuple[float, float], Orders, Orders]:
        """(score, base, placed orders) of the best of `candidates` on `base` (the first of equals)."""
        return min((self.score(base, *c) for c in candidates), key=lambda x: x[0])

    def score(self, base: Orders, policy: tuple[float, float, float], retimes: int,
              wait: float | None) -> tuple[tuple[float, float], Orders, Orders]:
        start, end, _ = self.alone.list_schedule(base)
        placed = self.place(base, policy, start, end)
        for _ in range(retimes):
            start, end, _ = self.timing.list_schedule(placed)
            placed = self.place(base, policy, start, end)
        if wait is not None:
            sharded = [[c for c in row if KIND_SPECS[self.codes.kind(c)].sharded] for row in placed]
            placed = interleave(self.problem, base, sharded, wait) or placed
        timing = self.problem.retime(placed)
        if timing is None:  # a placement inside the windows cannot deadlock; scored out all the same
            return (float("inf"), float("inf")), base, placed
        return (round(timing.makespan, 9), round(max(map(self.problem.peak, placed)), 9)), base, placed

    def place(self, base: Orders, policy: tuple[float, float, float], start: Sequence[float],
              end: Sequence[float]) -> Orders:
        """`base` with every vocabulary pass at its policy's time in its window, by the base passes' times."""
        s_at, t_at, lead = policy
        keyed = []
        for k, (first_f, first_b, last_f, last_b) in enumerate(self.hooks):
            s_lo, s_hi = end[last_f], start[last_b]
            keyed += [((start[first_f] - lead * self.f, _BEFORE), Kind.IF, k),
                      ((_within(s_lo, s_hi, s_at), _BEFORE), Kind.S, k),
                      ((_within(s_lo, s_hi, t_at), _BEFORE), Kind.T, k),
                      ((end[first_b], _AFTER), Kind.IB, k)]
        keyed.sort(key=lambda x: (x[0], _ORDER[x[1]], x[2]))
        code = self.codes.code
        return [_merge(row, [(key, code(kind, r, k)) for key, kind, k in keyed], start)
                for r, row in enumerate(base)]


def _within(lo: float, hi: float, share: float) -> float:
    """The point `share` of the way from lo to hi, never outside them (float rounding would break the order)."""
    return min(hi, max(lo, lo + share * (hi - lo)))


def _merge(row: Sequence[int], vocab: Sequence[tuple[tuple[float, int], int]], start: Sequence[float]) -> list[int]:
    """The rank's base passes in their order, each vocabulary pass before the first base pass that starts at
    or after its time (a rank's base passes start at increasing times, so the result is sorted by time)."""
    out: list[int] = []
    j = 0
    for c in row:
        here = (start[c], _BASE)
        while j < len(vocab) and vocab[j][0] < here:
            out.append(vocab[j][1])
            j += 1
        out.append(c)
    out.extend(v for _, v in vocab[j:])
    return out


def _timing_costs(costs: Costs) -> Costs:
    """The costs placements are timed under. A placement needs every base pass to take some time (a
    dependency must start strictly before what depends on it), so zero base times become unit ones."""
    times: Iterable[float] = [costs.f, costs.b, costs.w] + [x for row in costs.per_stage or () for x in row]
    return costs if min(times) > 0 else Costs(comm=costs.comm, s=costs.s, t=costs.t, i=costs.i)
