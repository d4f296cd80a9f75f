#!/usr/bin/env python
"""Pipeline x data parallel on CPU (4 processes, gloo, dp=2 x pp=2): where the gradient reductions go.

    python benchmarks/bench_dp.py                  # full run (about 10 min on 2 vCPUs)
    python benchmarks/bench_dp.py --quick          # smoke test: 1 round, zbv only
    python benchmarks/bench_dp.py --schedules zbv,zb-h1 --rounds 5 --json out.json

Configurations, each in 4 fresh processes on one 2-D DeviceMesh (dims "dp", "pp"), the same GPT and batch:
  ours-placed  zb.compile(group=mesh): each rank's trailing W's split into 4 gradient groups, each
               group's all-reduce posted right after the op that finishes it (passes/lower/dp_reduce.py),
               waited at the end of the step
  ours-whole   the same placement with the W's left whole and in place (dp_w_pieces=1)
  ours-end     the same programs with every all-reduce posted after the last W (dp_overlap=False)
  ours-nodp    the same pipeline without reductions (group=mesh["pp"], each replica alone): the floor
  ours-sharded dp_shard=True (ZeRO-3 / FSDP2 semantics): parameters DTensor shards over "dp", gathered once per
               step before each stage's first action (dp_gather="step", like FSDP2's reshard_after_forward=False
               below), gradients reduce-scattered where final
  torch-fsdp2  torch.distributed.pipelining with every stage module fully_shard()-ed over "dp" (torchtitan's
               composition), same stages and schedule family
  torch-ddp    torch.distributed.pipelining with every stage module in DistributedDataParallel over "dp"
               (1F1B only: DDP's hooks never see a zero-bubble schedule's deferred W, pytorch#144530)
The reduction's exposed time is (step - ours-nodp's step); hidden = 1 - exposed(placed) / exposed(end).
Each step is timed between barriers on every rank (the slowest rank's time per step), medians over the measured
steps, the best of `--rounds` rounds (every other round in reverse order); compare rows of one run only.

Model: GPT d=256, L=8, heads=4, seq=128, V=8192 (8.5 M parameters, ~17 MB of float32 gradients per pipeline
rank); 8 microbatches of 2 sequences per replica.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import traceback

from tabulate import tabulate

from _harness import (finish, free_port, grad_clearer, init_pg, load, measure_loop, med, spawn, write_results)

CFG = dict(model="gpt", vocab=8192, d=256, layers=8, heads=4, seq=32, seed=0, mbs=1, n_mb=8,
           threads_per_rank=1, warmup=2, warmup_s=3.0, steps=8, max_measure_s=40.0)
TORCH_EQUIV = {"1f1b": "1F1B", "zb-h1": "1F1B", "zbv": "ZBVZeroBubble", "interleaved-1f1b": "Interleaved1F1B"}


def worker(rank: int, world: int, cfg: dict, kind: str, name: str, port: int, outdir: str, tag: str) -> None:
    import torch

    torch.set_num_threads(cfg["threads_per_rank"])
    out: dict = dict(rank=rank, kind=kind, schedule=name)
    try:
        init_pg(rank, world, port)
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "pp"))
        step, params = (_ours if kind.startswith("ours") else _torch)(cfg, kind, name, mesh)
        rec = measure_loop(cfg, step, grad_clearer(params), True)
        rec.pop("extra")
        out.update(rec)
    except Exception as e:  # noqa: BLE001
        out.update(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
    finish(outdir, f"res_{tag}_r{rank}.json", out)


def _local_batch(cfg: dict, mesh):
    """This replica's rows: the global batch is dp x (mbs x n_mb) sequences."""
    from _harness import make_batch

    x, y = make_batch(dict(cfg, n_mb=2 * cfg["n_mb"]))
    d = mesh.get_local_rank("dp")
    return x.chunk(2)[d], y.chunk(2)[d]


def _ours(cfg: dict, kind: str, name: str, mesh):
    import zbcompile
    from _harness import OUR_SCHEDULES, build_model, partition, split_points, stage_to_rank
    from zbcompile.examples.gpt import loss_fn

    spr, style, chunks = OUR_SCHEDULES[name]
    pp = mesh["pp"].size()
    parts = partition(cfg, pp * spr, stage_to_rank(pp, pp * spr, style))
    x, y = _local_batch(cfg, mesh)
    kw = dict(schedule=name, microbatches=cfg["n_mb"], loss_fn=loss_fn, example=(x[:cfg["mbs"]], y[:cfg["mbs"]]),
              split_points=split_points(parts), timeout=300, group=mesh["pp"] if kind == "ours-nodp" else mesh)
    if kind != "ours-nodp":   # (data-parallel options without a "dp" mesh dimension are refused)
        kw.update(dp_batch="local", dp_overlap=kind != "ours-end", dp_w_pieces=1 if kind == "ours-whole" else 4,
                  dp_shard=kind == "ours-sharded")
    if chunks:
        kw["chunks"] = chunks
    pm = zbcompile.compile(build_model(cfg), **kw)
    return (lambda: float(pm.step(x, y))), list(pm.parameters())


