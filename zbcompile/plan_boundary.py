"""`zbcompile plan --step-boundary OPT`: what the synchronization before the optimizer step costs a schedule,
and what post-validation (the Zero Bubble paper's optimizer step without it) would win back.

    schedule, costs, OPT, latency  ->  boundary_row  ->  steady-state time per iteration, synchronous / post-validated

Consecutive iterations of `schedule` are list-scheduled one after another (`simulate(..., rank_start=)`), each
rank starting the next iteration when its optimizer step is done:

    synchronous     every rank waits for the last rank's last action and one all-reduce of the norm and the
                    inf flag (`latency`), then steps (OPT): the next iteration starts everywhere at once
    post-validated  the partial norm and inf flag travel from rank 0 to rank p-1, each rank adding its own
                    when its last action is done (one `latency` per hop); a rank steps optimistically as soon as
                    it has its prefix, and starts the next iteration's warm-up; the full values travel back
                    during that warm-up, off the critical path when no step is rolled back

The chain runs in the direction of the warm-up: rank 0, whose forwards start the next iteration, waits for
nobody, and rank r's first forward needs rank r-1's anyway. A rollback (a clipped or skipped step found late)
costs the optimizer step again and the forwards redone; `plan` counts the common case, none.
"""

from __future__ import annotations

from dataclasses import dataclass

from tabulate import tabulate

from zbcompile.ir.schedule import Schedule
from zbcompile.simulate import Costs, simulate

__all__ = ["BoundaryRow", "boundary_row", "boundary_table"]


@dataclass(frozen=True)
class BoundaryRow:
    name: str
    makespan: float        # one iteration alone
    synchronous: float     # steady-state time per iteration
    post_validated: float

    def to_json(self) -> dict:
        return dict(self.__dict__, gain=self.gain)

    @property
    def gain(self) -> float:
        """The share of the synchronous iteration time post-validation saves."""
        return 1 - self.post_validated / self.synchronous if self.synchronous > 0 else 0.0


def boundary_row(schedule: Schedule, costs: Costs, opt: float, latency: float = 0.0,
                 iterations: int = 4) -> BoundaryRow:
    """Steady-state time per iteration of `schedule` with an optimizer step of `opt` under both boundaries: the
    last of `iterations` consecutive iterations, from the end of the one before it on the rank that ends last."""
    sync = _iterate(schedule, costs, iterations, lambda last: [max(last) + latency + opt] * len(last))
    post = _iterate(schedule, costs, iterations, lambda last: [t + opt for t in _prefix(last, latency)])
    return BoundaryRow(schedule.name, simulate(schedule, costs).makespan, sync, post)


def _prefix(last: list[float], latency: float) -> list[float]:
    """When each rank holds the prefix of the partial norms (ranks 0..r): its own last action and rank r-1's
    prefix, one hop later."""
    out: list[float] = []
    for t in last:
        out.append(t if not out else max(t, out[-1] + latency))
    return out


def _iterate(schedule: Schedule, costs: Costs, iterations: int, boundary) -> float:
    """Time per iteration in steady state: the ends of the last two iterations on their last-ending rank, apart."""
    start = [0.0] * schedule.num_ranks
    ends = []
    for _ in range(max(iterations, 2)):
        result = simulate(schedule, costs, rank_start=start)
        last = [max((result.end[a] for a in row), default=s) for row, s in zip(result.schedule.ranks, start)]
        ends.append(max(last))
        start = boundary(last)
    return ends[-1] - ends[-2]


def boundary_table(rows: list[BoundaryRow], opt: float, latency: float) -> str:
    """The comparison `plan --step-boundary` prints."""
    body = [[r.name, f"{r.makespan:.2f}", f"{r.synchronous:.2f}", f"{r.post_validated:.2f}", f"{100 * r.gain:.1f}%"]
            for r in rows]
    return (f"optimizer step {opt:g}, norm / inf message latency {latency:g} (per hop; one all-reduce when "
            "synchronous)\n" + tabulate(body, headers=["schedule", "one iteration", "synchronous, per iteration",
                                                      "post-validated, per iteration", "gain"]))
