"""Process bodies of the pipeline benchmarks (bench_pp.py, bench_vocab.py, bench_offload.py, bench_inductor.py):
one process on the whole batch, torch.distributed.pipelining's schedules and zbcompile's, each building the
same model from one seed. Each configuration runs in fresh (spawned) processes; every worker writes one JSON
record per rank into `outdir` and never raises (errors go into the record). Part of the harness: scripts import
these names from `_harness`."""

from __future__ import annotations

import contextlib
import os
import time
import traceback

import torch
import torch.distributed as dist

import zbcompile
from _bench_models import TorchStage, build_model, make_batch, partition, split_points, stage_to_rank
from _harness import finish, grad_clearer, init_pg, measure_loop, reset_peak_rss, rss_mib, write_record
from zbcompile.examples.gpt import loss_fn

# torch schedule -> (stages per rank, placement style)
TORCH_SCHEDULES = {
    "GPipe": (1, "loop"),
    "1F1B": (1, "loop"),
    "Interleaved1F1B": (2, "loop"),
    "LoopedBFS": (2, "loop"),
    "InterleavedZeroBubble": (2, "loop"),
    "ZBVZeroBubble": (2, "v"),
    "DualPipeV": (2, "v"),
}

# our schedule -> (stages per rank, placement style, chunks argument)
OUR_SCHEDULES = {
    "gpipe": (1, "loop", None),
    "1f1b": (1, "loop", None),
    "zb-h1": (1, "loop", None),
    "zb-h2": (1, "loop", None),
    "zb-auto": (1, "loop", None),
    "interleaved-1f1b": (2, "loop", 2),
    "zbv": (2, "v", None),
    "v-min": (2, "v", None),
    "v-half": (2, "v", None),
    "v-zb": (2, "v", None),
    "dualpipev": (2, "v", None),
}


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


