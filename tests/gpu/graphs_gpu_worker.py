"""One rank of tests/gpu/test_cuda_graphs_gpu.py's pp=2 test (2+ GPUs, NCCL): zb.compile(cuda_graphs=True) on
cuda:<rank> trains 5 steps (2 eager, capture, 3 replays) next to single-process eager training on the same
GPU; writes the largest relative loss and gradient differences, and per step the parameters with a gradient
(eager's and this rank's) with the parameters' holders, to `<out>/rank<r>.json`."""

from __future__ import annotations

import copy
import traceback

import torch


from support.launch import worker_main  # noqa: E402
from support.models import eager_accumulated, gpt, train_sgd  # noqa: E402
from support.threaded import param_holders  # noqa: E402

import zbcompile as zb  # noqa: E402

M, STEPS = 4, 5


def run(rank: int, pp: int, out: str) -> dict:
    try:
        torch.cuda.set_device(rank)
        torch.backends.cuda.matmul.allow_tf32 = False
        device = torch.device("cuda", rank)
        case = gpt(layers=4, batch=2, device=str(device))
        x, y = (t.to(device) for t in case.example)
        g = torch.Generator().manual_seed(3)
        batches = [tuple(torch.randint(0, 64, (M * t.shape[0], *t.shape[1:]), generator=g).to(device)
                         for t in (x, y)) for _ in range(STEPS)]
        ref_model = copy.deepcopy(case.model)
        ref = train_sgd(ref_model, lambda xb, yb: eager_accumulated(ref_model, case.loss_fn, xb, yb, M), batches)
        pipe = zb.compile(copy.deepcopy(case.model), schedule="zbv", microbatches=M, loss_fn=case.loss_fn,
                          example=((x,), (y,)), cuda_graphs=True)
        got = train_sgd(pipe, pipe.step, batches)
        loss_err = max(abs(a - b) / abs(b) for a, b in zip(got[0], ref[0]))
        grad_err = max((((gr - ref[1][k][n]).abs().max() / ref[1][k][n].abs().max().clamp_min(1e-12)).item()
                        for k, step in enumerate(got[1]) for n, gr in step.items()), default=0.0)
        # which parameters got a gradient, per step, beside eager's and the holders: the test's union check
        return {"loss_err": loss_err, "grad_err": grad_err, "replays": pipe.runtime.captured.steps - 2,
                "graded": [sorted(step) for step in got[1]], "eager_graded": [sorted(step) for step in ref[1]],
                "holders": param_holders(pipe.schedule, pipe.staged)}
    except Exception:
        return {"error": traceback.format_exc()}


if __name__ == "__main__":
    worker_main(run)
