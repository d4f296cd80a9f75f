#!/usr/bin/env python
"""Compile time of the lowering: `lower_all` (every rank's program, validated together) against pp and m.

    python benchmarks/lower_time.py                          # zbv at p=4..32, m=4p (about a minute)
    python benchmarks/lower_time.py --pp 8,16,32,64 --schedule zbv
    python benchmarks/lower_time.py --json lower_time.json

Every rank of a pipeline lowers every rank's program at start-up (to order and check them together), so this
is start-up time on each rank. The model is a tiny MLP (one Linear(8, 8) + Tanh per stage) cut into as many
stages as the schedule needs: the lowering's cost depends on the number of actions and messages, not on the
model's size. Time is the median of `--repeat` runs (the first split is not timed). The issue's targets for
zbv on the project's 2-core machine: at most 5 s at p=32, m=128 and 30 s at p=64, m=256.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from tabulate import tabulate
from torch import nn

from _harness import write_results
from zbcompile.passes.lower import lower_all
from zbcompile.passes.schedules import generate
from zbcompile.split import split_model


def tiny_mlp(stages: int) -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(stages)))
    return model, ((torch.randn(1, 8),), (torch.randn(1, 8),))


def measure(schedule: str, pp: int, m: int, repeat: int) -> dict:
    sched = generate(schedule, pp, m)
    model, example = tiny_mlp(sched.num_model_stages)
    t0 = time.perf_counter()
    staged = split_model(model, nn.functional.mse_loss, example, num_stages=sched.num_model_stages)
    split_s = time.perf_counter() - t0
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        programs = lower_all(sched, staged)
        times.append(time.perf_counter() - t0)
    ops = sum(len(p.ops) for p in programs)
    return {"schedule": schedule, "pp": pp, "microbatches": m, "stages": sched.num_model_stages,
            "actions": sum(len(r) for r in sched.ranks), "ops": ops, "lower_all_s": statistics.median(times),
            "us_per_op": 1e6 * statistics.median(times) / ops, "split_s": split_s}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schedule", default="zbv")
    ap.add_argument("--pp", default="4,8,16,32", help="comma-separated pipeline sizes")
    ap.add_argument("--m-per-pp", type=int, default=4, help="microbatches = this * pp")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--json", default=None, help="write the rows here instead of benchmarks/results/")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for pp in (int(x) for x in args.pp.split(",")):
        rows.append(measure(args.schedule, pp, args.m_per_pp * pp, args.repeat))
        r = rows[-1]
        print(f"p={pp:3d} m={r['microbatches']:4d}: lower_all {r['lower_all_s']:.2f} s "
              f"({r['ops']} ops, {r['us_per_op']:.1f} us/op; split {r['split_s']:.1f} s)", flush=True)
    print(tabulate([[r["pp"], r["microbatches"], r["actions"], r["ops"], f"{r['lower_all_s']:.2f}",
                     f"{r['us_per_op']:.1f}"] for r in rows],
                   headers=["pp", "m", "actions", "ops (all ranks)", "lower_all s", "us / op"]))
    write_results("lower_time", dict(rows=rows), args.json, default=argv is None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
