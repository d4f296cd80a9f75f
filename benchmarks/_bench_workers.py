"""Process bodies for benchmarks/bench_pp.py. Each configuration runs in fresh (spawned) processes; every
worker writes one JSON result file per rank into `outdir` and never raises (errors go into the file)."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import statistics
import time
import traceback

import torch
import torch.distributed as dist

from _bench_models import (TorchStage, build_model, make_batch, partition, split_points, stage_to_rank,
                           unit_names)
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


# ---- helpers ----------------------------------------------------------------------------------------
def _status(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def _reset_peak_rss() -> None:
    with contextlib.suppress(OSError):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")


def _init_pg(rank: int, world: int, port: int, timeout_s: float = 120.0) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


def _agree(flag: bool) -> bool:
    """Rank 0 decides (so every rank runs the same number of steps)."""
    t = torch.tensor([int(flag)], dtype=torch.int32)
    dist.broadcast(t, src=0)
    return bool(t.item())


def _write(outdir: str, name: str, obj: dict) -> None:
    tmp = os.path.join(outdir, name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, os.path.join(outdir, name))


def _finish(outdir: str, name: str, obj: dict) -> None:
    """A distributed worker's last act: write its record, then leave the process group (errors ignored)."""
    _write(outdir, name, obj)
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def _grad_clearer(params: list):
    """The `zero` callable the measuring loops call between steps: set_to_none on exactly `params`."""
    def zero():
        for p in params:
            p.grad = None
    return zero


def _measure_loop(cfg: dict, step_fn, zero_fn, distributed: bool, after_fn=None) -> dict:
    """Warm up for >= cfg['warmup'] steps AND >= cfg['warmup_s'] seconds, then measure up to cfg['steps']
    steps (at most cfg['max_measure_s'] s, at least 3). Returns step times, the first step's result and RSS."""
    rec: dict = dict(step_s=[], cpu_s=[], extra=[])
    it, measured, measuring = 0, 0, False
    t_start = t_meas = time.perf_counter()
    while True:
        zero_fn()
        if distributed:
            dist.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        out = step_fn()
        dt = time.perf_counter() - t0
        cpu = time.process_time() - c0
        if it == 0:
            rec["first"] = out
            rec["first_step_s"] = dt
            if after_fn is not None:
                after_fn(rec)
        if measuring:
            rec["step_s"].append(dt)
            rec["cpu_s"].append(cpu)
            rec["extra"].append(out)
            measured += 1
            more = measured < cfg["steps"] and (time.perf_counter() - t_meas < cfg["max_measure_s"] or measured < 3)
            if not (_agree(more) if distributed else more):
                break
        else:
            done = it + 1 >= cfg["warmup"] and time.perf_counter() - t_start >= cfg["warmup_s"]
            if _agree(done) if distributed else done:
                measuring = True
                rec["warmup_steps"] = it + 1
                rec["rss_before_measure_mib"] = _status("VmRSS")
                _reset_peak_rss()
                t_meas = time.perf_counter()
        it += 1
    rec["peak_rss_mib"] = _status("VmHWM")
    return rec


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


