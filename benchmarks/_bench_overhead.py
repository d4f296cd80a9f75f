"""Per-action host overhead on a near-zero-compute model (bench_pp.py's section (d)): every schedule of one
side in one process group, timed, then split into model compute, time inside gloo calls and the runtime's own
host work by probe wrappers installed on both runtimes alike. Part of the harness: scripts import
`overhead_worker` from `_harness`."""

from __future__ import annotations

import contextlib
import statistics
import time
import traceback

import torch
import torch.distributed as dist

from _bench_models import make_batch
from _bench_workers import build_ours, build_torch, our_action_counts, torch_action_counts
from _harness import agree, finish, grad_clearer, init_pg, measure_loop, write_record


# ---- per-action overhead on the null model: every schedule in one process group --------------------------
def overhead_worker(rank: int, world: int, cfg: dict, port: int, outdir: str, tag: str,
                    torch_names: list, our_names: list) -> None:
    torch.set_num_threads(1)
    res: dict = {}
    try:
        init_pg(rank, world, port, 60)
        buf = torch.zeros(1)
        t_end = time.perf_counter() + cfg["spin_s"]  # VM start-up transient: spin on ping-pongs first
        while agree(time.perf_counter() < t_end):
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
        write_record(outdir, f"overhead_{tag}_r{rank}.json", res)
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

                zero = grad_clearer(params)
                rec = measure_loop(cfg, step, zero, True)
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
            write_record(outdir, f"overhead_{tag}_r{rank}.json", res)  # after each schedule: partial results survive
    finish(outdir, f"overhead_{tag}_r{rank}.json", res)


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
