"""The hand-made schedule generators: structure, deadlock freedom, minimums and unit-cost closed forms."""

from __future__ import annotations


import pytest

from zbcompile.errors import ScheduleError
from zbcompile.ir.schedule import Schedule
from zbcompile.passes.schedules import GENERATORS, generate, list_schedules
from zbcompile.simulate import Costs, simulate

HANDMADE = [n for n in GENERATORS if n != "zb-auto"]
PPS = (2, 3, 4, 8)
UNIT = Costs(1, 1, 1, 0)


def _admits(name: str, p: int) -> bool:
    return not (name == "dualpipe" and p % 2)


def _minimum(name: str, p: int) -> int:
    return {"interleaved-1f1b": p, "dualpipe": 2}.get(name, 1)


def _ms(p: int) -> list[int]:
    return sorted({1, 2, p - 1, p, p + 1, 2 * p - 1, 2 * p, 3 * p})


@pytest.mark.parametrize(("name", "p"), [(n, p) for n in HANDMADE for p in PPS if _admits(n, p)])
def test_valid_and_deadlock_free(name: str, p: int) -> None:
    for m in _ms(p):
        if m < _minimum(name, p):
            continue
        s = generate(name, p, m)
        s.validate().check_order()
        assert s.num_ranks == p and s.num_microbatches == m and s.name == name


@pytest.mark.parametrize("name", HANDMADE)
def test_too_few_microbatches_raise(name: str) -> None:
    p = 4
    with pytest.raises(ScheduleError, match="microbatches >="):
        generate(name, p, _minimum(name, p) - 1)


@pytest.mark.parametrize("name", HANDMADE)
def test_too_few_ranks_raise(name: str) -> None:
    with pytest.raises(ScheduleError, match="pp >= 2"):
        generate(name, 1, 8)


def test_odd_pp_dualpipe_raises() -> None:
    with pytest.raises(ScheduleError, match="even pp"):
        generate("dualpipe", 3, 12)


def test_costs_as_compile_takes_them() -> None:
    """generate and simulate took only Costs (a string, as compile and the command line take it, raised a raw
    AttributeError); a string now means Costs.parse of it, and anything else is a ScheduleError. A Schedule
    saying it has 0 pipelines raised ZeroDivisionError."""
    text = "F=1,B=2,W=0.5,comm=0.1"
    for name, vocab in (("zb-auto", False), ("zbv", False), ("1f1b", True)):
        assert generate(name, 4, 8, costs=text, vocab=vocab) == generate(name, 4, 8, costs=Costs.parse(text),
                                                                         vocab=vocab)
    sched = generate("zb-h1", 4, 8)
    assert simulate(sched, text).makespan == simulate(sched, Costs.parse(text)).makespan
    with pytest.raises(ScheduleError, match="costs=3: give a zbcompile.Costs"):
        generate("zb-auto", 4, 8, costs=3)
    header = "# zbcompile schedule x: microbatches=1 placement=0 pipelines=0\nrank 0: 0F0 0B0 0W0\n"
    with pytest.raises(ScheduleError, match="pipelines must be an int >= 1"):
        Schedule.from_text(header).validate()


def test_unknown_name_lists_valid_names() -> None:
    with pytest.raises(ScheduleError, match="zb-h1"):
        generate("zb-h3", 4, 8)


def test_chunks_only_where_they_mean_something() -> None:
    assert generate("interleaved-1f1b", 4, 8, chunks=3).num_stages == 12
    with pytest.raises(ScheduleError, match="chunks"):
        generate("interleaved-1f1b", 4, 8, chunks=1)
    with pytest.raises(ScheduleError, match="chunks"):
        generate("1f1b", 4, 8, chunks=2)


def test_integer_likes_are_taken_and_other_numbers_refused_by_name() -> None:
    """An integer-like (a NumPy integer) is an int to generate (operator.index); a float, a bool or a string is refused naming the
    argument, not as too few microbatches ("needs microbatches >= 1 ... got 8.0: raise --microbatches")."""
    class Integer:   # what a NumPy integer is to operator.index
        def __init__(self, value: int) -> None:
            self.value = value

        def __index__(self) -> int:
            return self.value

    assert generate("zbv", Integer(2), Integer(8)) == generate("zbv", 2, 8)
    assert generate("interleaved-1f1b", 2, 4, chunks=Integer(2)) == generate("interleaved-1f1b", 2, 4, chunks=2)
    for args, name in (((2, 8.0), "microbatches"), ((4.0, 8), "pp"), ((2, True), "microbatches"), (("2", 8), "pp")):
        with pytest.raises(ScheduleError, match=rf"{name}=.* must be a whole number"):
            generate("1f1b", *args)
    with pytest.raises(ScheduleError, match=r"needs microbatches >= 1 for"):   # (not ">= 1 = 1")
        generate("zbv", 2, 0)


