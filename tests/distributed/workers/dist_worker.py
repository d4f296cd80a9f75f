"""One rank of tests/distributed/test_dist.py, started with the torchrun environment (RANK, WORLD_SIZE,
MASTER_ADDR/PORT).

Loops over every schedule inside the process (process start-up costs seconds) and writes what it saw to
`<out>/rank<r>.json`; the test reads the files and asserts. The last phase kills one rank mid-step.
"""

from __future__ import annotations

import argparse
import copy
import os
import threading
import time
import traceback

import torch

torch.set_num_threads(1)

from support.launch import write_results  # noqa: E402
from support.models import convnet, eager_accumulated, gpt, hf_gpt2, mlp  # noqa: E402

import zbcompile.api as zb  # noqa: E402
from zbcompile.errors import RuntimeFailure, ScheduleError, UsageError  # noqa: E402
from zbcompile.runtime.host import process_threads  # noqa: E402
from zbcompile.passes.schedules import generate  # noqa: E402
from zbcompile.split import split_model  # noqa: E402

SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-auto", "zbv", "v-min", "v-half", "v-zb",
             "dualpipe", "dualpipev"]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def step_batches(x, y, steps: int = 3) -> list:
    """A different batch for every step, so that a runtime reading a stale batch (static input buffers)
    shows up in the parameters after the AdamW steps: inputs and targets paired differently (reordering
    both alike would not do: the batch's mean loss does not depend on the order of its rows)."""
    return [(x, y), (x, y.roll(1, 0)), (x.roll(1, 0), y)][:steps]


def reference(model, loss_fn, batches: list):
    """Eager single-process: loss and grads of the first batch, parameters after one AdamW step per batch.

    eps=1e-3, not 1e-8: where |grad| is near eps Adam's step is grad / (|grad| + eps), so a 1e-8 change
    in a gradient (float summation order across microbatches) moves the parameter by lr * 1e-8 / eps; some
    gradients are even zero in exact arithmetic (the attention key bias) and ~1e-12 noise in floats, which
    eps=1e-8 turns into full steps of random sign. SGD agrees to 1e-8 whatever the eps.
    """
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-3)
    loss = grads = None
    for i, batch in enumerate(batches):
        out = loss_fn(ref(*batch[:1]), *batch[1:])
        out.backward()
        if i == 0:
            loss, grads = out.item(), {n: p.grad.clone() for n, p in ref.named_parameters()}
        opt.step()
        opt.zero_grad()
    return loss, grads, {n: p.detach().clone() for n, p in ref.named_parameters()}


