"""One rank of tests/distributed/test_training_loop_dist.py (torchrun environment): the training loops people
write, each against eager single-process training of the same model, computed on every rank:

    eval       a GPT with dropout under zbv: evaluate() and pipe(x) in eval mode, the refusals, a step after them
    shuffle    the same GPT fed by a shuffling DataLoader over 3 epochs: every rank handed the same batches
    dtype/*    float64, bfloat16 and float16 GPTs under zbv: loss and gradients
    autocast   compiled and stepped under torch.autocast(bfloat16)
    scaler     float16 autocast with pipe.grad_scaler(): an overflowing step skipped everywhere, the scale halved
    clip/*     clip_grad_norm_ (2 and inf) with a tied embedding and vocabulary shards, then AdamW
    nan        a NaN in the batch: grads_finite() False on every rank, the step skipped, nothing changed
    moe        transformers' Mixtral with its router load-balancing loss from every stage
    titan      torchtitan's loss (.float() before cross_entropy) with vocab_parallel=True
    cut/*      a CNN in one Sequential, three Linears, a few ops in one forward: 4 stages (zbv at pp=2, 1f1b at 4)
    postval/*  20 AdamW steps with clipping and a NaN step, step(..., post_validate=True) against the synchronous
               step(..., optimizer=, max_norm=) (1f1b, zb-h1, zbv): losses and parameters, bit for bit

Each case writes numbers (ours and eager's) or its error; the test asserts. Writes `<out>/rank<r>.json`.
"""

from __future__ import annotations

import copy
import math

import torch

torch.set_num_threads(1)

from support.launch import run_cases, worker_main  # noqa: E402
from support.loops import (CUT_CASES, NAN_STEP, batches_with_nan, eager_clipped, eager_step,  # noqa: E402
                           median_norm, mixtral_moe, rel, shard_of, titan_loss)
from support.splits import compile_once  # noqa: E402
from support.models import Case, gpt, mlp  # noqa: E402

import zbcompile.api as zb  # noqa: E402
from zbcompile import checkpoint  # noqa: E402
from zbcompile.errors import UsageError  # noqa: E402