def test_mem_limit_only_where_it_is_read_and_as_a_number() -> None:
    """A fixed order has a peak of its own: mem_limit given to it would be ignored without a word (compile refuses
    it too); zb-auto takes a number, not a string."""
    with pytest.raises(ScheduleError, match="does not read mem_limit=1: drop it, or pick zb-auto"):
        generate("1f1b", 4, 8, mem_limit=1)
    with pytest.raises(ScheduleError, match="mem_limit='4' must be a number"):
        generate("zb-auto", 4, 8, mem_limit="4")
    assert max(simulate(generate("zb-auto", 4, 8, mem_limit=2)).peak_memory) <= 2


def test_every_schedule_is_described() -> None:
    described = list_schedules()
    assert list(described) == list(GENERATORS)
    assert all(text and "\n" not in text for text in described.values())


def _sim(name: str, p: int, m: int, **kw):
    return simulate(generate(name, p, m, **kw), UNIT)


@pytest.mark.parametrize("p", PPS)
def test_closed_forms(p: int) -> None:
    for m in (p, 2 * p, 3 * p):
        assert _sim("1f1b", p, m).bubble_rate == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
        assert _sim("gpipe", p, m).bubble_rate == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
        assert _sim("zb-h1", p, m).bubble_rate == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-12)
        for v in (2, 3):
            got = _sim("interleaved-1f1b", p, m, chunks=v).bubble_rate
            assert got == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
    for m in (2 * p, 3 * p):
        for name in ("zb-h2", "zbv", "v-zb"):
            assert _sim(name, p, m).bubble_rate == pytest.approx(0, abs=1e-12), name


def test_interleaved_closed_form_without_multiple_of_pp() -> None:
    # the first group absorbs m % p, which keeps the bubble at (p-1)/(vm+p-1)
    for p, m in ((4, 5), (4, 11), (8, 13)):
        assert _sim("interleaved-1f1b", p, m).bubble_rate == pytest.approx((p - 1) / (2 * m + p - 1), abs=1e-12)


@pytest.mark.parametrize("p", PPS)
def test_peak_memory(p: int) -> None:
    expect = {"1f1b": p, "zb-h1": p, "zb-h2": 2 * p - 1, "zbv": p, "v-zb": p,
              "v-half": (p + 2) // 2, "v-min": (p + 4) // 3, "dualpipev": p + 0.5}
    if p % 2 == 0:
        expect["dualpipe"] = p + 1
    for m in (2 * p, 3 * p):
        for name, peak in expect.items():
            assert max(_sim(name, p, m).peak_memory) == pytest.approx(peak), (name, m)


def test_v_family_matches_reference_bubbles() -> None:
    # unit-cost reference rates from the authors' generators, p=8, m=24
    assert _sim("v-min", 8, 24).bubble_rate == pytest.approx(0.1579, abs=5e-5)
    assert _sim("v-half", 8, 24).bubble_rate < _sim("1f1b", 8, 24).bubble_rate


def test_text_round_trip() -> None:
    for name in HANDMADE:
        s = generate(name, 4, 8)
        assert type(s).from_text(s.to_text()) == s


def test_large_pipelines_are_valid() -> None:
    """p=32, m=256 (the size benchmarks/schedule_speed.py times) builds and validates for every generator."""
    for name in HANDMADE:
        s = generate(name, 32, 256)
        assert s.num_ranks == 32 and sum(len(r) for r in s.ranks) >= 2 * 256 * s.num_model_stages


UNEVEN = [Costs(1, 1.1, 0.6, 0.05), Costs(1, 2, 1, 0.1), Costs(1, 1, 0.5, 0.2)]


@pytest.mark.parametrize("costs", UNEVEN, ids=str)
@pytest.mark.parametrize("p,m", [(4, 8), (4, 12), (8, 24)])
def test_zbv_beats_zb_h1_at_no_more_memory_with_uneven_costs(costs, p, m):
    """The ZB-V claim: ZB-H1's memory (p units), less time; checked for measured-looking cost profiles."""
    zbv, h1 = simulate(generate("zbv", p, m), costs), simulate(generate("zb-h1", p, m), costs)
    assert zbv.makespan <= h1.makespan and max(zbv.peak_memory) <= max(h1.peak_memory)


@pytest.mark.parametrize("p,m", [(4, 8), (4, 12), (8, 24)])
def test_zbv_beats_zb_h2_with_less_memory_on_the_issue_profile(p, m):
    """F=1, B=1.1, W=0.6, comm=0.05: ZB-V is faster than ZB-H2 while holding p instead of 2p-1 units."""
    costs = Costs(1, 1.1, 0.6, 0.05)
    zbv, h2 = simulate(generate("zbv", p, m), costs), simulate(generate("zb-h2", p, m), costs)
    assert zbv.makespan <= h2.makespan and max(zbv.peak_memory) < max(h2.peak_memory)