def check_schedules(tag, case, names, pp, m, results, timeout):
    model, loss_fn, (x, y), _ = case
    batches = step_batches(x, y)
    loss_ref, grads_ref, params_ref = reference(model, loss_fn, batches)
    splits = {}
    for name in names:
        t0 = time.perf_counter()
        try:
            sched = generate(name, pp, m)
            n = sched.num_model_stages
            if n not in splits:
                splits[n] = split_model(model, loss_fn, ((x[: x.shape[0] // m],), (y[: y.shape[0] // m],)),
                                        num_stages=n)
            pipe = zb.PipelineModule.from_staged(copy.deepcopy(model), splits[n], sched, timeout=timeout)
            opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2, eps=1e-3)
            losses, grad_err, where = [], 0.0, ""
            for i, batch in enumerate(batches):
                losses.append(pipe.step(*batch))
                if i == 0:
                    for pname, p in pipe.named_parameters():
                        e = rel(p.grad, grads_ref[pname])
                        if e > grad_err:
                            grad_err, where = e, pname
                opt.step()
                pipe.zero_grad()
            param_err = max(rel(p.detach(), params_ref[pname]) for pname, p in pipe.named_parameters())
            results[f"{tag}/{name}"] = dict(loss=losses[0], loss_ref=loss_ref, grad_err=grad_err, where=where,
                                            param_err=param_err, n_params=len(list(pipe.parameters())),
                                            bubble=list(pipe.last_step.bubble),
                                            directed=_directed(pipe),
                                            seconds=time.perf_counter() - t0)
        except Exception:
            results[f"{tag}/{name}"] = dict(error=traceback.format_exc())


def _directed(pipe) -> bool:
    """Messages to and from each peer go through two different process groups (one per direction)."""
    ctx = pipe.runtime.ctx
    peers = [q for q in range(pipe.schedule.num_ranks) if q != pipe.rank]
    return all(ctx.send_pg[q] is not ctx.recv_pg[q] and ctx.send_pg[q] is not ctx.pg for q in peers)


def check_errors(pp, results, timeout):
    model, loss_fn, (x, y), _ = mlp(layers=4, batch=4)
    out = {}
    try:
        zb.compile(copy.deepcopy(model), schedule="1f1b", microbatches=4, loss_fn=loss_fn,
                   example=((x[:1],), (y[:1],)), pp=pp + 1, timeout=timeout)
        out["pp_mismatch"] = "no error"
    except UsageError as e:
        out["pp_mismatch"] = str(e)
    try:
        zb.compile(copy.deepcopy(model), schedule="dualpipe", microbatches=1, loss_fn=loss_fn,
                   example=((x[:1],), (y[:1],)), timeout=timeout)
        out["too_few"] = "no error"
    except ScheduleError as e:
        out["too_few"] = str(e)
    pipe = zb.compile(copy.deepcopy(model), schedule="1f1b", microbatches=4, loss_fn=loss_fn,
                      example=((x[:1],), (y[:1],)), timeout=timeout)
    try:
        pipe.step(torch.cat([x, x[:1]]), torch.cat([y, y[:1]]))
        out["not_divisible"] = "no error"
    except UsageError as e:
        out["not_divisible"] = str(e)
    try:  # 8 rows split into 4 microbatches of 2, but the example was a microbatch of 1
        pipe.step(torch.cat([x, x]), torch.cat([y, y]))
        out["wrong_shape"] = "no error"
    except UsageError as e:
        out["wrong_shape"] = str(e)
    results["errors"] = out


def check_meta(pp, results, timeout):
    """A model built on the meta device: owned parameters materialized and initialized by init_fn."""
    def init_fn(mod):
        with torch.no_grad():
            for i, p in enumerate(mod.parameters(recurse=False)):
                p.copy_(torch.linspace(-0.5, 0.5, p.numel()).view_as(p) * (i + 1))

    model, loss_fn, (x, y), _ = mlp(layers=4, batch=4)
    for mod in model.modules():
        init_fn(mod)
    _, grads_ref, _ = reference(model, loss_fn, [(x, y)])
    with torch.device("meta"):
        meta_model = mlp(layers=4, batch=4).model.to("meta")
    called = []
    pipe = zb.compile(meta_model, schedule="1f1b", microbatches=4, loss_fn=loss_fn, example=((x[:1],), (y[:1],)),
                      init_fn=lambda mod: (called.append(type(mod).__name__), init_fn(mod)), timeout=timeout)
    pipe.step(x, y)
    own = dict(pipe.named_parameters())
    # without init_fn each rank resets its own modules' parameters, drawing from the global generator as much
    # as its share needs: compile leaves the generator as it found it, the same on every rank (a DataLoader
    # shuffled after compile hands every rank the same batches)
    with torch.device("meta"):
        reset = mlp(layers=4, batch=4).model.to("meta")   # (mlp seeds its own init)
    torch.manual_seed(5)
    before = torch.get_rng_state()
    zb.compile(reset, schedule="1f1b", microbatches=4, loss_fn=loss_fn, example=((x[:1],), (y[:1],)), timeout=timeout)
    results["meta"] = dict(
        grad_err=max(rel(p.grad, grads_ref[n]) for n, p in own.items()),
        owned=sorted(own), real=all(not p.is_meta for p in own.values()),
        others_meta=all(p.is_meta for n, p in meta_model.named_parameters() if n not in own),
        init_calls=called, rng_kept=torch.equal(torch.get_rng_state(), before))


def check_training_loop(pp, results, timeout):
    """The loop users write, across processes: a float64 ConvNet (BatchNorm) under zbv: train, evaluate in eval
    mode, train, clip_grad_norm_, AdamW; a vocabulary-parallel GPT under 1f1b: a step and a clip; an inf injected on
    the last rank only: grads_finite() False everywhere. Each value next to eager's."""
    m = 2 * pp
    out = {}
    model, loss_fn, (x, y), _ = convnet(blocks=2 * pp, batch=2 * m)
    model = model.double()
    x = x.double()
    ref = copy.deepcopy(model)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-3)
    pipe = zb.compile(copy.deepcopy(model), schedule="zbv", microbatches=m, loss_fn=loss_fn,
                      example=((x[:2],), (y[:2],)), timeout=timeout)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2, eps=1e-3)
    got, want = [], []
    for k, (xb, yb) in enumerate([(x, y), (x.flip(0), y)]):
        got.append(pipe.train().step(xb, yb))
        want.append(eager_accumulated(ref.train(), loss_fn, xb, yb, m))
        got.append(pipe.clip_grad_norm_(0.1).item())
        want.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1).item())
        opt.step(), opt_ref.step(), opt.zero_grad(), opt_ref.zero_grad()
        got.append(pipe.eval().evaluate(xb, yb))
        with torch.no_grad():
            want.append(sum(loss_fn(ref.eval()(a), b).item() for a, b in zip(xb.chunk(m), yb.chunk(m))) / m)
    refp = dict(ref.named_parameters())
    out["convnet"] = dict(got=got, want=want,
                          param_err=max(rel(p.detach(), refp[n].detach()) for n, p in pipe.named_parameters()))
    model, loss_fn, (x, y), _ = gpt(layers=2 * pp, batch=m)
    model = model.double()
    ref = copy.deepcopy(model)
    want = [eager_accumulated(ref, loss_fn, x, y, m), torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5).item()]
    pipe = zb.compile(copy.deepcopy(model), schedule="1f1b", microbatches=m, loss_fn=loss_fn,
                      example=((x[:1],), (y[:1],)), vocab_parallel=True, timeout=timeout)
    got = [pipe.step(x, y), pipe.clip_grad_norm_(0.5).item()]
    clean = pipe.grads_finite()
    if pipe.rank == pp - 1:
        next(iter(pipe.parameters())).grad.view(-1)[0] = float("inf")
    out["vocab"] = dict(got=got, want=want, clean=clean, finite_after_inf=pipe.grads_finite())
    results["training_loop"] = out


