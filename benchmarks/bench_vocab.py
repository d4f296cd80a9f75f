#!/usr/bin/env python
"""Vocabulary parallelism on CPU: the same schedule with and without `vocab_parallel=True`, and torch's ZBV.

    python benchmarks/bench_vocab.py                 # pp=2, about 6 min on 2 vCPUs
    python benchmarks/bench_vocab.py --rounds 1 --json out.json
    python benchmarks/bench_vocab.py --quick         # smoke test: tiny model, 1 round (about 1 min)

Model: zbcompile.examples.gpt.GPT with V=65536, d=256, 4 blocks, 4 heads, seq 128; 8 microbatches of 2
sequences; gloo on 127.0.0.1, 1 thread per rank, pp=2. Its output layer (6·b·s·d·V FLOPs per microbatch)
outweighs the 4 blocks about 5 to 1, so without vocabulary parallelism the rank holding the head is the
bottleneck whatever the schedule; with it every rank does half the vocabulary work (the ideal is about 1.6x).

Configs (fresh processes each, interleaved in every round, the order reversed every other round):
  ours <schedule> +vocab   zb.compile(..., vocab_parallel=True), automatic cuts of the blocks
  ours <schedule>          zb.compile(...), automatic cuts (the balancer weighs the head on the last stage)
  torch ZBVZeroBubble      torch.distributed.pipelining, stages balanced by the same FLOP model
Each step is timed between barriers (max over ranks); the table shows, per config, the median step of the
round with the lowest median (other jobs on this shared machine only ever slow a round down).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from tabulate import tabulate

from _harness import free_port, load, med, ours_worker, spawn, torch_worker, write_results

CONFIGS = (("ours", "zbv", True), ("ours", "zbv", False), ("torch", "ZBVZeroBubble", False),
           ("ours", "1f1b", True), ("ours", "1f1b", False))


def run(cfg: dict, side: str, name: str, vocab: bool, tmp: str, timeout: float) -> dict:
    tag = f"{side}_{name}{'_vocab' if vocab else ''}"
    cfg = dict(cfg, vocab_parallel=vocab)
    for r in range(2):
        path = os.path.join(tmp, f"res_{tag}_r{r}.json")
        if os.path.exists(path):
            os.remove(path)
    os.environ["OMP_NUM_THREADS"] = "1"
    err = spawn(torch_worker if side == "torch" else ours_worker, (2, cfg, name, free_port(), tmp, tag), 2, timeout)
    ranks = [load(os.path.join(tmp, f"res_{tag}_r{r}.json")) or dict(error=err or "no result") for r in range(2)]
    errors = [x["error"] + "\n" + x.get("traceback", "")[-1500:] for x in ranks if x.get("error")]
    if errors:
        return dict(error=errors[0])
    n = min(len(x["step_s"]) for x in ranks)
    return dict(step_s=[max(x["step_s"][i] for x in ranks) for i in range(n)],
                loss=next((x["loss"] for x in ranks if x.get("loss") is not None), None),
                compile_s=max(x.get("compile_s", 0.0) for x in ranks),
                peak_rss_mib=[x.get("peak_rss_mib") for x in ranks])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=None, help="default 2 (--quick: 1)")
    ap.add_argument("--steps", type=int, default=4, help="measured steps per config and round (at least 3)")
    ap.add_argument("--quick", action="store_true", help="smoke test: GPT V=4096, d=64, 2 blocks, seq 32, 1 round")
    ap.add_argument("--json", default=None, help="write the results here instead of benchmarks/results/")
    ap.add_argument("--timeout", type=float, default=600.0)
    args = ap.parse_args(argv)
    cfg = dict(model="gpt", d=256, layers=4, heads=4, seq=128, vocab=65536, mbs=2, n_mb=8, seed=0,
               threads_per_rank=1, warmup=1, warmup_s=0.0, steps=args.steps, max_measure_s=60.0,
               our_split="auto", split="balanced")
    if args.quick:
        cfg.update(d=64, layers=2, seq=32, vocab=4096, steps=3)
    rounds_n = args.rounds or (1 if args.quick else 2)
    tmp = tempfile.mkdtemp(prefix="bench_vocab_", dir="/tmp")
    started = time.time()
    rounds: dict[str, list] = {}
    for rnd in range(rounds_n):
        order = CONFIGS if rnd % 2 == 0 else tuple(reversed(CONFIGS))
        for side, name, vocab in order:
            res = run(cfg, side, name, vocab, tmp, args.timeout)
            key = f"{side} {name}{' +vocab' if vocab else ''}"
            rounds.setdefault(key, []).append(res)
            ms = 1e3 * med(res.get("step_s", []))
            print(f"[{time.time() - started:6.0f}s] round {rnd} {key}: {ms:.0f} ms/step "
                  f"{res.get('error', '')[:2000]}", flush=True)
    best = {k: min((1e3 * med(r["step_s"]) for r in rs if "step_s" in r), default=float("nan"))
            for k, rs in rounds.items()}
    rows = []
    for side, name, vocab in CONFIGS:
        key = f"{side} {name}{' +vocab' if vocab else ''}"
        plain = best.get(f"{side} {name}")
        loss = next((r["loss"] for r in rounds[key] if r.get("loss") is not None), None)
        rows.append([key, f"{best[key]:.0f}", f"{plain / best[key]:.2f}x" if vocab and plain else "",
                     f"{best['torch ZBVZeroBubble'] / best[key]:.2f}x", f"{loss:.4f}" if loss is not None else "",
                     f"{max((r.get('compile_s', 0.0) for r in rounds[key]), default=0.0):.1f}"])
    print(tabulate(rows, headers=["config", "ms/step", "vs without vocab", "vs torch ZBV", "loss", "compile s"]))
    write_results("bench_vocab", dict(cfg=cfg, rounds=rounds, best_ms=best), args.json, default=argv is None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
