"""One rank of tests/distributed/test_offload_dist.py (torchrun environment): activation offload under a memory budget.

For each schedule: split once per stage layout, plan memory without offload, set each rank's budget to half its
peak without offload, or to the least peak offload can reach there (`least_peaks`, the floor) if that is more,
compile
with that budget (PipelineModule.from_staged(offload=...)), run two steps (the second measured by the storage
tracker) and compare the loss and the first step's gradients with eager training with microbatch accumulation;
then measure one step of the same pipeline without offload. Writes `<out>/rank<r>.json`: the budget used, the
planned and measured peaks with offload, the planned and measured peaks without it, the bytes offloaded.
"""

from __future__ import annotations

import copy
import traceback

import torch

torch.set_num_threads(1)

from support.dist_cases import OFFLOAD_SCHEDULES as SCHEDULES  # noqa: E402
from support.launch import worker_main  # noqa: E402
from support.models import eager_accumulated, gpt  # noqa: E402

from zbcompile.api import PipelineModule  # noqa: E402
from zbcompile.compiler import split_for  # noqa: E402
from zbcompile.passes.analysis.memory import memory_plan  # noqa: E402
from zbcompile.passes.analysis.offload_plan import least_peaks  # noqa: E402
from zbcompile.passes.lower import lower_all  # noqa: E402
from zbcompile.passes.schedules import generate  # noqa: E402

M = 8


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def eager(case, xb, yb):
    model = copy.deepcopy(case.model)
    loss = eager_accumulated(model, case.loss_fn, xb, yb, M)
    return loss, {n: p.grad.clone() for n, p in model.named_parameters()}


def one(case, staged, schedule, xb, yb, ref, rank: int) -> dict:
    programs = lower_all(schedule, staged)
    plan = memory_plan(programs)
    plain = plan[rank]
    floor = least_peaks(programs)
    # half the no-offload peak, or the least any choice reaches where offload cannot halve it (a last stage
    # whose backward follows each forward has nothing to move)
    budgets = [max(p.peak_total_bytes // 2, f) for f, p in zip(floor, plan.ranks)]
    pipe = PipelineModule.from_staged(copy.deepcopy(case.model), staged, schedule, offload=budgets)
    loss = pipe.step(xb, yb)
    grad_err = max(rel(p.grad, ref[1][n]) for n, p in pipe.named_parameters())
    for p in pipe.parameters():
        p.grad = None
    loss2, measured = pipe.measure_memory(xb, yb)
    planned = pipe.memory_plan()[rank]
    mine = pipe.offload_report[rank]
    # the same step without offload, measured too: what the tracker sees offload save, independently of the plan
    _, measured_plain = PipelineModule.from_staged(copy.deepcopy(case.model), staged, schedule).measure_memory(xb, yb)
    return {"loss_err": abs(loss - ref[0]) / abs(ref[0]), "loss2_err": abs(loss2 - ref[0]) / abs(ref[0]),
            "grad_err": grad_err, "budget": budgets[rank], "floor": floor[rank], "peak_plain": plain.peak_total_bytes,
            "peak_planned": planned.peak_total_bytes, "dynamic_planned": planned.peak_dynamic_bytes,
            "resident": planned.resident_bytes, "measured": measured.peak, "measured_plain": measured_plain.peak,
            "offloaded": mine.offloaded_bytes, "units": len(mine.choice.units or ()), "host": planned.host}


def run(rank: int, pp: int, out: str) -> dict:
    case = gpt(layers=8, batch=8, seq=16)
    g = torch.Generator().manual_seed(5)
    x, y = case.example
    xb = torch.randint(0, 64, (M * x.shape[0], *x.shape[1:]), generator=g)
    yb = torch.randint(0, 64, (M * y.shape[0], *y.shape[1:]), generator=g)
    ref = eager(case, xb, yb)
    results, splits = {}, {}
    for name in SCHEDULES:
        try:
            schedule = generate(name, pp, M)
            layout = (schedule.num_model_stages, schedule.stage_groups())
            if layout not in splits:
                splits[layout] = split_for(case.model, case.loss_fn, case.example, schedule)
            results[name] = one(case, splits[layout], schedule, xb, yb, ref, rank)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
    return results


if __name__ == "__main__":
    worker_main(run)
