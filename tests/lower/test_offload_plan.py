"""The offload planner (passes/analysis/offload_plan.py): budgets, the selective order, errors, the time model."""

from __future__ import annotations

import pytest

from support.launch import run_python
from support.models import gpt
from zbcompile.compiler import split_for
from zbcompile.ir.program.ops import Stream
from zbcompile.passes.analysis.memory import rank_memory
from zbcompile.passes.analysis.offload_plan import (DEVICES, Device, OffloadError, _by_lifespan, compute_time,
                                                    least_peaks, plan_offload)
from zbcompile.passes.lower import OffloadChoice, insert_offload, lower_all, offload_programs
from zbcompile.passes.schedules import generate


@pytest.fixture(scope="module")
def programs():
    case = gpt(layers=8, batch=8, seq=16)
    sched = generate("zb-h1", 2, 8)
    staged = split_for(case.model, case.loss_fn, case.example, sched)
    return lower_all(sched, staged)


def test_budget_between_floor_and_plain_is_met_by_the_longest_lived(programs):
    floor = least_peaks(programs)
    plain = [rank_memory(p).peak_total_bytes for p in programs]
    assert floor[0] < plain[0]
    budget = [(f + p) // 2 for f, p in zip(floor, plain)]
    report = plan_offload(programs, budget)
    for r, p in zip(report, programs):
        assert r.peak_after <= budget[r.rank] and r.peak_before == plain[r.rank]
        assert rank_memory(insert_offload(p, r.choice)).peak_total_bytes == r.peak_after


def test_the_longest_lived_forwards_go_first(programs):
    """A budget that the first few units (by modelled lifespan) already meet is met by those, not by others."""
    p = programs[0]
    order = _by_lifespan(p, DEVICES["h100"])
    plain = rank_memory(p).peak_total_bytes
    peaks = [rank_memory(insert_offload(p, OffloadChoice(frozenset(order[:k]), 1))).peak_total_bytes
             for k in range(1, len(order))]
    k = next(k for k, peak in enumerate(peaks, start=1) if peak < plain)   # the first prefix that helps
    assert k < len(order)
    report = plan_offload(programs, [peaks[k - 1], 10 ** 12])
    assert report[0].choice.units == frozenset(order[:k]) and report[0].peak_after == peaks[k - 1]
    assert report[1].offloaded_bytes == 0


@pytest.mark.slow
def test_offload_added_to_finished_programs_equals_lowering_with_it(programs):
    """zb.compile adds the planned offload to the programs it already lowered instead of lowering again."""
    sched = generate("zb-h1", 2, 8)
    case = gpt(layers=8, batch=8, seq=16)
    staged = split_for(case.model, case.loss_fn, case.example, sched)
    choices = [r.choice for r in plan_offload(programs, least_peaks(programs))]
    added = offload_programs(lower_all(sched, staged), choices)
    assert [p.to_text() for p in added] == [p.to_text() for p in lower_all(sched, staged, offload=choices)]


def test_generous_budget_offloads_nothing(programs):
    report = plan_offload(programs, 10 ** 12)
    assert all(r.choice.units == frozenset() and r.offloaded_bytes == 0 and r.slowdown == 1.0 for r in report)


def test_budget_below_the_floor_names_the_smallest_that_works(programs):
    floor = least_peaks(programs)
    with pytest.raises(OffloadError) as e:
        plan_offload(programs, min(floor) // 2)
    assert f"at least {max(floor)} bytes" in str(e.value) and "too small" in str(e.value)
    plan_offload(programs, max(floor))   # exactly the floor fits


@pytest.mark.parametrize("bad", [-5, 0, "lots", [1, 2, 3], True])
def test_bad_budgets_are_refused(programs, bad):
    with pytest.raises(OffloadError, match="budget|offload="):
        plan_offload(programs, bad)


def test_auto_offloads_only_what_the_time_model_hides(programs):
    fast = Device("fast copies", 1e9, 1e9, 1e15)     # copies take no time: everything is free
    slow = Device("slow copies", 1e15, 1e15, 1e3)    # copies take forever: nothing is
    everything = plan_offload(programs, "auto", device=fast)
    nothing = plan_offload(programs, "auto", device=slow)
    assert everything[0].offloaded_bytes > 0 and everything[0].slowdown <= 1.01
    assert all(r.offloaded_bytes == 0 for r in nothing)


def test_time_model_stalls_on_slow_copies(programs):
    p = programs[0]
    slow = Device("slow copies", 1e12, 1e12, 1e6)
    off = insert_offload(p, OffloadChoice(None, 0))
    assert compute_time(off, slow) > compute_time(p, slow)
    assert compute_time(off, DEVICES["h100"]) >= compute_time(p, DEVICES["h100"])
    report = plan_offload(programs, least_peaks(programs), device=slow)
    assert report[0].k > 1 and report[0].slowdown > 1


@pytest.mark.slow
def test_inspect_offload_cli():
    out = run_python(["-m", "zbcompile", "inspect", "zbcompile.examples.train_gpt:tiny", "--pp", "2", "--schedule",
                      "zb-h1", "--memory", "--offload", "2200000"], timeout=300)
    assert out.returncode == 0, out.stderr
    assert "activation offload for 2200000" in out.stdout and "k = To/Tc" in out.stdout
    assert "peak total MiB" in out.stdout
    bad = run_python(["-m", "zbcompile", "inspect", "zbcompile.examples.train_gpt:tiny", "--pp", "2", "--schedule",
                      "zb-h1", "--offload", "1000"], timeout=300)
    assert bad.returncode != 0 and "smallest" not in bad.stdout and "at least" in bad.stderr


def test_the_time_model_runs_the_copies_one_after_another_on_the_copy_stream():
    """With free compute and slow copies (1e6 B/s) the step lasts at least as long as the one copy stream takes
    for every copy posted up to the last one a wait waits for: their bytes over the bandwidth (FIFO, by hand)."""
    case = gpt(layers=8, batch=8, seq=16)
    schedule = generate("zb-h1", 2, 8)
    program = insert_offload(lower_all(schedule, split_for(case.model, case.loss_fn, case.example, schedule))[0],
                             OffloadChoice(None, 0))
    device = Device("free compute, slow copies", 1e30, 1e30, 1e6)
    posted, last = {}, -1
    for i, op in enumerate(program.ops):
        if op.spec.stream is Stream.COPY and op.spec.copy_bytes is not None:
            posted.update((h, i) for h in op.outs)
        elif op.spec.stream is Stream.COPY:
            last = max([last] + [posted[v] for v in op.ins if v in posted])
    copied = sum(op.spec.copy_bytes(op) for op in program.ops[:last + 1]
                 if op.spec.stream is Stream.COPY and op.spec.copy_bytes is not None)
    assert copied > 0 and compute_time(program, device) >= copied / device.copy_bandwidth * (1 - 1e-9)
