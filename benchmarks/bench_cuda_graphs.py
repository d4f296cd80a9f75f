#!/usr/bin/env python
"""Host launch overhead per action, with and without CUDA graphs (needs a CUDA device).

One rank on one GPU runs a one-stage and a two-stage schedule (placement 0 / 0,0: every action on this rank,
the hand-over between stages local) of the null model (benchmarks/_bench_models.py: an Embedding, tiny residual
Linear units, a Linear head: next to no device work, so a step's time is the host's launching). Each config runs
eagerly and with `cuda_graphs` (2 warm-up steps, capture, replay); per step, wall time between synchronizes,
median of the timed steps, divided by the step's actions (F, B, W):

    python benchmarks/bench_cuda_graphs.py                 # about 1 min on an H100
    python benchmarks/bench_cuda_graphs.py --model gpt --d 1024 --layers 8
    python benchmarks/bench_cuda_graphs.py --json out.json
    python benchmarks/bench_cuda_graphs.py --model gpt --d 1024 --backend inductor   # Triton stage graphs

Each row also gives the memory plan's dynamic peak (passes/analysis/memory) next to what the allocator measured
(torch.cuda.max_memory_allocated less what was allocated before): eager, over one step after the warm-up; with
CUDA graphs, from the first warm-up step to the first replay (the graph's private pool is taken at capture and
kept, with the persistent .grad tensors).

Without CUDA it says so and exits with status 2 (no CPU stand-in for timings).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from tabulate import tabulate

from _harness import build_model, make_batch, write_results
from zbcompile.compiler import compile_programs
from zbcompile.examples.gpt import loss_fn
from zbcompile.options import CompileOptions
from zbcompile.passes.analysis.memory import memory_plan
from zbcompile.passes.lower import emit_fx
from zbcompile.passes.schedules import one_rank
from zbcompile.runtime import RankRuntime


def run(cfg: dict, stages: int, graphs: bool, device: torch.device, backend: str | None = None) -> dict:
    model = build_model(cfg).to(device)
    x, y = (t.to(device) for t in make_batch(cfg))
    m = cfg["n_mb"]
    sched = one_rank(stages, m)
    options = CompileOptions(schedule=sched, microbatches=m, loss_fn=loss_fn, cuda_graphs=True, backend=backend,
                             example=((x[: x.shape[0] // m],), (y[: y.shape[0] // m],)))
    programs = compile_programs(model, options, 1).programs   # lowered for capture and checked
    rt = RankRuntime(programs[0], emit_fx(programs[0]), pg=None, device=device,
                     params=dict(model.named_parameters()), buffers=dict(model.named_buffers()), peers=programs,
                     cuda_graphs=graphs)
    times, measured = [], 0
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)   # the model and the batch
    for k in range(cfg["warmup"] + cfg["steps"]):
        for p in model.parameters():
            p.grad = None
        torch.cuda.synchronize(device)
        if k == cfg["warmup"] and not graphs:   # one eager step; a graph's pool is taken at capture, so the
            torch.cuda.reset_peak_memory_stats(device)   # warm-up, capture and first replay count for it
            base = torch.cuda.memory_allocated(device)
        t0 = time.perf_counter()
        loss = rt.step_batch((x, y))
        torch.cuda.synchronize(device)
        if k == cfg["warmup"]:
            measured = torch.cuda.max_memory_allocated(device) - base
        if k >= cfg["warmup"]:
            times.append(time.perf_counter() - t0)
    actions = len(rt.names)
    step = statistics.median(times)
    planned = memory_plan(programs)[0].peak_dynamic_bytes
    return {"stages": stages, "graphs": graphs, "backend": backend or "aten", "actions": actions,
            "step_ms": 1e3 * step, "us_per_action": 1e6 * step / actions, "loss": loss,
            "planned_peak_bytes": planned, "allocator_peak_bytes": measured}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="null", choices=["null", "gpt"])
    ap.add_argument("--d", type=int, default=None, help="width (default: 4 for null, 256 for gpt)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--backend", default=None, choices=["inductor"], help="compile the stage graphs (Triton)")
    ap.add_argument("--json", default=None, help="write the results here instead of benchmarks/results/")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_cuda_graphs: needs a CUDA device (torch.cuda.is_available() is False); nothing measured",
              file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    null = args.model == "null"   # null: next to no device work (d=4, one token, vocabulary 16)
    cfg = {"model": args.model, "d": args.d or (4 if null else 256), "layers": args.layers, "heads": 4,
           "seq": 1 if null else 64, "vocab": 16 if null else 1024, "mbs": 2, "n_mb": args.microbatches, "seed": 0,
           "warmup": 5, "steps": args.steps}
    device = torch.device("cuda", torch.cuda.current_device())
    rows = [run(cfg, stages, graphs, device, args.backend) for stages in (1, 2) for graphs in (False, True)]
    mib = 2.0 ** 20
    table = [(r["stages"], "CUDA graph" if r["graphs"] else "eager", r["actions"], f"{r['step_ms']:.3f}",
              f"{r['us_per_action']:.1f}", f"{r['loss']:.6f}", f"{r['planned_peak_bytes'] / mib:.1f}",
              f"{r['allocator_peak_bytes'] / mib:.1f}") for r in rows]
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, stage graphs "
          f"{args.backend or 'aten'}, cfg {cfg}")
    print(tabulate(table, headers=["stages", "step", "actions", "step ms (median)", "us / action", "loss",
                                   "plan MiB", "allocator MiB"]))
    for s in (1, 2):
        eager, graph = (r for r in rows if r["stages"] == s)
        print(f"{s} stage(s): {eager['us_per_action'] / graph['us_per_action']:.1f}x less time per action with "
              "CUDA graphs")
    write_results("bench_cuda_graphs", {"cfg": cfg, "rows": rows}, args.json, default=argv is None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