# ---- single process ---------------------------------------------------------------------------------
def single_worker(cfg: dict, mode: str, threads: int, outdir: str, tag: str) -> None:
    torch.set_num_threads(threads)
    out: dict = dict(tag=tag, mode=mode, threads=threads)
    _reset_peak_rss()
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

        rec = _measure_loop(cfg, step, lambda: model.zero_grad(set_to_none=True), False, save_grads)
        rec["loss"] = rec.pop("first")
        rec.pop("extra")
        out.update(rec)
    except Exception as e:  # noqa: BLE001
        out.update(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
    _write(outdir, f"res_{tag}.json", out)


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
    _write(outdir, f"probe_{tag}_{idx}.json", dict(step_s=ts))


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
        _init_pg(rank, world, port)
        _reset_peak_rss()
        sched, stages, local, S, parts = build_torch(cfg, name, rank, world)
        out.update(local_stages=local, partition=parts)
        x, y = make_batch(cfg)
        first, last = 0 in local, (S - 1) in local
        params = [p for st in stages for p in st.submod.parameters()]

        zero = _grad_clearer(params)

        def step():
            losses = [] if last else None
            sched.step(*((x,) if first else ()), target=y if last else None, losses=losses, return_outputs=False)
            return float(torch.stack([l.detach() for l in losses]).mean()) if last else None

        rec = _measure_loop(cfg, step, zero, True)
        rec["loss"] = rec.pop("first")
        rec.pop("extra")
        out.update(rec)
        out["actions"] = torch_action_counts(sched, rank)
    except Exception as e:  # noqa: BLE001
        out.update(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
    _finish(outdir, f"res_{tag}_r{rank}.json", out)


# ---- zbcompile --------------------------------------------------------------------------------------
def _compile_fn():
    import zbcompile

    fn = getattr(zbcompile, "compile", None)
    if fn is None:
        from zbcompile.api import compile as fn  # noqa: A001
    return fn


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
    pm = _compile_fn()(model, **kw)
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
        _init_pg(rank, world, port)
        _reset_peak_rss()
        pm, model, parts, compile_s = build_ours(cfg, name, rank, world)
        out.update(partition=parts, compile_s=compile_s, rss_after_compile_mib=_status("VmRSS"))
        x, y = make_batch(cfg)
        params = list(pm.parameters())

        zero = _grad_clearer(params)

        def step():
            loss = pm.step(x, y)
            ls = getattr(pm, "last_step", None)
            bub = list(ls.bubble) if ls is not None and hasattr(ls, "bubble") else None
            return dict(loss=float(loss), bubble=bub)

        def save_grads(rec):
            if cfg.get("save_grads"):
                torch.save(_grads(model), os.path.join(outdir, f"grads_{tag}_r{rank}.pt"))

        prof = cfg.get("profile_ours")
        rec = _measure_loop(cfg, step, zero, True, save_grads)
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
    _finish(outdir, f"res_{tag}_r{rank}.json", out)


# ---- per-action overhead on the null model: every schedule in one process group --------------------------
def overhead_worker(rank: int, world: int, cfg: dict, port: int, outdir: str, tag: str,
                    torch_names: list, our_names: list) -> None:
    torch.set_num_threads(1)
    res: dict = {}
    try:
        _init_pg(rank, world, port, 60)
        buf = torch.zeros(1)
        t_end = time.perf_counter() + cfg["spin_s"]  # VM start-up transient: spin on ping-pongs first
        while _agree(time.perf_counter() < t_end):
            for _ in range(20):
                if rank == 0:
                    dist.send(buf, 1)
                    dist.recv(buf, 1)
                else:
                    dist.recv(buf, 0)
                    dist.send(buf, 0)
        n = 200
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)
        res["pingpong_oneway_us"] = (time.perf_counter() - t0) / (2 * n) * 1e6
    except Exception as e:  # noqa: BLE001
        res["error"] = f"{type(e).__name__}: {e}"
        _write(outdir, f"overhead_{tag}_r{rank}.json", res)
        return
    for side, names in (("torch", torch_names), ("ours", our_names)):
        for name in names:
            key = f"{side}:{name}"
            try:
                if side == "torch":
                    sched, stages, local, S, _ = build_torch(cfg, name, rank, world)
                    x, y = make_batch(cfg)
                    first, last = 0 in local, (S - 1) in local
                    params = [p for st in stages for p in st.submod.parameters()]

                    def step(sched=sched, first=first, last=last, x=x, y=y):
                        sched.step(*((x,) if first else ()), target=y if last else None,
                                   losses=[] if last else None, return_outputs=False)

                    acts = torch_action_counts(sched, rank)
                    install = (lambda acc, sched=sched, stages=stages: _install_torch_probes(acc, sched, stages))
                else:
                    pm, _, _, _ = build_ours(cfg, name, rank, world)
                    x, y = make_batch(cfg)
                    params = list(pm.parameters())

                    def step(pm=pm, x=x, y=y):
                        pm.step(x, y)

                    acts = our_action_counts(pm, rank)
                    install = (lambda acc, pm=pm: _install_ours_probes(acc, pm))

                zero = _grad_clearer(params)
                rec = _measure_loop(cfg, step, zero, True)
                rec.pop("extra")
                rec.pop("first")
                rec["actions"] = acts
                rec["split"] = _timed_split(step, zero, cfg.get("split_steps", 40), install,
                                            pm if side == "ours" else None, rank)
                rec.update(_profile_split(step, zero, cfg.get("profile_steps", 10)))
                res[key] = rec
            except Exception as e:  # noqa: BLE001
                res[key] = dict(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
                # a failed schedule may leave P2P in flight; resync before the next one
                with contextlib.suppress(Exception):
                    dist.barrier()
            _write(outdir, f"overhead_{tag}_r{rank}.json", res)  # after each schedule: partial results survive
    _finish(outdir, f"overhead_{tag}_r{rank}.json", res)


# ---- per-action overhead split: compute / communication wait / the runtime's own host work -------------
class _Acc:
    """Accumulators the probe wrappers add to (reset before every step)."""

    __slots__ = ("comp", "comp_cpu", "comm", "comm_cpu", "ncomp", "ncomm")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.comp = self.comp_cpu = self.comm = self.comm_cpu = 0.0
        self.ncomp = self.ncomm = 0


def _wrap(acc: _Acc, fn, kind: str):
    """fn, with its wall time (perf_counter) and the main thread's CPU time in it (thread_time) added to
    acc.comp / acc.comp_cpu (model compute) or acc.comm / acc.comm_cpu (a gloo call: posting a send or
    receive and waking from a wait cost CPU in the backend, which is gloo's cost, not the runtime's).
    Compute's CPU time, not its wall time, is what the CPU overhead subtracts: while gloo's I/O threads
    hold a core, compute's wall time runs ahead of its CPU time."""
    pc, tt = time.perf_counter, time.thread_time
    if kind == "comp":
        def w(*a, **k):
            c0 = tt()
            t0 = pc()
            try:
                return fn(*a, **k)
            finally:
                acc.comp += pc() - t0
                acc.comp_cpu += tt() - c0
                acc.ncomp += 1
    else:
        def w(*a, **k):
            c0 = tt()
            t0 = pc()
            try:
                return fn(*a, **k)
            finally:
                acc.comm += pc() - t0
                acc.comm_cpu += tt() - c0
                acc.ncomm += 1
    return w


# the gloo entry points both runtimes reach: posting (ProcessGroup methods, C++) and waiting (Work.wait, C++)
_PG_METHODS = ("send", "recv", "recv_anysource", "allgather", "allreduce", "broadcast", "barrier", "gather",
               "all_to_all", "alltoall_base")


def _install_comm_probes(acc: _Acc):
    C = torch._C._distributed_c10d
    saved = []
    for cls, names in ((C.ProcessGroup, _PG_METHODS), (C.Work, ("wait",))):
        for n in names:
            if n in cls.__dict__:
                orig = cls.__dict__[n]
                saved.append((cls, n, orig))
                setattr(cls, n, _wrap(acc, orig, "comm"))

    def undo():
        for cls, n, orig in saved:
            setattr(cls, n, orig)
    return undo


def _install_torch_probes(acc: _Acc, sched, stages):
    """torch's model compute: each stage module's forward body (instance-level wrapper of submod.forward,
    which PipelineStage calls through submod.__call__), the schedule's loss_fn, and every autograd engine
    run (torch.autograd._engine_run_backward: backward_one_chunk / backward_input / backward_weight all end
    in it; it includes AccumulateGrad into .grad and the hooks pipelining registers on the graph)."""
    import torch.autograd as ag

    undo = [_wrap_forward(acc, st.submod) for st in stages]
    if getattr(sched, "_loss_fn", None) is not None:
        lf = sched._loss_fn
        sched._loss_fn = _wrap(acc, lf, "comp")
        undo.append(lambda lf=lf: setattr(sched, "_loss_fn", lf))
    eng = ag._engine_run_backward
    ag._engine_run_backward = _wrap(acc, eng, "comp")
    undo.append(lambda: setattr(ag, "_engine_run_backward", eng))

    def run_undo():
        for u in undo:
            u()
    return run_undo


def _install_ours_probes(acc: _Acc, pm):
    """ours' model compute: the forward body of every stage graph (F / B / W / BW GraphModules, the
    children of the rank's generated program), wrapped at the instance like torch's stage modules, and the
    per-microbatch gradient sums (the program's foreach adds): torch does that work in AccumulateGrad inside
    its engine runs, which count as torch's compute, so it counts as compute on both sides."""
    prog = pm.runtime.program
    undo_forwards = [_wrap_forward(acc, m) for _, m in prog.named_children() if isinstance(m, torch.fx.GraphModule)]
    sums = {name: getattr(torch, name) for name in ("_foreach_add", "_foreach_add_")}
    for name, fn in sums.items():  # the generated code looks these up on the torch module per call
        setattr(torch, name, _wrap(acc, fn, "comp"))

    def undo():
        for u in undo_forwards:
            u()
        for name, fn in sums.items():
            setattr(torch, name, fn)
    return undo


def _wrap_forward(acc: _Acc, m: torch.nn.Module):
    """Probe m.forward at the instance; the returned undo puts back what was there (a probe of another
    layer, or nothing)."""
    before = m.__dict__.get("forward")
    m.forward = _wrap(acc, m.forward, "comp")

    def undo():
        if before is None:
            m.__dict__.pop("forward", None)
        else:
            m.forward = before
    return undo


def _wrapper_bias(kind: str, n: int = 20000) -> tuple[float, float]:
    """Host time one probe wrapper of `kind` adds outside its own timed windows, on a no-op: (wall, main-thread
    CPU) seconds per call; the best of 5 runs."""
    acc = _Acc()
    f = _wrap(acc, int, kind)
    best = (float("inf"), float("inf"))
    for _ in range(5):
        acc.reset()
        c0, t0 = time.thread_time(), time.perf_counter()
        for _ in range(n):
            f()
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        inside = acc.comp + acc.comm
        best = min(best, ((wall - inside) / n, (cpu - acc.comp_cpu - acc.comm_cpu) / n))
    return best


def _timed_split(step, zero, n: int, install, pm, rank: int) -> dict:
    """Run `n` more steps with the probes in: per step, wall (perf_counter), the main thread's CPU time
    (thread_time), the process's CPU time (all threads: gloo's I/O threads too), model compute and gloo
    time (sums of the probed calls) and the probed call counts. Ours also gets its runtime's own per-action
    stamps (around each stage-graph forward call and its output unpacking) as a cross-check of the compute probe.

    The probes' own cost is measured in place: interleaved with those steps, `n` steps with every probe
    wrapped a second time (the outer layer records into a discarded accumulator) cost (overhead with two
    layers - with one) / calls more per probed call. Interleaving (one step each way, in turn) keeps the
    machine's drift out of the difference; measured as two blocks of steps, the estimate moved by 1-2 us
    per call from round to round, as much as ours' whole overhead per action moved with it. On a warm
    no-op the two measures agree: one layer costs 1.76-1.82 us outside its own timed window and a second
    layer adds 1.76-1.83 us. In place the cost is higher (about 3 us): between gloo waits the caches are
    cold and the wrapper's own code runs slower there, so the warm no-op figure (_wrapper_bias, kept in the
    record) would leave part of the probes' cost in the overhead."""
    acc, spare = _Acc(), _Acc()
    undo = [_install_comm_probes(acc), install(acc)]
    rec, twice = _new_rec(), _new_rec()
    try:
        for _ in range(2):  # unmeasured steps with the probes in
            zero()
            dist.barrier()
            step()
        for _ in range(n):
            _probed_step(step, zero, acc, pm, rank, rec)
            second = [_install_comm_probes(spare), install(spare)]
            try:
                _probed_step(step, zero, acc, None, rank, twice)
            finally:
                for u in reversed(second):
                    u()
    finally:
        for u in reversed(undo):
            u()
    rec["warm_bias_s"], rec["warm_bias_cpu_s"] = _wrapper_bias("comp")
    rec["warm_comm_bias_s"], rec["warm_comm_bias_cpu_s"] = _wrapper_bias("comm")
    calls = statistics.median([a + b for a, b in zip(rec["ncomp"], rec["ncomm"])])
    for key, cpu in (("bias_s", False), ("bias_cpu_s", True)):
        extra = statistics.median(_outside(twice, cpu)) - statistics.median(_outside(rec, cpu))
        rec[key] = rec["comm_" + key] = extra / calls if calls else 0.0
    return rec


def _outside(rec: dict, cpu: bool) -> list:
    """Per step: time outside the probed windows (wall, or the main thread's CPU time)."""
    if cpu:
        return [t - a - b for t, a, b in zip(rec["tcpu"], rec["comp_cpu"], rec["comm_cpu"])]
    return [t - a - b for t, a, b in zip(rec["wall"], rec["comp"], rec["comm"])]


def _new_rec() -> dict:
    return {k: [] for k in ("wall", "tcpu", "pcpu", "comp", "comp_cpu", "comm", "comm_cpu", "ncomp", "ncomm",
                            "stamp_comp")}


def _probed_step(step, zero, acc: _Acc, pm, rank: int, rec: dict) -> None:
    zero()
    dist.barrier()
    acc.reset()
    c0, p0, t0 = time.thread_time(), time.process_time(), time.perf_counter()
    step()
    t1, c1, p1 = time.perf_counter(), time.thread_time(), time.process_time()
    rec["wall"].append(t1 - t0)
    rec["tcpu"].append(c1 - c0)
    rec["pcpu"].append(p1 - p0)
    rec["comp"].append(acc.comp)
    rec["comp_cpu"].append(acc.comp_cpu)
    rec["comm"].append(acc.comm)
    rec["comm_cpu"].append(acc.comm_cpu)
    rec["ncomp"].append(acc.ncomp)
    rec["ncomm"].append(acc.ncomm)
    if pm is not None:
        ls = pm.last_step
        rec["stamp_comp"].append(sum(e - s for _, s, e in ls.actions[rank]) if ls else None)


def _profile_split(step, zero, n: int) -> dict:
    """cProfile `n` steps; split each step's wall time into gloo calls (C builtins of
    torch._C._distributed_c10d: posting send / recv, waiting, collectives) and the rest (host work: Python,
    dispatch, autograd and the compute itself, which is ~0 on the null model). The rest is wall minus gloo:
    cProfile does not attribute time inside OpOverload calls to any function, so summing tottime would miss it.
    cProfile's per-call cost inflates the host part of call-heavy runtimes (~1 us per Python call): read it
    with the python-call counts."""
    import cProfile
    import pstats

    pr = cProfile.Profile()
    wall = 0.0
    for _ in range(n):
        zero()
        dist.barrier()
        t0 = time.perf_counter()
        pr.enable()
        step()
        pr.disable()
        wall += time.perf_counter() - t0
    st = pstats.Stats(pr)
    comm = calls = 0.0
    for (_file, _line, fname), (_cc, nc, tt, _ct, _callers) in st.stats.items():
        calls += nc
        if "_distributed_c10d" in fname:
            comm += tt
    return dict(prof_step_s=wall / n, prof_comm_s=comm / n, prof_host_s=(wall - comm) / n, prof_calls=calls / n)


def overhead_single_worker(cfg: dict, outdir: str) -> None:
    """The null model in one process, 1 thread, grad accumulation over the same microbatches."""
    single_worker(cfg, "accum", 1, outdir, "null_single")


__all__ = ["TORCH_SCHEDULES", "OUR_SCHEDULES", "single_worker", "probe_worker", "torch_worker", "ours_worker",
           "overhead_worker", "overhead_single_worker", "unit_names"]
