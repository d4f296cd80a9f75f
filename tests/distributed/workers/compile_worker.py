"""One rank of tests/distributed/test_compile_paths.py: `zbcompile.compile` as users call it, under the torchrun
environment.

Each case compiles from the plain model (automatic split unless the case says otherwise), runs steps, and
records loss and gradients next to single-process eager microbatch training on the same batch; the test
asserts. Results go to `<out>/rank<r>.json`. The last cases make a peer raise and a peer hang mid-step.
"""

from __future__ import annotations

import argparse
import copy
import os
import time
import traceback

import torch
import torch.distributed as dist

torch.set_num_threads(1)

from support.launch import write_results  # noqa: E402
from support.models import convnet, gpt, mlp  # noqa: E402

import zbcompile.api as zb  # noqa: E402
from zbcompile.errors import RuntimeFailure  # noqa: E402
from zbcompile.simulate import Costs  # noqa: E402


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def eager(model, loss_fn, x, y, m: int):
    """Single-process training over m microbatches, as the pipeline computes it: the mean of the microbatch
    losses, gradients accumulated; returns (loss, grads, model after the step's buffer updates)."""
    ref = copy.deepcopy(model)
    total = 0.0
    for xb, yb in zip(x.chunk(m), y.chunk(m)):
        loss = loss_fn(ref(xb), yb) / m
        loss.backward()
        total += loss.item()
    return total, {n: p.grad for n, p in ref.named_parameters()}, ref


def held(pipe) -> dict:
    """What this rank holds for real: parameter and buffer names (canonical; a tied alias once)."""
    params = sorted(n for n, _ in pipe.named_parameters())
    buffers = sorted(n for n, b in pipe.model.named_buffers() if not b.is_meta)
    return dict(params=params, buffers=buffers)


