#!/usr/bin/env python
"""Compiled stage graphs on CPU: zbv at pp=2 with eager (aten) vs inductor stage graphs, next to
torch.distributed.pipelining's ZBVZeroBubble with eager and torch.compile'd stage modules (torch 2.13 refuses
the latter: "not supported with stage modules that have used torch.compile"; its 1F1B takes them, --configs),
and one process (1 thread, microbatch accumulation) eager and torch.compile'd.

    python benchmarks/bench_inductor.py                  # about 4 min on 2 vCPUs
    python benchmarks/bench_inductor.py --quick          # tiny model, 1 round (about 1.5 min)
    python benchmarks/bench_inductor.py --json out.json
    python benchmarks/bench_inductor.py --configs "torch 1F1B eager,torch 1F1B torch.compile"

The model, split, step timing and rounds are bench_pp.py's (GPT d=256, L=8, heads=4, seq=128, V=8192;
8 microbatches of 2; gloo, 1 thread per rank; each step timed between barriers, max over ranks; the median
of each round, the best round shown). Inductor's cache lives in a fresh directory for the run, so round 0
compiles cold and later rounds hit inductor's FX graph cache: `compile s` is zb.compile's wall time per
round (trace, split, lower, compile), `first step s` the first step's (torch.compile compiles there).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

from tabulate import tabulate

from _harness import Runner, med, write_results

# label -> (side, schedule, cfg overrides)
CONFIGS = {
    "ours zbv eager": ("ours", "zbv", {}),
    "ours zbv inductor": ("ours", "zbv", {"backend": "inductor"}),
    "torch ZBVZeroBubble eager": ("torch", "ZBVZeroBubble", {}),
    "torch ZBVZeroBubble torch.compile": ("torch", "ZBVZeroBubble", {"torch_compile": True}),
    "1 process 1 thread eager": ("single", "accum", {}),
    "1 process 1 thread torch.compile": ("single", "accum", {"torch_compile": True}),
    # not run by default: torch's 1F1B accepts torch.compile'd stages (its ZBVZeroBubble refuses them)
    "torch 1F1B eager": ("torch", "1F1B", {}),
    "torch 1F1B torch.compile": ("torch", "1F1B", {"torch_compile": True}),
}
DEFAULT = list(CONFIGS)[:6]


def run_config(bench: Runner, label: str, rnd: int) -> dict:
    side, name, extra = CONFIGS[label]
    base = bench.cfg
    bench.cfg = dict(base, **extra)
    try:
        if side == "single":
            return bench.run_single(f"single_{rnd}_{len(extra)}", name, 1, rnd)
        return bench.run_pp(side, name, rnd)
    finally:
        bench.cfg = base


def summary(label: str, rounds: list[dict]) -> list:
    ok = [r for r in rounds if r.get("step_s")]
    if not ok:
        err = next((r.get("error") for r in rounds if r.get("error")), "no result")
        return [label, "ERROR " + str(err)[:160], "", "", ""]
    per_round = [1e3 * med(r["step_s"]) for r in ok]
    cpu = [1e3 * med(r["cpu_s"]) for r in ok if r.get("cpu_s")]
    firsts = [max(x.get("first_step_s", 0.0) for x in r.get("per_rank", [r])) for r in ok]
    compiles = [r.get("compile_s") for r in ok if r.get("compile_s") is not None]
    return [label, f"{min(per_round):.1f}", " ".join(f"{v:.0f}" for v in per_round),
            f"{min(cpu):.1f}" if cpu else "", " ".join(f"{v:.1f}" for v in compiles),
            " ".join(f"{v:.2f}" for v in firsts)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=None, help="default 3 (--quick: 1)")
    ap.add_argument("--configs", default=",".join(DEFAULT),
                    help=f"comma-separated labels (default: the first six; known: {', '.join(CONFIGS)})")
    ap.add_argument("--json", default=None, help="write the results here instead of benchmarks/results/")
    args = ap.parse_args(argv)
    rounds = args.rounds or (1 if args.quick else 3)
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
    cache = tempfile.mkdtemp(prefix="bench_inductor_cache_", dir="/tmp")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache   # round 0 compiles cold, later rounds hit the cache
    bench = Runner(argparse.Namespace(quick=args.quick, warmup_s=2.0, steps=6, max_measure_s=6.0, our_split="same",
                                     profile=0, timeout=600.0))
    labels = [c.strip() for c in args.configs.split(",")]
    results: dict = {label: [] for label in labels}
    for rnd in range(rounds):
        for label in (labels if rnd % 2 == 0 else labels[::-1]):
            results[label].append(run_config(bench, label, rnd))
    rows = [summary(label, results[label]) for label in labels]
    lines = [f"pp=2, cfg {bench.cfg}", tabulate(rows, headers=["config", "step ms (best round)", "rounds ms",
                                                                "CPU ms/step (all ranks)", "compile s per round",
                                                                "first step s"], tablefmt="github"),
             "CPU ms/step: process CPU time per step summed over ranks, median of the round with the least: it "
             "moves far less than wall time when other jobs share the cores."]
    best = {r[0]: float(r[1]) for r in rows if not r[1].startswith("ERROR")}
    best_cpu = {r[0]: float(r[3]) for r in rows if r[3]}
    for a, b in (("ours zbv eager", "ours zbv inductor"),
                 ("torch ZBVZeroBubble eager", "torch ZBVZeroBubble torch.compile"),
                 ("1 process 1 thread eager", "1 process 1 thread torch.compile"),
                 ("torch 1F1B eager", "torch 1F1B torch.compile"),
                 ("torch ZBVZeroBubble torch.compile", "ours zbv inductor")):
        if a in best and b in best:
            cpu = f", CPU {best_cpu[a] / best_cpu[b]:.3f}x" if a in best_cpu and b in best_cpu else ""
            lines.append(f"{b} vs {a}: wall {best[a] / best[b]:.3f}x{cpu}")
    if "ours zbv eager" in best and "ours zbv inductor" in best:
        # the two run back to back in every round: the median of the per-round ratios resists a round that
        # other jobs slowed for one config only (best rounds of each may come from differently loaded times)
        pairs = [med(a["step_s"]) / med(b["step_s"]) for a, b in zip(results["ours zbv eager"],
                                                                   results["ours zbv inductor"])
                 if a.get("step_s") and b.get("step_s")]
        x = med(pairs)
        lines.append(f"TARGET zbv inductor >= 1.10x zbv eager (wall, median of per-round ratios "
                     f"{' '.join(f'{p:.3f}' for p in pairs)}): {x:.3f}x {'MET' if x >= 1.10 else 'NOT MET'}")
    lines.append(f"total wall time {time.time() - bench.T0:.0f} s")
    text = "\n".join(lines)
    print(text)
    write_results("bench_inductor", dict(results=results, table=text, cfg=bench.cfg), args.json,
                  default=argv is None)
    shutil.rmtree(bench.tmp, ignore_errors=True)
    shutil.rmtree(cache, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
