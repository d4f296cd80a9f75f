#!/usr/bin/env python
"""Post-validation on CPU (gloo, pp=2 and pp=4): step-to-step time with the optimizer step inside the pipeline
(`step(..., optimizer=, max_norm=, post_validate=True)`) against the synchronous step (`post_validate=False`),
and the simulator's prediction (`zbcompile plan --step-boundary`) beside it.

    python benchmarks/bench_postval.py                      # full run (about 10 min on 2 vCPUs)
    python benchmarks/bench_postval.py --quick              # smoke test: zbv at pp=2, 2 rounds
    python benchmarks/bench_postval.py --pp 4 --schedules zbv,zb-h2 --rounds 5 --json out.json

Each (pp, schedule) runs in pp fresh processes, one compile, AdamW, max_norm high enough never to clip (the
common case: no rollback). Rounds alternate blocks of `--steps` back-to-back synchronous steps and as many
post-validated ones, with the snapshot rollback and with the closed-form one (post_validate="inverse"; the order
flips every round), each block between two barriers, a post-validated one settled before its closing barrier; a block's time per step is its wall time / steps, medians over the rounds.
No barrier runs between the steps of a block: what one step boundary costs is in the time per step.

Also per rank, from the step's own timing slots: the gap between the end of its last action of one step and
the start of its first action of the next. The target: on the rank that finishes last, post-validation closes
that gap to about the optimizer step's own time (`opt ms`, AdamW on the rank's parameters), where the
synchronous step adds a wait for every other rank and a pipeline-wide exchange.

The prediction: `plan_boundary.boundary_row` on this schedule with the stage times measured from a
synchronous step (`pipe.last_step`, per model stage, means over microbatches), the slowest rank's optimizer time
and no message latency.

Model: GPT d=128, L=8, heads=4, seq=32, V=2048; 2 pp microbatches of 1 sequence (4 at pp=2, 8 at pp=4).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import traceback

from tabulate import tabulate

from _harness import finish, free_port, init_pg, load, med, spawn, write_results

# step(post_validate=...) of each measured mode: synchronous, snapshot rollback, closed-form rollback
MODES = {"sync": False, "post": True, "inverse": "inverse"}
CFG = dict(model="gpt", vocab=2048, d=128, layers=8, heads=4, seq=32, seed=0, mbs=1, threads_per_rank=1,
           steps=6, warmup=2, max_norm=1e6)


def worker(rank: int, world: int, cfg: dict, schedule: str, port: int, outdir: str, tag: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(cfg["threads_per_rank"])
    out: dict = dict(rank=rank, schedule=schedule)
    try:
        init_pg(rank, world, port)
        import zbcompile
        from _harness import build_model, make_batch
        from zbcompile.examples.gpt import loss_fn

        m = 2 * world
        x, y = make_batch(dict(cfg, n_mb=m))
        pipe = zbcompile.compile(build_model(cfg), schedule=schedule, microbatches=m, loss_fn=loss_fn,
                                 example=(x[:cfg["mbs"]], y[:cfg["mbs"]]), timeout=300)
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-4)

        def step(mode: str):
            return pipe.step(x, y, optimizer=opt, max_norm=cfg["max_norm"], post_validate=MODES[mode])

        for mode in MODES:
            for _ in range(cfg["warmup"]):
                step(mode)
        pipe.settle()
        out["opt_ms"] = _optimizer_ms(pipe, opt, x, y)
        pipe.step(x, y)   # a plain step: every rank's action times, for the simulator
        out["actions"] = [list(row) for row in pipe.last_step.actions]
        opt.zero_grad(set_to_none=True)
        blocks: dict = {mode: [] for mode in MODES}
        gaps: dict = {mode: [] for mode in MODES}
        for k in range(cfg["rounds"]):
            for mode in (list(MODES) if k % 2 == 0 else list(MODES)[::-1]):
                dist.barrier()
                spans, t0 = [], time.perf_counter()
                for _ in range(cfg["steps"]):
                    step(mode)
                    spans.append(_span(pipe, mode != "sync"))
                pipe.settle()
                blocks[mode].append((time.perf_counter() - t0) / cfg["steps"])
                gaps[mode] += [b[0] - a[1] for a, b in zip(spans, spans[1:])]
        out.update(blocks=blocks, gap_ms={k: 1e3 * med(v) for k, v in gaps.items()},
                   redone=pipe._pv.boundary.redone)
    except Exception as e:  # noqa: BLE001
        out.update(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
    finish(outdir, f"res_{tag}_r{rank}.json", out)


def _optimizer_ms(pipe, opt, x, y) -> float:
    """The median time of this rank's AdamW step (on real gradients; the parameters are the benchmark's own)."""
    times = []
    for _ in range(3):
        pipe.step(x, y)
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
        opt.zero_grad(set_to_none=True)
    return 1e3 * med(times)


def _span(pipe, post: bool) -> tuple[float, float]:
    """This rank's first action start and last action end of the step that just ran (its own timing slots)."""
    runtime = pipe._pv.last if post else pipe.runtime
    n = len(runtime.names)
    return runtime.ctx.t[0], runtime.ctx.t[2 * n - 1]