def die_mid_step(pp, results, timeout, victim):
    model, loss_fn, (x, y), _ = mlp(layers=4, batch=8)
    pipe = zb.compile(copy.deepcopy(model), schedule="1f1b", microbatches=8, loss_fn=loss_fn,
                      example=((x[:1],), (y[:1],)), timeout=timeout)
    pipe.step(x, y)  # a healthy step first
    if pipe.rank == victim:
        prog = pipe.rank_program()
        name = next(n for n, _ in prog.named_children() if n.endswith("_b") or n.endswith("_bw"))

        class Die(torch.nn.Module):
            def forward(self, *args):
                os._exit(0)

        setattr(prog, name, Die())
    t0 = time.perf_counter()
    try:
        pipe.step(x, y)
        results["die"] = dict(raised=False, seconds=time.perf_counter() - t0)
    except RuntimeFailure as e:
        results["die"] = dict(raised=True, seconds=time.perf_counter() - t0, message=str(e)[-600:])
        try:   # a retry is refused at once: the groups are unusable, the error says to restart
            pipe.step(x, y)
        except RuntimeFailure as again:
            results["die"]["again"] = str(again)
    except Exception as e:
        results["die"] = dict(raised=False, other=repr(e)[:500], seconds=time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--hf", action="store_true")
    ap.add_argument("--timeout", type=float, default=30.0)
    args = ap.parse_args()
    rank, pp = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    results: dict = {}

    def dump():
        write_results(args.out, rank, results)

    m = 2 * pp
    check_schedules("gpt", gpt(layers=2 * pp, batch=m), SCHEDULES, pp, m, results, args.timeout)
    results["threads"] = {str(t): (os.getpriority(os.PRIO_PROCESS, t), os.sched_getscheduler(t) == os.SCHED_BATCH)
                          for t in process_threads()}
    results["main_tid"] = threading.get_native_id()
    results["one_thread"] = torch.get_num_threads() == 1
    dump()
    if args.hf:
        check_schedules("hf", hf_gpt2(layers=2 * pp, batch=m), ["1f1b", "zbv", "dualpipev"], pp, m, results,
                        args.timeout)
        dump()
    check_errors(pp, results, args.timeout)
    check_meta(pp, results, args.timeout)
    dump()
    try:
        check_training_loop(pp, results, args.timeout)
    except Exception:
        results["training_loop"] = dict(error=traceback.format_exc())
    dump()
    die_mid_step(pp, results, 3.0, victim=pp - 1)
    dump()
    os._exit(0)  # the process group is broken after the kill; skip its teardown


if __name__ == "__main__":
    main()