# ---- single process ---------------------------------------------------------------------------------
def single_worker(cfg: dict, mode: str, threads: int, outdir: str, tag: str) -> None:
    torch.set_num_threads(threads)
    out: dict = dict(tag=tag, mode=mode, threads=threads)
    reset_peak_rss()
    try:
        model = build_model(cfg)
        if cfg.get("torch_compile"):
            model = torch.compile(model)
        x, y = make_batch(cfg)
        xs, ys = x.chunk(cfg["n_mb"]), y.chunk(cfg["n_mb"])
        n = cfg["n_mb"]

        def step():
            if mode == "full":
                loss = loss_fn(model(x), y)
                loss.backward()
                return float(loss.detach())
            total = 0.0
            for xi, yi in zip(xs, ys):
                l = loss_fn(model(xi), yi) / n
                l.backward()
                total += float(l.detach())
            return total

        def save_grads(rec):
            if cfg.get("save_grads"):
                torch.save(_grads(model), os.path.join(outdir, f"grads_{tag}.pt"))

        rec = measure_loop(cfg, step, lambda: model.zero_grad(set_to_none=True), False, save_grads)
        rec["loss"] = rec.pop("first")
        rec.pop("extra")
        out.update(rec)
    except Exception as e:  # noqa: BLE001
        out.update(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
    write_record(outdir, f"res_{tag}.json", out)


def probe_worker(idx: int, cfg: dict, seconds: float, outdir: str, tag: str) -> None:
    """A fixed 1-thread workload (fwd+bwd of one microbatch through the whole model), repeated."""
    torch.set_num_threads(1)
    model = build_model(cfg)
    x, y = make_batch(cfg)
    x, y = x[:cfg["mbs"]], y[:cfg["mbs"]]
    ts = []
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t0 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        ts.append(time.perf_counter() - t0)
    write_record(outdir, f"probe_{tag}_{idx}.json", dict(step_s=ts))


# ---- torch.distributed.pipelining --------------------------------------------------------------------
def build_torch(cfg: dict, name: str, rank: int, world: int):
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class

    spr, style = TORCH_SCHEDULES[name]
    S = world * spr
    mapping = stage_to_rank(world, S, style)
    parts = partition(cfg, S, mapping)
    model = build_model(cfg)
    local = [s for s in range(S) if mapping[s] == rank]
    null = cfg["model"] == "null"
    mods = [TorchStage(model, parts[s], null) for s in local]
    if cfg.get("torch_compile"):   # torch.compile'd stage modules (inductor), compiled at their first call
        mods = [torch.compile(m) for m in mods]
    stages = [PipelineStage(m, s, S, torch.device("cpu")) for m, s in zip(mods, local)]
    del model
    cls = get_schedule_class(name)
    sched = cls(stages[0] if spr == 1 else stages, n_microbatches=cfg["n_mb"], loss_fn=loss_fn)
    return sched, stages, local, S, parts


def torch_action_counts(sched, rank: int) -> dict:
    """Actions on this rank as torch's runtime executes them: compute (F/B/I/W) and P2P (send/recv)."""
    from torch.distributed.pipelining.schedules import _ComputationType as CT

    compute_kinds = {CT.FORWARD, CT.FULL_BACKWARD, CT.BACKWARD_INPUT, CT.BACKWARD_WEIGHT}
    comm_kinds = {CT.SEND_F, CT.RECV_F, CT.SEND_B, CT.RECV_B}
    comp = comm = 0
    lowered = getattr(sched, "pipeline_order_with_comms", None)
    if lowered:
        for a in lowered[rank]:
            for s in (a.sub_actions if getattr(a, "sub_actions", None) else (a,)):
                comp += s.computation_type in compute_kinds
                comm += s.computation_type in comm_kinds
        return dict(compute=comp, comm=comm)
    for a in (sched.pipeline_order or {}).get(rank, []):
        if a is not None and a.computation_type in compute_kinds:
            comp += 1
    # single-stage schedules on 2 ranks: one send and one recv per microbatch (fwd on rank 0 / bwd on rank 1)
    return dict(compute=comp, comm=2 * sched._n_microbatches)


def torch_worker(rank: int, world: int, cfg: dict, name: str, port: int, outdir: str, tag: str) -> None:
    torch.set_num_threads(cfg["threads_per_rank"])
    out: dict = dict(rank=rank, schedule=name)
    try:
        init_pg(rank, world, port)
        reset_peak_rss()
        sched, stages, local, S, parts = build_torch(cfg, name, rank, world)
        out.update(local_stages=local, partition=parts)
        x, y = make_batch(cfg)
        first, last = 0 in local, (S - 1) in local
        params = [p for st in stages for p in st.submod.parameters()]

        zero = grad_clearer(params)

        def step():
            losses = [] if last else None
            sched.step(*((x,) if first else ()), target=y if last else None, losses=losses, return_outputs=False)
            return float(torch.stack([l.detach() for l in losses]).mean()) if last else None

        rec = measure_loop(cfg, step, zero, True)
        rec["loss"] = rec.pop("first")
        rec.pop("extra")
        out.update(rec)
        out["actions"] = torch_action_counts(sched, rank)
    except Exception as e:  # noqa: BLE001
        out.update(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
    finish(outdir, f"res_{tag}_r{rank}.json", out)


# ---- zbcompile --------------------------------------------------------------------------------------
def build_ours(cfg: dict, name: str, rank: int, world: int, group=None):
    spr, style, chunks = OUR_SCHEDULES[name]
    S = world * spr
    parts = partition(cfg, S, stage_to_rank(world, S, style))
    model = build_model(cfg)
    x, y = make_batch(cfg)
    mbs = cfg["mbs"]
    kw = dict(schedule=name, microbatches=cfg["n_mb"], loss_fn=loss_fn, example=(x[:mbs], y[:mbs]), pp=world)
    if chunks:
        kw["chunks"] = chunks
    if cfg.get("vocab_parallel"):
        kw["vocab_parallel"] = True
    if cfg.get("offload") is not None:
        kw["offload"] = cfg["offload"]
    if cfg.get("backend") is not None:
        kw["backend"] = cfg["backend"]
    if cfg.get("our_split", "same") == "same" and not cfg.get("vocab_parallel"):
        kw["split_points"] = split_points(parts)
    if group is not None:
        kw["group"] = group
    t0 = time.perf_counter()
    pm = zbcompile.compile(model, **kw)
    return pm, model, parts, time.perf_counter() - t0


def our_action_counts(pm, rank: int) -> dict:
    """Compute actions (F/B/W/BW stage-graph runs) and P2P ops (tensors sent or received) in this rank's
    program (the RankProgram IR the lowering made)."""
    from zbcompile.ir.program.ops import OpKind

    prog = pm.programs[rank]
    comp = comm = 0
    for op in prog.ops:
        if op.kind is OpKind.RUN:
            comp += 1
        elif op.kind in (OpKind.SEND, OpKind.RECV):
            comm += len(op.messages(rank))
    return dict(compute=comp, comm=comm)


def ours_worker(rank: int, world: int, cfg: dict, name: str, port: int, outdir: str, tag: str) -> None:
    torch.set_num_threads(cfg["threads_per_rank"])
    out: dict = dict(rank=rank, schedule=name)
    try:
        init_pg(rank, world, port)
        reset_peak_rss()
        pm, model, parts, compile_s = build_ours(cfg, name, rank, world)
        out.update(partition=parts, compile_s=compile_s, rss_after_compile_mib=rss_mib())
        x, y = make_batch(cfg)
        params = list(pm.parameters())

        zero = grad_clearer(params)

        def step():
            loss = pm.step(x, y)
            ls = getattr(pm, "last_step", None)
            bub = list(ls.bubble) if ls is not None and hasattr(ls, "bubble") else None
            return dict(loss=float(loss), bubble=bub)

        def save_grads(rec):
            if cfg.get("save_grads"):
                torch.save(_grads(model), os.path.join(outdir, f"grads_{tag}_r{rank}.pt"))

        prof = cfg.get("profile_ours")
        rec = measure_loop(cfg, step, zero, True, save_grads)
        rec["loss"] = rec["first"]["loss"]
        rec["bubble"] = [e["bubble"] for e in rec.pop("extra")]
        out.update(rec)
        with contextlib.suppress(Exception):
            out["actions"] = our_action_counts(pm, rank)
        if prof:
            import cProfile
            import pstats

            pr = cProfile.Profile()
            for _ in range(prof):
                zero()
                dist.barrier()
                pr.enable()
                step()
                pr.disable()
            pr.dump_stats(os.path.join(outdir, f"prof_{tag}_r{rank}.pstats"))
            s = pstats.Stats(pr)
            out["profile_steps"] = prof
            out["profile_total_calls"] = s.total_calls
    except Exception as e:  # noqa: BLE001
        out.update(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
    finish(outdir, f"res_{tag}_r{rank}.json", out)
