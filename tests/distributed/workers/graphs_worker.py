"""One rank of tests/distributed/test_cuda_graphs_dist.py (torchrun environment, gloo): captured steps and the
replay check across processes.

For each schedule, twice from the same split (one trace per stage layout):
  * `PipelineModule.from_staged(..., cuda_graphs=True)` with the capture API replaced by the CPU stand-in
    (tests/support/graph_standin.py; the real one needs CUDA): 2 eager warm-up steps, capture, 3 replays;
  * the eager capture-ready program under ReplayCheck (runtime/replay_check.py): every step's static memory and
    message order on the real gloo group equal step 2's.
Both train with SGD, zero_grad(set_to_none=True) on even steps and in place on odd ones; each step's loss and
gradients are compared with single-process eager training, and which parameters got a gradient is reported per
step beside eager's and the parameters' holders (the test's union check). Writes `<out>/rank<r>.json`.
"""

from __future__ import annotations

import copy
import traceback

import torch

torch.set_num_threads(1)

from support.dist_cases import GRAPHS_SCHEDULES as SCHEDULES  # noqa: E402
from support.graph_standin import StandInGraphs  # noqa: E402
from support.launch import worker_main  # noqa: E402
from support.models import eager_accumulated, gpt, train_sgd  # noqa: E402
from support.threaded import param_holders  # noqa: E402

import zbcompile as zb  # noqa: E402
from zbcompile.compiler import split_for  # noqa: E402
from zbcompile.passes.schedules import generate  # noqa: E402
from zbcompile.runtime import graphs  # noqa: E402
from zbcompile.runtime.replay_check import ReplayCheck  # noqa: E402

M, STEPS, LR = 4, 5, 0.05


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def errors(got, ref) -> dict:
    """The largest relative loss and gradient errors over the steps, and per step the parameters with a gradient
    here (the test checks them against eager's and the holders of every rank)."""
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(got[0], ref[0]))
    grad_err = max((rel(g, ref[1][k][n]) for k, step in enumerate(got[1]) for n, g in step.items()), default=0.0)
    return {"loss_err": loss_err, "grad_err": grad_err, "graded": [sorted(step) for step in got[1]]}


def run(rank: int, pp: int, out: str) -> dict:
    case = gpt(layers=2 * pp, batch=8, seq=16)
    x, y = case.example
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randint(0, 64, (M * x.shape[0], *x.shape[1:]), generator=g),
                torch.randint(0, 64, (M * y.shape[0], *y.shape[1:]), generator=g)) for _ in range(STEPS)]
    ref_model = copy.deepcopy(case.model)
    ref = train_sgd(ref_model, lambda xb, yb: eager_accumulated(ref_model, case.loss_fn, xb, yb, M), batches)
    apis: list = []
    graphs.capture_api = lambda device: apis.append(StandInGraphs()) or apis[-1]   # the stand-in, on CPU
    results, splits = {}, {}
    for name in SCHEDULES:
        try:
            schedule = generate(name, pp, M)
            layout = (schedule.num_model_stages, schedule.stage_groups())   # one trace per stage layout
            if layout not in splits:
                splits[layout] = split_for(case.model, case.loss_fn, case.example, schedule)
            pipe = zb.PipelineModule.from_staged(copy.deepcopy(case.model), splits[layout], schedule,
                                                 cuda_graphs=True)
            captured = errors(train_sgd(pipe, pipe.step, batches), ref)
            captured["log"] = apis[-1].log
            plain = zb.PipelineModule.from_staged(copy.deepcopy(case.model), splits[layout], schedule)
            check = ReplayCheck(plain.runtime, warmup=1)
            checked = errors(train_sgd(plain, lambda xb, yb: check.step((xb, yb)), batches), ref)
            checked["messages"] = len(check.reference[1])
            results[name] = {"captured": captured, "checked": checked, "eager_graded": [sorted(k) for k in ref[1]],
                             "holders": param_holders(pipe.schedule, pipe.staged)}
        except Exception:
            results[name] = {"error": traceback.format_exc()}
    return results


if __name__ == "__main__":
    worker_main(run)
