"""One rank of tests/distributed/test_inductor_dist.py: `zbcompile.compile(..., backend="inductor")` as users
call it under the torchrun environment, next to eager microbatch training (compile_worker.run_case), and a
backend name zbcompile does not know. Results go to `<out>/rank<r>.json`."""

from __future__ import annotations

import traceback

import torch

torch.set_num_threads(1)

from compile_worker import run_case  # noqa: E402  (a sibling script: this one's folder is sys.path[0])
from support.launch import worker_main  # noqa: E402
from support.models import gpt  # noqa: E402

import zbcompile.api as zb  # noqa: E402

SCHEDULES = ("zbv", "1f1b")
MICROBATCHES = 4


def run(rank: int, pp: int, out: str) -> dict:
    results: dict = {}
    g = gpt(layers=2, batch=MICROBATCHES * 2)
    for name in SCHEDULES:
        run_case(results, name, g.model, g.loss_fn, *g.example, MICROBATCHES, 60.0, schedule=name,
                 backend="inductor")
    try:
        zb.compile(g.model, schedule="1f1b", microbatches=MICROBATCHES, loss_fn=g.loss_fn,
                   example=tuple((t[:2],) for t in g.example), backend="tvm")
        results["bad_backend"] = dict(error="no error raised")
    except Exception as e:   # recorded for the test to judge
        results["bad_backend"] = dict(type=[c.__name__ for c in type(e).__mro__], message=str(e),
                                      trace=traceback.format_exc())
    return results


if __name__ == "__main__":
    worker_main(run)