def predict(schedule_name: str, pp: int, actions, opt_s: float):
    """The simulator's per-iteration times (synchronous, post-validated), from the measured stage times."""
    from zbcompile.ir.schedule import Action
    from zbcompile.passes.schedules import generate
    from zbcompile.plan_boundary import boundary_row
    from zbcompile.simulate import Costs

    sched = generate(schedule_name, pp, 2 * pp)
    times: dict = {}
    for row in actions:
        for name, start, end in row:
            a = Action.parse(name)
            times.setdefault((sched.model_stage(a.stage), a.kind.value), []).append(end - start)
    per_stage = []
    for s in range(sched.num_model_stages):
        f = med(times.get((s, "F"), [0.0]))
        b = med(times.get((s, "B"), times.get((s, "BW"), [0.0])))
        w = med(times.get((s, "W"), [0.0]))
        per_stage.append((f, b, w))
    return boundary_row(sched, Costs(per_stage=tuple(per_stage)), opt_s)


def run_config(cfg: dict, pp: int, schedule: str, outdir: str) -> dict:
    tag = f"{schedule}-pp{pp}"
    err = spawn(worker, (pp, cfg, schedule, free_port(), outdir, tag), pp, timeout=900)
    recs = [load(os.path.join(outdir, f"res_{tag}_r{r}.json")) for r in range(pp)]
    bad = err or next((r.get("error", "") + r.get("traceback", "") for r in recs if r is None or r.get("error")),
                      None) if all(recs) else err or "a rank wrote no record"
    if bad:
        return dict(error=bad)
    per_mode = {k: [max(b) for b in zip(*(r["blocks"][k] for r in recs))] for k in MODES}
    sync_ms, post_ms, inverse_ms = (1e3 * med(per_mode[k]) for k in MODES)
    actions = recs[0]["actions"]
    last = max(range(pp), key=lambda r: max((e for _, _, e in actions[r]), default=0.0))
    opt_ms = max(r["opt_ms"] for r in recs)
    row = predict(schedule, pp, actions, opt_ms / 1e3)
    return dict(pp=pp, schedule=schedule, sync_ms=sync_ms, post_ms=post_ms, gain=1 - post_ms / sync_ms,
                inverse_ms=inverse_ms, inverse_gain=1 - inverse_ms / sync_ms, last_rank=last,
                gap_sync_ms=recs[last]["gap_ms"]["sync"], gap_post_ms=recs[last]["gap_ms"]["post"],
                gap_inverse_ms=recs[last]["gap_ms"]["inverse"],
                opt_ms=recs[last]["opt_ms"], predicted_sync_ms=1e3 * row.synchronous,
                predicted_post_ms=1e3 * row.post_validated, predicted_gain=row.gain,
                gaps={r: recs[r]["gap_ms"] for r in range(pp)}, blocks_ms={k: [1e3 * v for v in per_mode[k]]
                                                                            for k in per_mode},
                redone=max(r["redone"] for r in recs))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--pp", default="2,4")
    ap.add_argument("--schedules", default="1f1b,zb-h1,zb-h2,zbv")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cfg = dict(CFG, rounds=args.rounds)
    configs = [(int(p), s) for p in args.pp.split(",") for s in args.schedules.split(",")]
    if args.quick:
        configs, cfg["rounds"] = [(2, "zbv")], 2
    outdir = tempfile.mkdtemp(prefix="bench_postval_")
    results = []
    try:
        for pp, s in configs:
            res = run_config(cfg, pp, s, outdir)
            print(f"pp={pp} {s:8s} {({k: v for k, v in res.items() if k not in ('gaps', 'blocks_ms')})}", flush=True)
            results.append(res)
    finally:
        shutil.rmtree(outdir, ignore_errors=True)
    rows = [[r["pp"], r["schedule"], f"{r['sync_ms']:.1f}", f"{r['post_ms']:.1f}", f"{100 * r['gain']:.1f}%",
             f"{r['inverse_ms']:.1f}", f"{100 * r['inverse_gain']:.1f}%", f"{100 * r['predicted_gain']:.1f}%",
             r["last_rank"], f"{r['gap_sync_ms']:.1f}", f"{r['gap_post_ms']:.1f}", f"{r['gap_inverse_ms']:.1f}",
             f"{r['opt_ms']:.1f}"] for r in results if "error" not in r]
    print(tabulate(rows, headers=["pp", "schedule", "sync ms/step", "snapshot ms/step", "gain", "inverse ms/step",
                                  "gain", "predicted gain", "last rank", "its gap: sync", "snapshot", "inverse",
                                  "opt ms"]))
    for r in results:
        if "error" in r:
            print(f"error: {r['error'][:2000]}")
    write_results("bench_postval", dict(cfg=cfg, results=results), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
