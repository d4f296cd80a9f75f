"""V-placement generators against the authors' unit-cost reference numbers (zero_bubble.md §9.2)."""

from __future__ import annotations

import pytest

from zbcompile.errors import ScheduleError
from zbcompile.passes.schedules import generate
from zbcompile.passes.schedules import v_blocks
from zbcompile.passes.schedules.v_blocks import reorder_schedule
from zbcompile.simulate import Costs, simulate

UNIT = Costs(1, 1, 1, 0)

# (p, m) -> the authors' V-Half bubble rate at peak (p+2)//2 (their greedy and building-block searcher agree)
V_HALF_REFERENCE = {
    (4, 8): 0.0943, (4, 12): 0.0649, (8, 8): 0.2615, (8, 16): 0.1504, (8, 24): 0.1056, (8, 32): 0.0813,
    (8, 64): 0.0424, (16, 32): 0.1760, (16, 48): 0.1246, (16, 64): 0.0965, (32, 96): 0.1338,
}
# the same rates from the bubble-vs-peak formula: 3p-7 idle chunk slots per rank for even p, work 6m
V_HALF_EXACT = {(4, 12): 5 / 77, (8, 16): 17 / 113, (8, 24): 17 / 161, (8, 32): 17 / 209, (16, 48): 41 / 329}


def _sim(name: str, p: int, m: int):
    s = generate(name, p, m)
    s.validate().check_order()
    return simulate(s, UNIT)


@pytest.mark.parametrize(("p", "m"), sorted(V_HALF_EXACT))
def test_v_half_matches_reference_bubble_at_half_memory(p: int, m: int) -> None:
    r = _sim("v-half", p, m)
    assert r.bubble_rate <= V_HALF_EXACT[p, m] + 1e-9
    assert max(r.peak_memory) == (p + 2) // 2


@pytest.mark.parametrize(("p", "m"), sorted(V_HALF_REFERENCE))
def test_v_half_table(p: int, m: int) -> None:
    r = _sim("v-half", p, m)
    assert r.bubble_rate <= V_HALF_REFERENCE[p, m] + 5e-5  # the table is rounded to 0.01%
    assert max(r.peak_memory) == (p + 2) // 2


def test_v_half_small_m_beats_reference() -> None:
    assert _sim("v-half", 4, 4).bubble_rate < 0.2941


@pytest.mark.parametrize("p", range(2, 12))
def test_v_half_valid_and_within_budget(p: int) -> None:
    for m in sorted({1, 2, 3, p - 1, p, p + 1, 2 * p - 1, 2 * p, 2 * p + 1, 3 * p + 2}):
        if m < 1:
            continue
        r = _sim("v-half", p, m)
        assert max(r.peak_memory) <= (p + 2) // 2, (p, m)
        if m >= 2 * p:
            assert max(r.peak_memory) == (p + 2) // 2, (p, m)
        assert r.bubble_rate < _sim("1f1b", p, m).bubble_rate + 1e-12, (p, m)


@pytest.mark.parametrize(("p", "m", "ref"), [(4, 4, 0.1111), (8, 8, 0.1273)])
def test_zbv_small_m_matches_greedy_reference(p: int, m: int, ref: float) -> None:
    for name in ("zbv", "v-zb"):
        r = _sim(name, p, m)
        assert r.bubble_rate <= ref + 5e-5, name
        assert max(r.peak_memory) <= p, name


@pytest.mark.parametrize("p", (2, 3, 4, 5, 8))
def test_zbv_keeps_peak_and_zero_bubble(p: int) -> None:
    for m in range(1, 3 * p + 1):
        r = _sim("zbv", p, m)
        assert max(r.peak_memory) <= p
        if m >= 2 * p:
            assert r.bubble_rate == pytest.approx(0, abs=1e-12)
            assert max(r.peak_memory) == p


def test_strict_reorder_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """If the refill after the occupied-slots-only memory check finds no W to run, the strict pass is used."""
    real = v_blocks._fill_w
    calls = []

    def first_fails(*args):
        calls.append(1)
        return None if len(calls) == 1 else real(*args)

    monkeypatch.setattr(v_blocks, "_fill_w", first_fails)
    for p, m in ((4, 12), (8, 24), (5, 11)):
        calls.clear()
        r = _sim("v-half", p, m)
        assert len(calls) == 2
        assert max(r.peak_memory) <= (p + 2) // 2


def test_reorder_schedule_rejects_what_it_cannot_take() -> None:
    with pytest.raises(ScheduleError):
        reorder_schedule(generate("zb-h1", 4, 8), budget=8)
    with pytest.raises(ScheduleError):
        reorder_schedule(generate("zbv", 4, 8), budget=4)  # already above the budget
    with pytest.raises(ScheduleError):
        reorder_schedule(generate("dualpipev", 4, 8), budget=8)  # B and W fused on some steps
