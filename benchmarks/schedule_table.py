"""Bubble rate and activation memory of every schedule for one cost profile (simulated, no GPU needed).

    python benchmarks/schedule_table.py --pp 8 --microbatches 24
    python benchmarks/schedule_table.py --costs F=1,B=1.1,W=0.6,comm=0.05 --pp 4 8 16 --microbatches 32 64
    python benchmarks/schedule_table.py --pp 8 --microbatches 24 --mem-limit 8 --format github
    python benchmarks/schedule_table.py --pp 8 --microbatches 24 --json table.json

Prints one table per (pp, microbatches) pair, built by `zbcompile.plan.compare`, the same function behind
`zbcompile plan --compare`. Memory is in 1F1B-stage units (1 = one stage's activations for one microbatch).
"""

from __future__ import annotations

import argparse
import sys

from _harness import write_results
from zbcompile.errors import ZBCompileError
from zbcompile.plan import compare, compare_table
from zbcompile.simulate import Costs, MemoryModel


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--costs", default="", help="per-1F1B-stage times, e.g. F=1,B=1.1,W=0.6,comm=0.05")
    parser.add_argument("--pp", type=int, nargs="+", default=[8], help="pipeline ranks (several allowed)")
    parser.add_argument("--microbatches", "-m", type=int, nargs="+", default=[24], help="several allowed")
    parser.add_argument("--chunks", type=int, help="stages per rank for the interleaved schedule")
    parser.add_argument("--mem-limit", type=float, help="per-rank limit in 1F1B-stage units")
    parser.add_argument("--b-frees", type=float, default=0.0, help="share of an F's activations B frees")
    parser.add_argument("--format", default="simple", help="tabulate table format (simple, github, latex, ...)")
    parser.add_argument("--json", default=None, help="write the rows here instead of benchmarks/results/")
    args = parser.parse_args(argv)
    tables = []
    try:
        costs = Costs.parse(args.costs)
        memory = MemoryModel(args.b_frees)
        for pp in args.pp:
            for m in args.microbatches:
                rows = compare(pp, m, chunks=args.chunks, costs=costs, memory=memory, mem_limit=args.mem_limit)
                limit = f", mem limit {args.mem_limit:g}" if args.mem_limit is not None else ""
                print(f"\np={pp}, m={m}, costs {costs}{limit}")
                print(compare_table(rows, tablefmt=args.format))
                tables.append(dict(pp=pp, microbatches=m, rows=[summary(row) for row in rows]))
    except ZBCompileError as exc:
        print(f"schedule_table: error: {exc}", file=sys.stderr)
        return 2
    write_results("schedule_table", dict(costs=str(costs), mem_limit=args.mem_limit, b_frees=args.b_frees,
                                         chunks=args.chunks, tables=tables), args.json, default=argv is None)
    return 0


def summary(row) -> dict:
    """One schedule's simulated figures (or why it has none)."""
    out = dict(schedule=row.name, reason=row.reason)
    if row.result is not None:
        res = row.result
        out.update(makespan=res.makespan, bubble_rate=res.bubble_rate, bubble_share=res.bubble_share,
                   peak_memory=list(res.peak_memory))
    return out


if __name__ == "__main__":
    sys.exit(main())
