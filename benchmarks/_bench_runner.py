"""The driver of the pipeline benchmarks: each configuration in fresh processes, the records read back, one
process for a reference, a parallel-capacity probe of the machine, and section (d) of bench_pp.py (per-action
host overhead). `Runner(args)` needs args.quick, warmup_s, steps, max_measure_s, our_split, profile, timeout.
Part of the harness: scripts import `Runner` from `_harness`."""

from __future__ import annotations

import os
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

from _bench_overhead import overhead_worker
from _bench_workers import ours_worker, probe_worker, single_worker, torch_worker
from _harness import free_port, load, med, proc, spawn


def grad_diff(ref: dict, got: dict) -> tuple[float, float, list]:
    mx = mref = 0.0
    missing = []
    for n, g in ref.items():
        if n not in got:
            missing.append(n)
            continue
        mx = max(mx, float((got[n] - g).abs().max()))
        mref = max(mref, float(g.abs().max()))
    return mx, (mx / mref if mref else float("nan")), missing


def split_summary(splits: list, nacts: list, bias: tuple[float, float]) -> dict:
    """Per-action split of the probed steps (see _bench_overhead._timed_split), all ranks together: for each
    step i, sum over ranks of the part / sum over ranks of the actions; the median over steps. Also each
    rank's own median. The probe wrappers' own cost (calls x `bias`, (wall, CPU) seconds per probed call,
    measured in place) is taken off the overhead."""
    n = min(len(sp["wall"]) for sp in splits)
    tot = sum(nacts)

    def parts(sp, i):
        wall_bias = bias[0] * (sp["ncomp"][i] + sp["ncomm"][i])
        cpu_bias = bias[1] * (sp["ncomp"][i] + sp["ncomm"][i])
        return dict(wall=sp["wall"][i], comp=sp["comp"][i], comm=sp["comm"][i],
                    ovh_wall=sp["wall"][i] - sp["comp"][i] - sp["comm"][i] - wall_bias,
                    ovh_cpu=sp["tcpu"][i] - sp["comp_cpu"][i] - sp["comm_cpu"][i] - cpu_bias,
                    ovh_pcpu=sp["pcpu"][i] - sp["comp_cpu"][i] - cpu_bias,
                    calls=sp["ncomp"][i] + sp["ncomm"][i])

    keys = ("wall", "comp", "comm", "ovh_wall", "ovh_cpu", "ovh_pcpu", "calls")
    all_steps = [[parts(sp, i) for sp in splits] for i in range(n)]
    res = {k: 1e6 * med([sum(p[k] for p in step) / tot for step in all_steps]) for k in keys}
    res["calls"] /= 1e6
    per_rank = {k: [(1e6 if k != "calls" else 1.0) * med([step[r][k] for step in all_steps]) / nacts[r]
                    for r in range(len(splits))] for k in keys}
    out = dict(split_us_per_action=res, split_per_rank=per_rank, split_steps=n,
               probe_bias_us=1e6 * med([sp["bias_s"] for sp in splits]),
               probe_bias_cpu_us=1e6 * med([sp["bias_cpu_s"] for sp in splits]),
               used_bias_us=(1e6 * bias[0], 1e6 * bias[1]),
               warm_bias_us=1e6 * med([sp.get("warm_comm_bias_s", float("nan")) for sp in splits]))
    if splits[0].get("stamp_comp") and all(v is not None for v in splits[0]["stamp_comp"]):
        out["stamp_comp_us_per_action_r0"] = 1e6 * med(splits[0]["stamp_comp"]) / nacts[0]
    return out


