"""Composite steps (`Overlap`): text round trip, flattening, and how checks and the simulator treat them."""

from __future__ import annotations

import pytest

from zbcompile.errors import ScheduleError
from zbcompile.passes.schedules import generate
from zbcompile.ir.schedule import Action, Kind, Overlap, Schedule, parse_step
from zbcompile.simulate import simulate


def _overlapped(schedule: Schedule, rank: int, i: int) -> Schedule:
    """`schedule` with steps i and i+1 of `rank` fused into one Overlap."""
    rows = [list(row) for row in schedule.ranks]
    rows[rank][i:i + 2] = [Overlap.of(rows[rank][i:i + 2])]
    return Schedule(schedule.name, schedule.num_microbatches, schedule.placement, tuple(map(tuple, rows)),
                    schedule.pipelines)


def test_parse_and_print() -> None:
    step = parse_step(" (2F3;1B1) ")
    assert step == Overlap((Action(Kind.F, 2, 3), Action(Kind.B, 1, 1))) and str(step) == "(2F3;1B1)"
    assert parse_step("0BW2") == Action(Kind.BW, 0, 2)
    with pytest.raises(ScheduleError, match="two or more plain actions"):
        parse_step("(2F3)")
    with pytest.raises(ScheduleError, match="cannot parse action"):
        parse_step("(2F3;1X1)")


def test_text_round_trip_flatten_and_checks() -> None:
    flat = generate("dualpipev", 2, 4)
    row = flat.ranks[0]
    i = next(k for k in range(len(row) - 1) if row[k].kind is Kind.F and row[k + 1].kind is not Kind.F)
    kept = _overlapped(flat, 0, i)
    assert kept.has_overlaps and kept.flatten() == flat and flat.flatten() is flat
    assert Schedule.from_text(kept.to_text()) == kept
    assert kept.validate() is kept and kept.check_order() is kept
    result = simulate(kept)  # sub-actions back to back: the same timing as the flat form
    assert result.schedule == flat and result.makespan == simulate(flat).makespan


def test_checks_see_inside_overlaps() -> None:
    flat = generate("zb-h1", 2, 2)
    broken = _overlapped(flat, 0, 0)
    rows = [list(r) for r in broken.ranks]
    rows[0][0] = Overlap.of((Action(Kind.F, 0, 0), Action(Kind.F, 0, 0)))
    with pytest.raises(ScheduleError, match="appears twice"):
        Schedule(flat.name, 2, flat.placement, tuple(map(tuple, rows))).validate()
