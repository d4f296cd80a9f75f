"""The simulator and the timelines, on hand-built schedules whose timings can be worked out by hand."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from fractions import Fraction

import pytest

from support.schedules import acts, one_f_one_b
from zbcompile.errors import ScheduleError, SimulationError
from zbcompile.passes.schedules import generate
from zbcompile.ir.schedule import Schedule, loop_placement, v_placement
from zbcompile.simulate import Costs, MemoryModel, simulate
from zbcompile.timeline import ascii_timeline, svg_timeline


def small_v() -> Schedule:
    """p=2, one microbatch down and back up a V: stages 0,3 on rank 0 and 1,2 on rank 1."""
    ranks = (acts("0F0 3F0 3B0 0B0 3W0 0W0"), acts("1F0 2F0 2B0 1B0 2W0 1W0"))
    return Schedule("v", 1, v_placement(2), ranks).validate()


# ---- timing --------------------------------------------------------------------------------------
@pytest.mark.parametrize("p,m", [(2, 1), (4, 1), (4, 4), (4, 8), (8, 3), (8, 24)])
def test_1f1b_unit_costs_bubble_is_the_closed_form(p: int, m: int) -> None:
    result = simulate(one_f_one_b(p, m))
    expected = Fraction(p - 1, m + p - 1)
    assert Fraction(result.bubble_rate).limit_denominator(10_000) == expected
    assert result.makespan == 3 * (m + p - 1)  # (m + p - 1) slots of F + BW
    assert result.busy == (3.0 * m,) * p


def test_comm_delays_cross_rank_hops_only() -> None:
    result = simulate(one_f_one_b(2, 1), Costs(comm=0.5))
    times = {str(a): (result.start[a], result.end[a]) for a in result.start}
    assert times == {"0F0": (0, 1), "1F0": (1.5, 2.5), "1BW0": (2.5, 4.5), "0BW0": (5, 7)}
    assert result.makespan == 7
    assert result.span == (7, 3)
    assert result.bubble_rate == pytest.approx(1 - 3 / 7)
    assert result.bubble_share == pytest.approx(1 - 6 / 14)


def test_per_stage_costs_override_and_bw_is_b_plus_w() -> None:
    result = simulate(one_f_one_b(2, 1), Costs(per_stage=((1, 2, 3), (4, 5, 6))))
    times = {str(a): (result.start[a], result.end[a]) for a in result.start}
    assert times == {"0F0": (0, 1), "1F0": (1, 5), "1BW0": (5, 16), "0BW0": (16, 21)}


def test_per_stage_costs_must_match_the_model_stages() -> None:
    with pytest.raises(ScheduleError, match="3 per-stage triples .* 2 model stages"):
        simulate(one_f_one_b(2, 1), Costs(per_stage=((1, 1, 1),) * 3))


def test_v_chunks_cost_half_and_hold_half() -> None:
    result = simulate(small_v())
    times = {str(a): (result.start[a], result.end[a]) for a in result.start}
    assert times["0F0"] == (0, 0.5) and times["3F0"] == (1.5, 2.0)
    assert times["0B0"] == (3.5, 4.0) and times["0W0"] == (4.5, 5.0)
    assert result.makespan == 5
    assert result.busy == (3.0, 3.0)
    assert result.peak_memory == (1.0, 1.0)


def test_memory_peaks_and_bytes() -> None:
    # rank 0 of 1F1B (p=4) holds 4 microbatches before its first backward
    assert simulate(one_f_one_b(4, 8)).peak_memory == (4, 3, 2, 1)
    split = one_f_one_b(2, 3, split=True)  # rank 0: F0 F1 B0 W0 F2 B1 W1 B2 W2
    assert simulate(split).peak_memory == (2, 1)
    half = simulate(split, memory=MemoryModel(b_frees=0.5, bytes_per_microbatch=1000))
    assert half.peak_memory == (2, 1)  # the peak comes before any backward
    assert half.peak_bytes == (2000, 1000)
    late = Schedule("late-w", 2, loop_placement(1), (acts("0F0 0B0 0F1 0B1 0W0 0W1"),)).validate()
    assert simulate(late).peak_memory == (2,)
    assert simulate(late, memory=MemoryModel(b_frees=0.5)).peak_memory == (1.5,)
    assert simulate(late).peak_bytes is None


def test_large_schedule_simulates() -> None:
    schedule = one_f_one_b(32, 256, split=True)
    assert sum(len(r) for r in schedule.ranks) == 32 * 256 * 3
    result = simulate(schedule, Costs(f=1, b=1.1, w=0.6, comm=0.05))
    assert result.makespan >= 256 * 2.7


# ---- errors --------------------------------------------------------------------------------------
def test_deadlock_raises_with_the_grid() -> None:
    ranks = (acts("0F0 0BW0 0F1 0BW1"), acts("1F1 1BW1 1F0 1BW0"))
    schedule = Schedule("crossed", 2, loop_placement(2), ranks).validate()
    with pytest.raises(SimulationError) as info:
        simulate(schedule)
    text = str(info.value)
    assert "deadlocks" in text
    assert "rank 0 waits at 0BW0 for 1BW0" in text and "rank 1 waits at 1F1 for 0F1" in text
    assert "[0BW0]" in text and "[1F1]" in text and "rank  1" in text


def test_w_before_its_b_on_the_same_rank_deadlocks() -> None:
    schedule = Schedule("w-first", 1, (0,), (acts("0F0 0W0 0B0"),))
    with pytest.raises(SimulationError, match=r"waits at 0W0 for 0B0"):
        simulate(schedule)


def test_broken_dependency_names_the_missing_action() -> None:
    ranks = (acts("0F0 0BW0"), acts("1BW0"))  # 1F0 is missing
    schedule = Schedule("broken", 1, loop_placement(2), ranks)
    with pytest.raises(SimulationError) as info:
        simulate(schedule)
    assert "broken dependency: 1BW0 needs 1F0, which no rank runs" in str(info.value)
    assert "[1BW0]" in str(info.value)


def test_duplicate_action_is_reported() -> None:
    schedule = Schedule("dup", 1, (0,), (acts("0F0 0F0 0BW0"),))
    with pytest.raises(SimulationError, match="runs twice"):
        simulate(schedule)


# ---- costs -----------------------------------------------------------------------------------------
def test_costs_parse() -> None:
    assert Costs.parse("F=1,B=1.1,W=0.6,comm=0.05") == Costs(1, 1.1, 0.6, 0.05)
    assert Costs.parse("b=2, COMM=0.5") == Costs(b=2, comm=0.5)
    assert Costs.parse("") == Costs()


@pytest.mark.parametrize("text", ["F=-1", "F=nan", "W=inf", "F=1;B=2", "X=1", "F=", "F", "F=one", "F=1,f=2"])
def test_costs_parse_rejects_bad_input(text: str) -> None:
    with pytest.raises(ScheduleError, match="expected comma-separated KEY=VALUE"):
        Costs.parse(text)


def test_costs_and_memory_reject_bad_values() -> None:
    with pytest.raises(ScheduleError):
        Costs(f=-1)
    with pytest.raises(ScheduleError):
        Costs(per_stage=((1, 2),))
    with pytest.raises(ScheduleError, match="between 0 and 1"):
        MemoryModel(b_frees=1.5)
    with pytest.raises(ScheduleError, match="cost f=None must be a number"):
        Costs(f=None)


def test_simulate_refuses_what_is_not_a_schedule_and_a_bad_rank_start() -> None:
    """Our own error, not an AttributeError, an IndexError, or a makespan of NaN."""
    schedule = one_f_one_b(4, 8)
    with pytest.raises(SimulationError, match="simulate takes a Schedule, got a str"):
        simulate("1f1b")
    for bad in ([0.0, 0.0], [float("nan")] * 4, [0.0, -1.0, 0.0, 0.0], [0, 0, 0, True]):
        with pytest.raises(SimulationError, match="one finite, non-negative start time per rank"):
            simulate(schedule, rank_start=bad)
    late = simulate(schedule, rank_start=[2.5, 0.0, 0.0, 0.0])   # the first rank late: everything waits for it
    assert late.makespan == simulate(schedule).makespan + 2.5


# ---- timelines -------------------------------------------------------------------------------------
def test_ascii_timeline_rows_and_idle() -> None:
    text = ascii_timeline(simulate(one_f_one_b(4, 4)))
    rows = [ln for ln in text.splitlines() if ln.startswith("rank")]
    assert len(rows) == 4
    assert rows[0].startswith("rank  0 |F0 ")
    assert rows[3].split("|")[1].startswith(".")  # the last rank waits for the first forward
    assert "BW3" in rows[0]


def test_ascii_timeline_marks_second_chunk_lower_case() -> None:
    text = ascii_timeline(simulate(small_v()), width=40)
    assert "f0" in text and "F0" in text and "lower case" in text
    assert all(len(ln) == len("rank  0 |") + 40 for ln in text.splitlines() if ln.startswith("rank"))


def test_svg_is_well_formed_with_a_box_per_action() -> None:
    result = simulate(small_v())
    root = ET.fromstring(svg_timeline(result))
    ns = "{http://www.w3.org/2000/svg}"
    assert root.tag == f"{ns}svg"
    boxes = [r for r in root.iter(f"{ns}rect") if r.find(f"{ns}title") is not None]
    assert len(boxes) == 12
    fills = {b.get("fill") for b in boxes}
    assert len(fills) == 6  # F, B, W in two shades (one per chunk)
    texts = [t.text for t in root.iter(f"{ns}text")]
    assert any("2nd chunk" in (t or "") for t in texts) and "rank 1" in texts


# ---- against the published numbers (reference §9.2: unit costs, no comm) -----------------------------
@pytest.mark.parametrize("name,p,m,bubble,peak", [
    ("1f1b", 4, 8, 0.2727, 4), ("zb-h1", 8, 24, 0.0886, 8), ("zbv", 4, 8, 0.0, 4),
    ("interleaved-1f1b", 4, 8, 0.1579, 5.5), ("interleaved-1f1b", 8, 24, 0.1273, 11.5),
])
def test_matches_reference_table(name: str, p: int, m: int, bubble: float, peak: float) -> None:
    result = simulate(generate(name, p, m))
    assert result.bubble_rate == pytest.approx(bubble, abs=5e-5)
    assert max(result.peak_memory) == peak
