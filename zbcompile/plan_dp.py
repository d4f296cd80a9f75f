"""`zbcompile plan --dp-comm T`: what the gradient reductions over data-parallel replicas cost a schedule.

    schedule, costs, T, pieces  ->  dp_rows  ->  step time with no reduction / at the end / placed / in groups

T is the time to all-reduce one 1F1B stage's gradients (one rank's share of the model), in the unit of `Costs`;
a model stage of a schedule with S stages over p ranks holds p/S of it. Each rank reduces on one stream of its
own, one reduction after another, beside its compute (passes/lower/dp_reduce.py does the same in the programs):

    end       every reduction posted after the rank's last action (a step that does not overlap them)
    placed    each stage's reduction posted when its last W (or B / BW) ends
    groups    the rank's trailing W's split into `pieces` groups of the stage's gradients, stage by stage
              (finish_grads_in_groups): group g of a stage whose trailing W's run from t0 to t1 is ready at
              t0 + (g + 1) (t1 - t0) / pieces and takes T_stage / pieces

A step ends when every rank's compute and reductions have; `hidden` is the share of the end version's extra
time that a placement saves.
"""

from __future__ import annotations

from dataclasses import dataclass

from tabulate import tabulate

from zbcompile.ir.schedule import Kind, Schedule
from zbcompile.simulate import Costs, SimResult, simulate

__all__ = ["DPRow", "dp_row", "dp_table", "regroup_trailing_ws", "trailing_ws"]


@dataclass(frozen=True)
class DPRow:
    name: str
    no_dp: float
    end: float
    placed: float
    groups: float

    def to_json(self) -> dict:
        return dict(self.__dict__)

    def hidden(self, placed: float) -> float | None:
        extra = self.end - self.no_dp
        return None if extra <= 0 else 1 - max(placed - self.no_dp, 0.0) / extra


def trailing_ws(row) -> int:
    """Where the rank's trailing run of W's starts (len(row) where it ends in another action)."""
    k = len(row)
    while k and row[k - 1].kind is Kind.W:
        k -= 1
    return k


def regroup_trailing_ws(schedule: Schedule) -> Schedule:
    """Each rank's trailing W's ordered stage by stage (finish_grads_in_groups' order; stages in order of their
    first trailing W)."""
    ranks = []
    for row in schedule.flatten().ranks:
        start = trailing_ws(row)
        stages = list(dict.fromkeys(a.stage for a in row[start:]))
        ranks.append(tuple(row[:start]) + tuple(a for s in stages for a in row[start:] if a.stage == s))
    return Schedule(schedule.name, schedule.num_microbatches, schedule.placement, tuple(ranks),
                    schedule.pipelines)


def dp_row(schedule: Schedule, costs: Costs, comm: float, pieces: int = 4) -> DPRow:
    """The step's makespan under the three placements of `comm` per 1F1B stage (see the module docstring)."""
    base = simulate(schedule, costs)
    per_stage = comm * schedule.num_ranks / schedule.num_model_stages
    end = placed = 0.0
    for row in base.schedule.ranks:
        last = max(base.end[a] for a in row) if row else 0.0
        stages = sorted({a.stage for a in row})
        end = max(end, last + per_stage * len(stages))
        ready = sorted(_last_backward(base, row, s) for s in stages)
        placed = max(placed, last, _stream(((t, per_stage) for t in ready)))
    regrouped = simulate(regroup_trailing_ws(schedule), costs)
    groups = 0.0
    for row in regrouped.schedule.ranks:
        last = max(regrouped.end[a] for a in row) if row else 0.0
        jobs = []
        for s in sorted({a.stage for a in row}):
            tail = _trailing_span(regrouped, row, s)
            if tail is None:   # no trailing W: the whole stage when its last backward ends
                jobs.append((_last_backward(regrouped, row, s), per_stage))
                continue
            t0, t1 = tail
            jobs += [(t0 + (g + 1) * (t1 - t0) / pieces, per_stage / pieces) for g in range(pieces)]
        groups = max(groups, last, _stream(sorted(jobs)))
    return DPRow(schedule.name, base.makespan, end, placed, groups)


def _last_backward(result: SimResult, row, stage: int) -> float:
    """When the rank's last backward action (B, W or BW) of `stage` ends: its gradients are final then."""
    return max(result.end[a] for a in row if a.stage == stage and a.kind is not Kind.F)


def _trailing_span(result: SimResult, row, stage: int) -> tuple[float, float] | None:
    """(start, end) of stage's trailing W's, or None if it has none."""
    tail = [a for a in row[trailing_ws(row):] if a.stage == stage]
    if not tail:
        return None
    return min(result.start[a] for a in tail), max(result.end[a] for a in tail)


def _stream(jobs) -> float:
    """When one stream that runs (ready time, duration) jobs in order, each not before it is ready, is done."""
    t = 0.0
    for ready, took in jobs:
        t = max(t, ready) + took
    return t


def dp_table(rows: list[DPRow], comm: float, pieces: int) -> str:
    """The comparison `plan --dp-comm` prints."""
    def pct(v: float | None) -> str:
        return "-" if v is None else f"{100 * v:.0f}%"
    body = [[r.name, f"{r.no_dp:.2f}", f"{r.end:.2f}", f"{r.placed:.2f}", pct(r.hidden(r.placed)),
             f"{r.groups:.2f}", pct(r.hidden(r.groups))] for r in rows]
    return (f"data-parallel all-reduce: {comm:g} per 1F1B stage's gradients, W's in {pieces} groups\n"
            + tabulate(body, headers=["schedule", "no dp", "at the end", "placed", "hidden", "placed, W groups",
                                      "hidden"]))
