"""Time generating and simulating every schedule at a large size (default p=32, m=256; target: < 1 s each).

    python benchmarks/schedule_speed.py [--pp 32] [--microbatches 256] [--repeat 5] [--costs F=1,B=1.1,W=0.6]
                                        [--json FILE]

Prints the median and best of `--repeat` runs per schedule; the machine is noisy, so quote medians.
"""

from __future__ import annotations

import argparse
import statistics
import time

from tabulate import tabulate

from _harness import write_results
from zbcompile.passes.schedules import GENERATORS, generate
from zbcompile.simulate import Costs, simulate


def time_one(name: str, pp: int, m: int, costs: Costs) -> tuple[float, float, int]:
    t0 = time.perf_counter()
    schedule = generate(name, pp, m, costs=costs)
    t1 = time.perf_counter()
    simulate(schedule, costs)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, sum(len(r) for r in schedule.ranks)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pp", type=int, default=32)
    ap.add_argument("--microbatches", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--costs", type=Costs.parse, default=Costs())
    ap.add_argument("--json", default=None, help="write the times here instead of benchmarks/results/")
    args = ap.parse_args(argv)
    rows, records = [], []
    for name in GENERATORS:
        runs = [time_one(name, args.pp, args.microbatches, args.costs) for _ in range(args.repeat)]
        total = [g + s for g, s, _ in runs]
        records.append(dict(schedule=name, actions=runs[0][2], generate_s=[g for g, _, _ in runs],
                            simulate_s=[s for _, s, _ in runs], median_total_s=statistics.median(total)))
        rows.append([name, runs[0][2], f"{statistics.median(g for g, _, _ in runs):.3f}",
                     f"{statistics.median(s for _, s, _ in runs):.3f}", f"{statistics.median(total):.3f}",
                     f"{min(total):.3f}", "yes" if statistics.median(total) < 1.0 else "NO"])
    print(f"p={args.pp}, m={args.microbatches}, costs {args.costs}, {args.repeat} runs each (seconds)")
    print(tabulate(rows, headers=["schedule", "actions", "generate", "simulate", "median total", "best total",
                                  "< 1 s"]))
    write_results("schedule_speed", dict(pp=args.pp, microbatches=args.microbatches, costs=str(args.costs),
                                         repeat=args.repeat, rows=records), args.json, default=argv is None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
