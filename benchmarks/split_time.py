"""Time tracing + splitting a GPT-2-small-sized GPT (12 layers, d=768, 12 heads, vocab 50257, seq 1024).

    python benchmarks/split_time.py [--stages 8] [--device meta|cpu] [--batch 1] [--threads 1] [--report]
                                    [--json FILE]

Builds `zbcompile.examples.gpt.GPT` on the meta device (no memory, nothing computed) or with a random init on
the CPU, then times `split_model` per pass: trace (export + functionalization), partition, and the per-stage
joint + F/B/W split. Prints one line per pass and the total; `--report` adds the stage table.
"""

from __future__ import annotations

import argparse
import time

import torch

from _harness import write_results
from zbcompile.examples.gpt import GPT, GPTConfig, loss_fn
from zbcompile.passes.partition import auto_split_points, partition
from zbcompile.passes.trace import trace
from zbcompile.split import report, split_traced


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=8)
    ap.add_argument("--device", choices=("meta", "cpu"), default="meta")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--report", action="store_true")
    ap.add_argument("--json", default=None, help="write the times here instead of benchmarks/results/")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    cfg = GPTConfig(vocab=50257, seq=1024, d=768, heads=12, layers=12)
    t0 = time.perf_counter()
    with torch.device(args.device):
        model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab, (args.batch, cfg.seq))
    tgt = torch.randint(0, cfg.vocab, (args.batch, cfg.seq))
    t1 = time.perf_counter()
    traced = trace(model, loss_fn, (idx, tgt))
    t2 = time.perf_counter()
    points = auto_split_points(model, traced, args.stages)
    partition(traced, points)  # timed alone here; split_traced repeats it (it is cheap)
    t3 = time.perf_counter()
    staged = split_traced(model, traced, split_points=points)
    t4 = time.perf_counter()

    print(f"GPT-2 small ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M params, {args.device}), "
          f"batch {args.batch} x seq {cfg.seq}, {args.stages} stages, {args.threads} thread(s)")
    print(f"  build model        {t1 - t0:6.2f} s")
    print(f"  trace              {t2 - t1:6.2f} s   ({len(traced.gm.graph.nodes)} nodes)")
    print(f"  partition          {t3 - t2:6.2f} s   split before {', '.join(points)}")
    print(f"  joint + F/B/W      {t4 - t3:6.2f} s   ({(t4 - t3) / args.stages:.2f} s per stage)")
    print(f"  trace + split      {t4 - t1:6.2f} s")
    if args.report:
        print(report(staged))
    write_results("split_time", dict(stages=args.stages, device=args.device, batch=args.batch, threads=args.threads,
                                     split_points=list(points), nodes=len(traced.gm.graph.nodes),
                                     build_s=t1 - t0, trace_s=t2 - t1, partition_s=t3 - t2, split_s=t4 - t3,
                                     trace_and_split_s=t4 - t1), args.json, default=argv is None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