def _torch(cfg: dict, kind: str, name: str, mesh):
    import torch
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class

    from _harness import TORCH_SCHEDULES, TorchStage, build_model, partition, stage_to_rank
    from zbcompile.examples.gpt import loss_fn

    spr, style = TORCH_SCHEDULES[name]
    pp, rank = mesh["pp"].size(), mesh.get_local_rank("pp")
    n = pp * spr
    mapping = stage_to_rank(pp, n, style)
    parts = partition(cfg, n, mapping)
    model = build_model(cfg)
    local = [s for s in range(n) if mapping[s] == rank]
    mods = [TorchStage(model, parts[s], False) for s in local]
    if kind == "torch-fsdp2":
        from torch.distributed.fsdp import fully_shard

        mods = [fully_shard(m, mesh=mesh["dp"], reshard_after_forward=False) for m in mods]
    else:
        mods = [torch.nn.parallel.DistributedDataParallel(m, process_group=mesh["dp"].get_group()) for m in mods]
    stages = [PipelineStage(m, s, n, torch.device("cpu"), group=mesh["pp"].get_group()) for m, s in zip(mods, local)]
    sched = get_schedule_class(name)(stages[0] if spr == 1 else stages, n_microbatches=cfg["n_mb"], loss_fn=loss_fn)
    x, y = _local_batch(cfg, mesh)
    first, last = 0 in local, (n - 1) in local

    def step():
        losses = [] if last else None
        sched.step(*((x,) if first else ()), target=y if last else None, losses=losses, return_outputs=False)
        return float(torch.stack([v.detach() for v in losses]).mean()) if last else None
    return step, [p for m in mods for p in m.parameters()]


def run_config(cfg: dict, kind: str, name: str, outdir: str, tag: str) -> dict:
    err = spawn(worker, (4, cfg, kind, name, free_port(), outdir, tag), 4, timeout=900)
    recs = [load(os.path.join(outdir, f"res_{tag}_r{r}.json")) for r in range(4)]
    bad = err or next((r.get("error") for r in recs if r is None or r.get("error")), None) if all(recs) else \
        err or "a rank wrote no record"
    if bad:
        return dict(error=bad)
    per_step = [max(s) for s in zip(*(r["step_s"] for r in recs))]   # the slowest rank's time per step
    return dict(step_ms=1e3 * med(per_step), steps=len(per_step))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--schedules", default="zbv,zb-h1,1f1b")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cfg = dict(CFG)
    schedules = args.schedules.split(",")
    if args.quick:
        schedules, args.rounds, cfg["steps"], cfg["warmup_s"] = ["zbv"], 1, 4, 1.0
    configs = []
    for s in schedules:
        configs += [("ours-nodp", s), ("ours-end", s), ("ours-whole", s), ("ours-placed", s), ("ours-sharded", s)]
        if s in TORCH_EQUIV and ("torch-fsdp2", TORCH_EQUIV[s]) not in configs:
            configs.append(("torch-fsdp2", TORCH_EQUIV[s]))
    if "1f1b" in schedules or "zb-h1" in schedules:
        configs.append(("torch-ddp", "1F1B"))
    outdir = tempfile.mkdtemp(prefix="bench_dp_")
    rounds: dict = {c: [] for c in configs}
    try:
        for k in range(args.rounds):
            for kind, name in (configs if k % 2 == 0 else configs[::-1]):
                res = run_config(cfg, kind, name, outdir, f"{kind}-{name}-{k}")
                print(f"round {k}: {kind:12s} {name:16s} {res}", flush=True)
                rounds[kind, name].append(res)
    finally:
        shutil.rmtree(outdir, ignore_errors=True)
    best = {c: min((r["step_ms"] for r in rs if "step_ms" in r), default=None) for c, rs in rounds.items()}
    rows, summary = [], {}
    for s in schedules:
        floor, end, whole, placed = (best.get((k, s)) for k in ("ours-nodp", "ours-end", "ours-whole", "ours-placed"))
        hidden = _hidden(floor, end, placed)
        sharded = best.get(("ours-sharded", s))
        summary[s] = dict(nodp_ms=floor, end_ms=end, whole_ms=whole, placed_ms=placed, hidden=hidden,
                          sharded_ms=sharded,
                          hidden_whole=_hidden(floor, end, whole),
                          torch_fsdp2_ms=best.get(("torch-fsdp2", TORCH_EQUIV.get(s))),
                          torch_ddp_ms=best.get(("torch-ddp", "1F1B")) if s in ("1f1b", "zb-h1") else None)
        rows.append([s, _ms(floor), _ms(end), _ms(whole), _pct(summary[s]["hidden_whole"]), _ms(placed), _pct(hidden),
                     _ms(sharded), _ms(summary[s]["torch_fsdp2_ms"]), _ms(summary[s]["torch_ddp_ms"]),
                     _ratio(summary[s]["torch_fsdp2_ms"], placed), _ratio(summary[s]["torch_fsdp2_ms"], sharded)])
    print(tabulate(rows, headers=["schedule", "no dp ms", "end-of-step ms", "placed, W whole ms", "hidden",
                                  "placed, W in groups ms", "hidden", "sharded ms",
                                  "torch+FSDP2 ms", "torch+DDP ms", "x torch+FSDP2", "sharded x torch+FSDP2"]))
    errors = {f"{k}/{n}": r["error"] for (k, n), rs in rounds.items() for r in rs if "error" in r}
    for c, e in errors.items():
        print(f"{c}: {e[:300]}")
    write_results("bench_dp", dict(cfg=cfg, rounds={f"{k}/{n}": v for (k, n), v in rounds.items()},
                                   summary=summary, errors=errors), args.json)
    return 0


def _hidden(floor, end, placed):
    """The share of the end-of-step version's exposed reduction time that `placed` hides."""
    if None in (floor, end, placed) or end <= floor:
        return None
    return 1 - max(placed - floor, 0.0) / (end - floor)


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def _ms(v) -> str:
    return "-" if v is None else f"{v:.0f}"


def _ratio(theirs, ours) -> str:
    return "-" if theirs is None or ours is None else f"{theirs / ours:.2f}"


if __name__ == "__main__":
    sys.exit(main())