def compile_case(case, schedule: str, m: int, dtype=None, **options):
    model, loss_fn, (x, y), _ = case
    if dtype is not None:
        model = model.to(dtype)
        x = x.to(dtype) if x.is_floating_point() else x
    pipe = zb.compile(copy.deepcopy(model), schedule=schedule, microbatches=m, loss_fn=loss_fn,
                      example=((x[:x.shape[0] // m],), (y[:y.shape[0] // m],)), **options)
    return model, loss_fn, x, y, pipe


def grad_err(pipe, ref) -> float:
    """The worst relative gradient error over this rank's parameters (rows of a shard against its rows); inf for
    a gradient present on one side only."""
    refp, worst = dict(ref.named_parameters()), 0.0
    for n, p in pipe.named_parameters():
        if (p.grad is None) != (refp[n].grad is None):
            return math.inf
        if p.grad is not None:
            worst = max(worst, rel(p.grad, shard_of(refp[n].grad, p.grad, pipe.rank)))
    return worst


def param_err(pipe, ref) -> float:
    refp = dict(ref.named_parameters())
    return max(rel(p.detach(), shard_of(refp[n].detach(), p, pipe.rank)) for n, p in pipe.named_parameters())


def refused(fn, match: str) -> bool:
    try:
        fn()
    except UsageError as e:
        return match in str(e)
    return False


def eval_case(pp: int, m: int) -> dict:
    model, loss_fn, x, y, pipe = compile_case(gpt(layers=2 * pp, dropout=0.3, batch=2 * m), "zbv", m)
    ref = copy.deepcopy(model).eval()
    with torch.no_grad():
        want_out = ref(x)
        want = sum(loss_fn(ref(a), b).item() for a, b in zip(x.chunk(m), y.chunk(m))) / m
    got = pipe.eval().evaluate(x, y)
    out = pipe(x)

    def no_grad_step():
        with torch.no_grad():
            pipe.train().step(x, y)

    refusals = [refused(lambda: pipe.eval().step(x, y), "eval mode"), refused(no_grad_step, "no_grad")]
    step = pipe.train().step(x, y)
    return dict(got=got, want=want, holds_outputs=out is not None,
                out_err=None if out is None else rel(out, want_out), refusals=refusals, step=step,
                graded=all(p.grad is not None for p in pipe.parameters()),
                last_stage_ranks=sorted(pipe.schedule.stage_ranks()[-1]))


def shuffle_case(pp: int, m: int, model: str) -> dict:
    """A model with dropout fed by a DataLoader(shuffle=True) for 3 epochs, the same seed on every rank: a GPT
    with dropout in every block under zbv, or an MLP whose only dropout is in its first stage under 1f1b (the
    other ranks run none). Per step a checksum of the batch each rank was handed, the global generator's state
    at the end, and whether two steps on one batch drew other dropout masks."""
    import hashlib

    torch.manual_seed(0)
    if model == "gpt":
        case, schedule = gpt(layers=2 * pp, dropout=0.3, batch=2 * m), "zbv"
    else:
        net = mlp(layers=2 * pp, batch=2 * m)
        layers = [net.model[0], torch.nn.Dropout(0.3), *list(net.model)[1:]]
        case, schedule = net._replace(model=torch.nn.Sequential(*layers)), "1f1b"
    _, loss_fn, x, y, pipe = compile_case(case, schedule, m)
    if model == "gpt":   # token rows of seq + 1: inputs are [:-1], targets [1:]
        rows = torch.cat([torch.cat([x, y[:, -1:]], 1) + k for k in range(3)]) % case.model.cfg.vocab
        split = lambda b: (b[:, :-1], b[:, 1:])   # noqa: E731
    else:                # inputs then targets side by side
        rows = torch.cat([torch.cat([x, y], 1) + k for k in range(3)])
        split = lambda b: (b[:, :x.shape[1]], b[:, x.shape[1]:])   # noqa: E731
    loader = torch.utils.data.DataLoader(rows, batch_size=x.shape[0], shuffle=True)
    sums, weights = [], torch.arange(1, rows.shape[1] + 1, dtype=torch.float64)
    for _ in range(3):
        for batch in loader:
            sums.append(float((batch.double() * weights).sum()))
            pipe.step(*split(batch))
    again = [pipe.step(x, y) for _ in range(2)]
    # eval mode runs no dropout: evaluate() and pipe(x) draw nothing from the global generator, as eager's eval
    # forward; in train mode their dropout draws (one number, as a step)
    state = torch.get_rng_state()
    pipe.eval().evaluate(x, y)
    pipe(x)
    eval_kept = torch.equal(torch.get_rng_state(), state)
    pipe.train().evaluate(x, y)
    return dict(sums=sums, rng=hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest(),
                masks_differ=again[0] != again[1], eval_kept=eval_kept,
                train_drew=not torch.equal(torch.get_rng_state(), state))


def dtype_case(pp: int, m: int, dtype) -> dict:
    model, loss_fn, x, y, pipe = compile_case(gpt(layers=2 * pp, batch=2 * m), "zbv", m, dtype=dtype)
    ref = copy.deepcopy(model)
    want = eager_step(ref, loss_fn, x, y, m)
    got = pipe.step(x, y)
    dtypes = sorted({str(p.grad.dtype) for p in pipe.parameters()})
    return dict(got=got, want=want, grad_err=grad_err(pipe, ref), grad_dtypes=dtypes)


def autocast_case(pp: int, m: int) -> dict:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model, loss_fn, x, y, pipe = compile_case(gpt(layers=2 * pp, batch=2 * m), "1f1b", m)
        ref = copy.deepcopy(model)
        want = eager_step(ref, loss_fn, x, y, m)
        got = pipe.step(x, y)
    outside = refused(lambda: pipe.step(x, y), "compiled under cpu: bfloat16")
    return dict(got=got, want=want, grad_err=grad_err(pipe, ref), refused_outside=outside)


def scaler_case(pp: int, m: int) -> dict:
    """Steps on x, an overflowing batch, x; then an inf put into the last rank's gradients only."""
    with torch.autocast("cpu", dtype=torch.float16):
        model, loss_fn, x, y, pipe = compile_case(mlp(layers=2 * pp, batch=2 * m), "1f1b", m)
    ref = copy.deepcopy(model)
    opt_ref, opt = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(pipe.parameters(), lr=0.1)
    scaler_ref, scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10), pipe.grad_scaler(init_scale=2.0 ** 10)
    got, want = [], []
    for xb in (x, x * 6e4, x):
        with torch.autocast("cpu", dtype=torch.float16):
            want.append(eager_step(ref, loss_fn, xb, y, m, scaler_ref))
            got.append(pipe.step(xb, y, scaler=scaler))
        for s, o, out in ((scaler_ref, opt_ref, want), (scaler, opt, got)):
            s.step(o)
            s.update()
            o.zero_grad()
            out.append(s.get_scale())
    with torch.autocast("cpu", dtype=torch.float16):
        pipe.step(x, y, scaler=scaler)
    if pipe.rank == pipe.schedule.num_ranks - 1:
        next(iter(pipe.parameters())).grad.view(-1)[0] = float("inf")
    kept = [p.detach().clone() for p in pipe.parameters()]
    scaler.step(opt)
    scaler.update()
    stepped = not all(torch.equal(a, p) for a, p in zip(kept, pipe.parameters()))
    return dict(got=got, want=want, param_err=param_err(pipe, ref), stepped_on_inf=stepped,
                scale_after_inf=scaler.get_scale(), scale_before=got[-1])


def clip_case(pp: int, m: int, norm_type: float) -> dict:
    model, loss_fn, x, y, pipe = compile_case(gpt(layers=2 * pp, batch=2 * m), "zbv", m, dtype=torch.float64,
                                              vocab_parallel=True)
    ref = copy.deepcopy(model)
    eager_step(ref, loss_fn, x, y, m)
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5, norm_type).item()
    torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-3).step()
    pipe.step(x, y)
    got = pipe.clip_grad_norm_(0.5, norm_type).item()
    clipped = grad_err(pipe, ref)
    torch.optim.AdamW(pipe.parameters(), lr=1e-2, eps=1e-3).step()
    return dict(got=got, want=want, grad_err=clipped, param_err=param_err(pipe, ref))


def nan_case(pp: int, m: int) -> dict:
    model, loss_fn, x, y, pipe = compile_case(mlp(layers=2 * pp, batch=2 * m), "zbv", m)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    before = [p.detach().clone() for p in pipe.parameters()]
    bad = x.clone()
    bad[-1, 0] = float("nan")   # in the last microbatch only
    pipe.step(bad, y)
    finite = pipe.grads_finite()
    norm = pipe.clip_grad_norm_(1.0).item()
    if finite:
        opt.step()
    opt.zero_grad()
    unchanged = all(torch.equal(a, p) for a, p in zip(before, pipe.parameters()))
    clean = math.isfinite(pipe.step(x, y)) and pipe.grads_finite()
    return dict(finite=finite, norm_is_nan=math.isnan(norm), unchanged=unchanged, clean_after=clean)


def moe_case(pp: int, m: int) -> dict:
    case = mixtral_moe(layers=4, batch=2 * m)
    model, loss_fn, x, y, pipe = compile_case(case, "zbv" if pp == 2 else "1f1b", m)
    ref = copy.deepcopy(model)
    want = eager_step(ref, loss_fn, x, y, m)
    got = pipe.step(x, y)
    routers = [n for n, p in pipe.named_parameters() if ".gate." in n and p.grad is not None]
    return dict(got=got, want=want, grad_err=grad_err(pipe, ref), routers_graded=len(routers))


def titan_case(pp: int, m: int) -> dict:
    model, _, (x, y), _ = gpt(layers=2 * pp, batch=2 * m)
    case = Case(model.double(), titan_loss, (x, y), 0)
    model, loss_fn, x, y, pipe = compile_case(case, "zbv", m, vocab_parallel=True)
    ref = copy.deepcopy(model)
    want = eager_step(ref, loss_fn, x, y, m)
    got = pipe.step(x, y)
    return dict(got=got, want=want, grad_err=grad_err(pipe, ref))


def cut_case(pp: int, m: int, name: str) -> dict:
    model, loss_fn, x, y, pipe = compile_case(CUT_CASES[name](batch=2 * m), "zbv" if pp == 2 else "1f1b", m)
    ref = copy.deepcopy(model)
    want = eager_step(ref, loss_fn, x, y, m)
    got = pipe.step(x, y)
    return dict(got=got, want=want, grad_err=grad_err(pipe, ref), stages=len(pipe.staged.stages),
                cuts=list(pipe.staged.meta["cuts"]["points"]))


def post_validation_case(pp: int, m: int, schedule: str, out: str) -> dict:
    """The same 20 steps synchronous and post-validated, each from a fresh copy of the model (one split). The
    post-validated run ends in a checkpoint saved with its last step still pending (save validates it first),
    loaded into a third pipe: its parameters and AdamW state are the synchronous run's."""
    case = mlp(layers=8, batch=2)
    case = case._replace(model=case.model.double(), example=tuple(t.double() for t in case.example))
    batches = batches_with_nan(case, m)
    max_norm = median_norm(case.model, case.loss_fn, batches, m)
    want_losses, want_norms, _ = eager_clipped(case.model, case.loss_fn, batches, m, max_norm)
    runs = []
    for post_validate in (False, True):
        pipe = compile_once(copy.deepcopy(case.model), schedule=schedule, microbatches=m, loss_fn=case.loss_fn,
                            example=case.example)
        opt = torch.optim.AdamW(pipe.parameters(), lr=0.01)
        results = [pipe.step(x, y, optimizer=opt, max_norm=max_norm, post_validate=post_validate)
                   for x, y in batches]
        if post_validate:
            checkpoint.save(f"{out}/postval-{schedule}", pipe, opt)
        runs.append((results, [p.detach().clone() for p in pipe.parameters()], pipe, opt))
    (sync, sync_params, _, sync_opt), (post, post_params, pipe, _) = runs
    loaded = compile_once(copy.deepcopy(case.model), schedule=schedule, microbatches=m, loss_fn=case.loss_fn,
                          example=case.example)
    loaded_opt = torch.optim.AdamW(loaded.parameters(), lr=0.01)
    checkpoint.load(f"{out}/postval-{schedule}", loaded, loaded_opt)
    moments = [(sync_opt.state[a]["exp_avg"], loaded_opt.state[b]["exp_avg"])
               for a, b in zip(sync_opt.param_groups[0]["params"], loaded_opt.param_groups[0]["params"])]
    return dict(sync=sync, want=want_losses, post=[float(x) for x in post],
                params_equal=all(torch.equal(a, b) for a, b in zip(sync_params, post_params)),
                loaded_equal=all(torch.equal(a, b.detach()) for a, b in zip(sync_params, loaded.parameters()))
                and all(torch.equal(a, b) for a, b in moments),
                clipped=[i for i, x in enumerate(post) if x.clipped], skipped=[i for i, x in enumerate(post) if x.skipped],
                want_clipped=[i for i, n in enumerate(want_norms) if math.isfinite(n) and n > max_norm],
                nan_step=NAN_STEP, redone=pipe._pv.boundary.redone)


def run(rank: int, pp: int, out: str) -> dict:
    m = 2 * pp
    cases = {
        "eval": lambda: eval_case(pp, m),
        "shuffle/gpt": lambda: shuffle_case(pp, m, "gpt"),
        "shuffle/mlp": lambda: shuffle_case(pp, m, "mlp"),
        "dtype/float64": lambda: dtype_case(pp, m, torch.float64),
        "dtype/bfloat16": lambda: dtype_case(pp, m, torch.bfloat16),
        "dtype/float16": lambda: dtype_case(pp, m, torch.float16),
        "autocast": lambda: autocast_case(pp, m),
        "scaler": lambda: scaler_case(pp, m),
        "clip/2": lambda: clip_case(pp, m, 2.0),
        "clip/inf": lambda: clip_case(pp, m, math.inf),
        "nan": lambda: nan_case(pp, m),
        "moe": lambda: moe_case(pp, m),
        "titan": lambda: titan_case(pp, m),
        **{f"cut/{name}": (lambda name=name: cut_case(pp, m, name)) for name in CUT_CASES},
        # every schedule at pp=2; at pp=4 (four processes on this machine's two cores) zbv, the others run threaded
        # there (tests/e2e/test_post_validation.py)
        **{f"postval/{s}": (lambda s=s: post_validation_case(pp, m, s, out))
           for s in (("1f1b", "zb-h1", "zbv") if pp == 2 else ("zbv",))},
    }
    return run_cases(cases)


if __name__ == "__main__":
    worker_main(run)
