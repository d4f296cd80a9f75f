"""Per-action host overhead of a compiled pipeline step on a near-zero-compute model (gloo, CPU).

    torchrun --nproc-per-node 2 benchmarks/overhead.py [--schedule 1f1b] [--microbatches 16] [--json FILE]

Model: Linear(4, 4)/Tanh pairs, microbatch of 1 row, so compute is a few microseconds per action and the
step time is almost all runtime overhead plus gloo latency. Prints, on rank 0: step time / actions per rank,
the mean time inside the stage graphs per action, and the rest per action.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import zbcompile as zb
from _harness import write_results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--microbatches", type=int, default=16)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--json", default=None, help="rank 0 writes the figures here instead of benchmarks/results/")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    m = args.microbatches
    model = nn.Sequential(*[layer for _ in range(8) for layer in (nn.Linear(4, 4), nn.Tanh())])
    x, y = torch.randn(m, 4), torch.randn(m, 4)
    pipe = zb.compile(model, schedule=args.schedule, microbatches=m, loss_fn=nn.functional.mse_loss,
                      example=((x[:1],), (y[:1],)))
    for _ in range(20):
        pipe.step(x, y)
    t0 = time.perf_counter()
    busy = 0.0
    for _ in range(args.steps):
        pipe.step(x, y)
        busy += pipe.last_step.busy[pipe.rank]
    step = (time.perf_counter() - t0) / args.steps
    actions = len(pipe.schedule.ranks[pipe.rank])
    if pipe.rank == 0:
        print(f"{args.schedule}: {actions} actions/rank, step {step * 1e3:.2f} ms, "
              f"{step / actions * 1e6:.1f} us/action; in stage graphs {busy / args.steps / actions * 1e6:.1f} "
              f"us/action; rest (P2P, waits, bookkeeping, loss gather) "
              f"{(step - busy / args.steps) / actions * 1e6:.1f} us/action; bubble {pipe.last_step.bubble}")
        write_results("overhead", dict(schedule=args.schedule, microbatches=m, steps=args.steps, actions=actions,
                                       world=pipe.schedule.num_ranks, step_s=step,
                                       us_per_action=step / actions * 1e6,
                                       stage_graph_us_per_action=busy / args.steps / actions * 1e6,
                                       rest_us_per_action=(step - busy / args.steps) / actions * 1e6,
                                       bubble=list(pipe.last_step.bubble)), args.json, default=argv is None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