# ---- the driver -----------------------------------------------------------------------------------------
class Runner:
    """Runs configurations of the pipeline benchmarks; `report` collects what they measured."""

    def __init__(self, args):
        self.args = args
        self.world = 2
        self.cfg = dict(model="gpt", d=256, layers=8, heads=4, seq=128, vocab=8192, mbs=2, n_mb=8, seed=0,
                        threads_per_rank=1, warmup=2, warmup_s=args.warmup_s, steps=args.steps,
                        max_measure_s=args.max_measure_s, our_split=args.our_split, split="balanced")
        if args.quick:
            self.cfg.update(d=64, layers=4, seq=32, vocab=512, mbs=1, warmup=1, warmup_s=0.3, steps=3,
                            max_measure_s=1.0)
        self.tmp = tempfile.mkdtemp(prefix="bench_pp_", dir="/tmp")
        self.T0 = time.time()
        self.report: dict = dict(torch=torch.__version__, python=sys.version.split()[0], cfg=self.cfg,
                                 world=self.world, cpu_count=os.cpu_count(), argv=sys.argv[1:],
                                 started=time.strftime("%Y-%m-%d %H:%M:%S"))
        self.tokens = self.cfg["mbs"] * self.cfg["n_mb"] * self.cfg["seq"]

    def log(self, msg: str) -> None:
        print(f"[{time.time() - self.T0:6.1f}s] {msg}", flush=True)

    # -- pieces --
    def probe(self, tag: str) -> dict:
        secs = 0.6 if self.args.quick else 2.5
        proc(probe_worker, (0, self.cfg, secs, self.tmp, tag + "_alone"), 120, {"OMP_NUM_THREADS": "1"})
        os.environ["OMP_NUM_THREADS"] = "1"
        ps = [mp.get_context("spawn").Process(target=probe_worker, args=(i, self.cfg, secs, self.tmp, tag + "_pair"))
              for i in range(2)]
        for p in ps:
            p.start()
        for p in ps:
            p.join(120)

        def tail(v):  # the first 30% of samples are the VM's start-up transient
            return v[int(len(v) * 0.3):] or v

        try:
            alone = med(tail(load(os.path.join(self.tmp, f"probe_{tag}_alone_0.json"))["step_s"]))
            pair = [med(tail(load(os.path.join(self.tmp, f"probe_{tag}_pair_{i}.json"))["step_s"])) for i in range(2)]
        except (TypeError, KeyError):
            return dict(error="probe failed")
        res = dict(alone_ms=1e3 * alone, pair_ms=[1e3 * p for p in pair], capacity=sum(alone / p for p in pair))
        self.log(f"probe {tag}: alone {res['alone_ms']:.1f} ms, pair {[round(v, 1) for v in res['pair_ms']]} ms "
                 f"-> parallel capacity {res['capacity']:.2f} cores")
        return res

    def run_single(self, tag: str, mode: str, threads: int, rnd: int) -> dict:
        cfg = dict(self.cfg, save_grads=(rnd == 0 and tag == "single_2t_full"))
        err = proc(single_worker, (cfg, mode, threads, self.tmp, tag), 300, {"OMP_NUM_THREADS": str(threads)})
        res = load(os.path.join(self.tmp, f"res_{tag}.json")) or dict(error=err or "no result")
        self.log(f"round {rnd} {tag}: {1e3 * med(res.get('step_s', [])):.1f} ms/step {res.get('error', '')}")
        return res

    def run_pp(self, side: str, name: str, rnd: int) -> dict:
        tag = f"{side}_{name}"
        cfg = dict(self.cfg, save_grads=(rnd == 0 and side == "ours"), profile_ours=self.args.profile)
        fn = torch_worker if side == "torch" else ours_worker
        for r in range(self.world):
            p = os.path.join(self.tmp, f"res_{tag}_r{r}.json")
            if os.path.exists(p):
                os.remove(p)
        os.environ["OMP_NUM_THREADS"] = "1"
        err = spawn(fn, (self.world, cfg, name, free_port(), self.tmp, tag), self.world, self.args.timeout)
        ranks = [load(os.path.join(self.tmp, f"res_{tag}_r{r}.json")) or dict(error=err or "no result")
                 for r in range(self.world)]
        rr: dict = dict(per_rank=ranks)
        errs = [x["error"] for x in ranks if x.get("error")]
        if errs or err:
            rr["error"] = errs[0] if errs else err
            tb = next((x.get("traceback") for x in ranks if x.get("traceback")), "")
            self.log(f"round {rnd} {tag}: ERROR {rr['error'][:300]}\n{tb[-1500:]}")
            return rr
        n = min(len(x["step_s"]) for x in ranks)
        rr["step_s"] = [max(x["step_s"][i] for x in ranks) for i in range(n)]
        rr["cpu_s"] = [sum(x["cpu_s"][i] for x in ranks) for i in range(n)]  # CPU time of all ranks
        rr["loss"] = next((x["loss"] for x in ranks if x.get("loss") is not None), None)
        if side == "ours":
            bub = [b for x in ranks[:1] for b in x.get("bubble", []) if b]
            rr["bubble"] = [med([b[r] for b in bub]) for r in range(self.world)] if bub else None
            rr["compile_s"] = max(x.get("compile_s", 0.0) for x in ranks)
            if rnd == 0:
                self.check_grads(tag, rr)
        extra = f" loss {rr['loss']:.6f}" if rr.get("loss") is not None else ""
        if rr.get("bubble"):
            extra += " bubble " + "/".join(f"{b:.1%}" for b in rr["bubble"])
        self.log(f"round {rnd} {tag}: {1e3 * med(rr['step_s']):.1f} ms/step{extra}")
        return rr

    def check_grads(self, tag: str, rr: dict) -> None:
        ref_p = os.path.join(self.tmp, "grads_single_2t_full.pt")
        if not os.path.exists(ref_p):
            return
        ref = torch.load(ref_p)
        got: dict = {}
        for r in range(self.world):
            p = os.path.join(self.tmp, f"grads_{tag}_r{r}.pt")
            if os.path.exists(p):
                for k, v in torch.load(p).items():
                    got.setdefault(k, v)
                os.remove(p)
        mx, rel, missing = grad_diff(ref, got)
        rr.update(grad_max_abs_diff=mx, grad_rel_diff=rel, grad_missing=missing)

    def overhead(self, torch_names: list, our_names: list, reverse: bool = False) -> dict:
        ocfg = dict(self.cfg, model="null", d=4, layers=4, heads=1, seq=1, vocab=8, mbs=1, n_mb=16, warmup=3,
                    warmup_s=0.3 if self.args.quick else 1.0, steps=30, max_measure_s=1.0 if self.args.quick else 2.5,
                    spin_s=0.5 if self.args.quick else 2.0, split="even", our_split="same", save_grads=False)
        out: dict = dict(cfg=ocfg)
        splits: dict = {}
        os.environ["OMP_NUM_THREADS"] = "1"
        sides = (("torch", torch_names), ("ours", our_names))
        for side, names in reversed(sides) if reverse else sides:
            if not names:
                continue
            tag = f"ov_{side}"
            err = spawn(overhead_worker, (self.world, ocfg, free_port(), self.tmp, tag,
                                          names if side == "torch" else [], names if side == "ours" else []),
                        self.world, self.args.timeout * 2)
            per_rank = [load(os.path.join(self.tmp, f"overhead_{tag}_r{r}.json")) or {} for r in range(self.world)]
            out.setdefault("pingpong_oneway_us", per_rank[0].get("pingpong_oneway_us"))
            for name in names:
                key = f"{side}:{name}"
                rs = [x.get(key, dict(error=err or "no result")) for x in per_rank]
                e = next((x["error"] for x in rs if x.get("error")), None)
                if e or not all(x.get("step_s") for x in rs):
                    out[key] = dict(error=e or err or "no steps")
                    self.log(f"overhead {key}: ERROR {out[key]['error'][:300]}")
                    continue
                n = min(len(x["step_s"]) for x in rs)
                step = med([max(x["step_s"][i] for x in rs) for i in range(n)])
                acts = [x["actions"] for x in rs]
                nact = max(a["compute"] + a["comm"] for a in acts)
                ncomp = max(a["compute"] for a in acts)
                out[key] = dict(step_s=step, actions=acts, us_per_action=1e6 * step / nact,
                                us_per_compute=1e6 * step / ncomp)
                if "prof_host_s" in rs[0]:  # rank 0's profile: host time outside gloo, per action
                    out[key].update(host_us_per_action=1e6 * rs[0]["prof_host_s"] / nact,
                                    comm_us_per_action=1e6 * rs[0]["prof_comm_s"] / nact,
                                    calls_per_action=rs[0]["prof_calls"] / nact)
                if all(x.get("split") for x in rs):
                    splits[key] = ([x["split"] for x in rs], [a["compute"] + a["comm"] for a in acts])
                self.log(f"overhead {key}: {1e3 * step:.2f} ms/step, {acts[0]['compute']}+{acts[0]['comm']} actions "
                         f"r0 -> {out[key]['us_per_action']:.0f} us/action")
        # the probes are the same code in both runtimes: one in-place cost per call for the round, the median
        # of every schedule's and rank's own estimate (each alone moves by +-1 us)
        bias = (med([sp["bias_s"] for sps, _ in splits.values() for sp in sps] or [0.0]),
                med([sp["bias_cpu_s"] for sps, _ in splits.values() for sp in sps] or [0.0]))
        for key, (sps, nacts) in splits.items():
            out[key].update(split_summary(sps, nacts, bias))
            sp = out[key]["split_us_per_action"]
            self.log(f"overhead {key}: runtime host us/action: wall {sp['ovh_wall']:.1f}, CPU {sp['ovh_cpu']:.1f} "
                     f"(compute {sp['comp']:.1f}, gloo {sp['comm']:.1f}; probe cost {1e6 * bias[0]:.2f} us/call)")
        err = proc(single_worker, (dict(ocfg, steps=20), "accum", 1, self.tmp, "null_single"), 120,
                   {"OMP_NUM_THREADS": "1"})
        out["single"] = load(os.path.join(self.tmp, "res_null_single.json")) or dict(error=err)
        return out

    # -- the whole run --