def run_case(results, key, model, loss_fn, x, y, m, timeout, **options):
    """compile -> one step -> loss and gradient error against eager; what the rank holds."""
    t0 = time.perf_counter()
    try:
        loss_ref, grads_ref, ref = eager(model, loss_fn, x, y, m)
        pipe = zb.compile(copy.deepcopy(model), microbatches=m, loss_fn=loss_fn,
                          example=((x[: x.shape[0] // m],), (y[: y.shape[0] // m],)), timeout=timeout, **options)
        loss = pipe.step(x, y)
        grad_err = max((rel(p.grad, grads_ref[n]) for n, p in pipe.named_parameters()), default=0.0)
        ref_buffers = dict(ref.named_buffers())
        buffer_err = max((rel(b.float(), ref_buffers[n].float()) for n, b in pipe.model.named_buffers()
                          if not b.is_meta and b.is_floating_point()), default=0.0)
        results[key] = dict(loss=loss, loss_ref=loss_ref, grad_err=grad_err, buffer_err=buffer_err,
                            all_params=sorted(n for n, _ in model.named_parameters()),
                            all_buffers=sorted(n for n, _ in model.named_buffers()),
                            tied=[list(g) for g in pipe.staged.tied], schedule=pipe.schedule.name,
                            stages=len(pipe.staged.stages), seconds=time.perf_counter() - t0, **held(pipe))
    except Exception:
        results[key] = dict(error=traceback.format_exc())


class Net(torch.nn.Module):
    """A user's model class, for the decorator form."""

    def __init__(self, width: int = 8, layers: int = 4):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh())
                                             for _ in range(layers)))

    def forward(self, x):
        return self.layers(x)


def decorator_case(results, pp, timeout):
    torch.manual_seed(1)
    x, y = torch.randn(2 * pp, 8), torch.randn(2 * pp, 8)
    loss_fn = torch.nn.functional.mse_loss
    try:
        plain = Net(layers=2 * pp)
        loss_ref, grads_ref, _ = eager(plain, loss_fn, x, y, 2 * pp)
        Compiled = zb.compile(schedule="zb-h1", microbatches=2 * pp, loss_fn=loss_fn,
                              example=((x[:1],), (y[:1],)), timeout=timeout)(Net)
        pipe = Compiled(layers=2 * pp)
        loss = pipe.step(x, y)
        results["decorator"] = dict(loss=loss, loss_ref=loss_ref, kind=type(pipe).__name__,
                                    instance=isinstance(pipe, Compiled),
                                    grad_err=max(rel(p.grad, grads_ref[n]) for n, p in pipe.named_parameters()))
    except Exception:
        results["decorator"] = dict(error=traceback.format_exc())


def different_starts_case(results, pp, timeout):
    """Tied weights held by two ranks whose models start different (another init on every rank): compile
    makes the copies equal to the lowest holder's. The reference is eager training of the model each rank's
    owned values make up (a shared one from its lowest holder)."""
    try:
        case = gpt(layers=2 * pp, batch=2 * pp)
        model, loss_fn, (x, y) = case.model, case.loss_fn, case.example
        torch.manual_seed(100 + dist.get_rank())
        with torch.no_grad():
            for p in model.parameters():   # a different start on every rank
                p.normal_(std=0.05 * (1 + dist.get_rank()))
        pipe = zb.compile(model, schedule="1f1b", microbatches=2 * pp, loss_fn=loss_fn,
                          example=((x[:1],), (y[:1],)), timeout=timeout)
        owned = [None] * pp
        dist.all_gather_object(owned, {n: p.detach().clone() for n, p in pipe.named_parameters()})
        ref = gpt(layers=2 * pp, batch=2 * pp).model
        with torch.no_grad():
            for name, p in ref.named_parameters():
                p.copy_(next(o[name] for o in owned if name in o))   # the lowest holder's value
        holders = {n: [r for r, o in enumerate(owned) if n in o] for n, _ in ref.named_parameters()}
        copies_equal = all(torch.equal(owned[rs[0]][n], owned[r][n]) for n, rs in holders.items() for r in rs)
        loss_ref, grads_ref, _ = eager(ref, loss_fn, x, y, 2 * pp)
        loss = pipe.step(x, y)
        results["different_starts"] = dict(
            loss=loss, loss_ref=loss_ref, copies_equal=copies_equal,
            shared=sorted(n for n, rs in holders.items() if len(rs) > 1),
            grad_err=max(rel(p.grad, grads_ref[n]) for n, p in pipe.named_parameters()))
    except Exception:
        results["different_starts"] = dict(error=traceback.format_exc())


def dropout_case(results, pp, timeout):
    """Dropout in train mode: masks are drawn afresh (the loss differs from the same model without dropout,
    and from one step to the next on the same batch), and a fixed seed repeats the run's losses: each rank's
    program draws in one fixed order, from its process's generator."""
    def losses(p: float, seed: int) -> list[float]:
        case = gpt(layers=2 * pp, dropout=p, batch=2 * pp)
        pipe = zb.compile(case.model, schedule="zbv", microbatches=2 * pp, loss_fn=case.loss_fn,
                          example=((case.example[0][:1],), (case.example[1][:1],)), timeout=timeout)
        torch.manual_seed(seed + dist.get_rank())
        return [pipe.step(*case.example) for _ in range(2)]

    try:
        results["dropout"] = dict(first=losses(0.3, 7), again=losses(0.3, 7), other_seed=losses(0.3, 8),
                                  none=losses(0.0, 7))
    except Exception:
        results["dropout"] = dict(error=traceback.format_exc())


def slow_compile_case(results) -> None:
    """Rank 1 finishes compile 4 s after rank 0 (as inductor building a bigger stage's graphs does), past the
    step's timeout of 2 s: the first step must not count that against the timeout. On a group whose own
    timeout is the step's too, as the default group compile makes under torchrun has: gloo ended compile's
    last wait at the group's timeout, failing compile on every rank."""
    from datetime import timedelta

    model, loss_fn, (x, y), _ = mlp(layers=4, batch=4)
    group = dist.new_group([0, 1], timeout=timedelta(seconds=2.0))
    real = zb.PipelineModule

    def slow(*args, **kwargs):
        pipe = real(*args, **kwargs)
        if pipe.rank == 1:
            time.sleep(4.0)
        return pipe

    try:
        zb.PipelineModule = slow
        try:
            pipe = zb.compile(copy.deepcopy(model), schedule="1f1b", microbatches=4, loss_fn=loss_fn,
                              example=((x[:1],), (y[:1],)), timeout=2.0, group=group)
        finally:
            zb.PipelineModule = real
        results["slow_compile"] = dict(loss=float(pipe.step(x, y)))
    except Exception:
        results["slow_compile"] = dict(error=traceback.format_exc())


def trials_case(results, pp, timeout):
    """A group per trial, as a hyperparameter search makes them: new_group, compile, a step, destroy_process_group,
    three times. Each trial trains as eager, and the process holds as many process groups after each trial as after
    the first (the side groups compile makes over the pipeline's ranks were made per group and kept: 15 open files
    and 9 threads more a trial). (Not with use_local_synchronization=True: torch names such a group by its ranks,
    so each trial's takes the name of the one destroyed before it, and torch alone, making and destroying other
    groups between trials, then connects the fourth to stale addresses.)"""
    from zbcompile._torch_private import live_process_groups

    model, loss_fn, (x, y), _ = mlp(layers=2 * pp, batch=2 * pp)
    loss_ref, grads_ref, _ = eager(model, loss_fn, x, y, 2 * pp)
    held, errs = [], []
    try:
        for trial in range(3):
            group = dist.new_group(list(range(pp)))
            pipe = zb.compile(copy.deepcopy(model), schedule="1f1b", microbatches=2 * pp, loss_fn=loss_fn,
                              example=((x[:1],), (y[:1],)), timeout=timeout, group=group)
            loss = pipe.step(x, y)
            errs.append(max([abs(loss - loss_ref) / abs(loss_ref),
                             *(rel(p.grad, grads_ref[n]) for n, p in pipe.named_parameters())]))
            dist.destroy_process_group(group)
            held.append(len(live_process_groups()))
        results["trials"] = dict(held=held, errs=errs)
    except Exception:
        results["trials"] = dict(error=traceback.format_exc())


def failure_case(results, pp, key, victim, action):
    """One rank's B graph raises (or hangs) in the second step; the others must raise RuntimeFailure naming it."""
    model, loss_fn, (x, y), _ = mlp(layers=4, batch=8)
    pipe = zb.compile(copy.deepcopy(model), schedule="1f1b", microbatches=8, loss_fn=loss_fn,
                      example=((x[:1],), (y[:1],)), timeout=3.0)
    pipe.step(x, y)   # a healthy step first
    if pipe.rank == victim:
        prog = pipe.rank_program()
        name = next(n for n, _ in prog.named_children() if n.endswith(("_b", "_bw")))

        class Fail(torch.nn.Module):
            def forward(self, *args):
                if action == "hang":   # stalls past the others' timeout (3 s), then lets the process end
                    time.sleep(10.0)
                raise ValueError("a bug in the user's model")

        setattr(prog, name, Fail())
    t0 = time.perf_counter()
    try:
        pipe.step(x, y)
        results[key] = dict(raised=None, seconds=time.perf_counter() - t0)
    except RuntimeFailure as e:
        results[key] = dict(raised="RuntimeFailure", message=str(e)[:500], seconds=time.perf_counter() - t0)
    except Exception as e:
        results[key] = dict(raised=type(e).__name__, message=str(e)[:500], seconds=time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--failure", choices=["raise", "hang"], required=True,
                    help="how the last rank fails in the last case (one failure per launch: a broken step "
                         "leaves messages in flight that a later pipeline on the same groups could receive)")
    args = ap.parse_args()
    rank, pp = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    results: dict = {}
    t = args.timeout

    def dump():
        write_results(args.out, rank, results)

    # pp=2 runs every path; pp=4 (4 processes on this 2-core machine, each tracing and splitting) the ones
    # whose placement changes with pp: the V and DualPipe's, interleaving, BatchNorm and the tied copies
    full = pp == 2
    g = gpt(layers=2 * pp, batch=2 * pp)
    for name in ("zbv", "zb-h1", "dualpipev", "v-min") if full else ("zbv", "dualpipev"):   # the automatic split
        run_case(results, f"auto/{name}", g.model, g.loss_fn, *g.example, 2 * pp, t, schedule=name)
    # microbatch counts: not a multiple of pp, and the fewest the schedule takes
    for name, m in (("1f1b", 2 * pp + 1), ("zbv", 1), ("1f1b", 1), ("zb-h2", pp + 1)) if full else (("zbv", 1),):
        gm = gpt(layers=2 * pp, batch=m)
        run_case(results, f"m/{name}/{m}", gm.model, gm.loss_fn, *gm.example, m, t, schedule=name)
    deep = mlp(layers=3 * pp, batch=2 * pp)
    run_case(results, "chunks3", deep.model, deep.loss_fn, *deep.example, 2 * pp, t, schedule="interleaved-1f1b",
             chunks=3)
    if full:
        run_case(results, "split_points", g.model, g.loss_fn, *g.example, 2 * pp, t, schedule="1f1b",
                 split_points=[f"blocks.{i}" for i in range(2, 2 * pp, 2)])
        run_case(results, "zb-auto", g.model, g.loss_fn, *g.example, 2 * pp, t, schedule="zb-auto",
                 costs=Costs(f=1.0, b=1.1, w=0.6, comm=0.05), mem_limit=pp + 1)
        group = dist.new_group(list(range(pp)))
        run_case(results, "subgroup", g.model, g.loss_fn, *g.example, 2 * pp, t, schedule="zbv", group=group)
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (pp,), mesh_dim_names=("pp",))
        run_case(results, "mesh", g.model, g.loss_fn, *g.example, 2 * pp, t, schedule="1f1b", group=mesh)
    c = convnet(blocks=2 * pp, batch=2 * pp)
    for name in ("1f1b", "zbv"):   # BatchNorm: running statistics multi-process
        run_case(results, f"bn/{name}", c.model, c.loss_fn, *c.example, 2 * pp, t, schedule=name)
    decorator_case(results, pp, t)
    different_starts_case(results, pp, t)
    if full:
        dropout_case(results, pp, t)
        slow_compile_case(results)
        trials_case(results, pp, t)
    dump()
    failure_case(results, pp, "failure", victim=pp - 1, action=args.failure)
    dump()
    os._exit(0)   # the process group is broken after the failures; skip its teardown


if __name__ == "__main__":
    main()
