"""One rank of tests/distributed/test_data_parallel.py: four processes as a (dp=2, pp=2) DeviceMesh.

    train/<schedule>   a float64 GPT compiled with group=mesh, 3 AdamW steps on global batches: each step's loss,
                       every gradient (this rank's share, against eager's on the global batch) and the parameters
                       after the last step, next to eager single-process training on the same global batches;
                       variants: the reductions at the end of the step (dp_overlap=False), one all-reduce per
                       gradient (dp_bucket_mb=0), each replica handed its own rows (dp_batch="local"),
                       DualPipeV's mirrored stages
    eval               evaluate() and pipe(x) on the global batch, against eager in eval mode (eval/vocab,
                       eval/sharded-vocab: vocabulary-parallel, with replicated and sharded parameters)
    clip               get_total_norm (2, inf, 0, -inf) and clip_grad_norm_ after a step equal eager's on the global
                       batch; a NaN in the gradients of one rank of one replica makes grads_finite() False on every rank
    checkpoint         a save that rank 0 cannot prepare (its path under a file) refused on every rank, replica 1
                       too; then saved at pp=2 x dp=2 (every rank of the job takes part, each replicated item
                       written once), loaded at pp=4 x dp=1 on all four processes and into the plain model in one
                       process (rank 0): the next step equals the uninterrupted run's
    sharded            dp_shard=True (parameters DTensor shards over dp): the train cases (gathered gradients and
                       parameters against eager), both gather policies, vocabulary parallelism, float32 (the one
                       float32 run: the reductions' arithmetic is the replicated one's), the norms (2, inf,
                       0, -inf) and clipping, and a sharded checkpoint loaded at four layouts (two steps after it)
    errors             a mesh without "pp", a 3-D mesh, a batch that does not split into dp x microbatches,
                       dp_shard without a "dp" dimension
    die                last: rank 3 (replica 1's second pipeline rank) dies inside a step, in its trailing W; the
                       others raise RuntimeFailure within their timeout instead of hanging (rank 1 at the wait
                       for its bucket's all-reduce). The victim writes its results before it goes.
"""

from __future__ import annotations

import copy
import json
import os

import torch

torch.set_num_threads(1)

import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

from support.launch import run_cases, worker_main  # noqa: E402
from support.loops import rel, shard_of  # noqa: E402
from support.models import eager_accumulated, gpt  # noqa: E402
from support.splits import compile_once  # noqa: E402

import zbcompile.api as zb  # noqa: E402
from zbcompile import checkpoint  # noqa: E402
from zbcompile.errors import CheckpointError, DisagreementError, RuntimeFailure, UsageError  # noqa: E402

DP, PP, M, STEPS = 2, 2, 4, 3


def batches(k: int):
    g = torch.Generator().manual_seed(100 + k)
    return torch.randint(0, 64, (2 * DP * M, 8), generator=g), torch.randint(0, 64, (2 * DP * M, 8), generator=g)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-3)


def compile_on(mesh, schedule: str, dtype=torch.float64, timeout: float = 120, traced: bool = False, **options):
    """The test GPT compiled on `mesh`; the split made once per schedule in this process (support/splits.py),
    or with `traced` by zb.compile itself."""
    model, loss_fn, (x, y), _ = gpt(layers=4, batch=2)
    model = model.to(dtype)
    pipe = (zb.compile if traced else compile_once)(
        copy.deepcopy(model), schedule=schedule, microbatches=M, loss_fn=loss_fn, example=((x[:2],), (y[:2],)),
        group=mesh, timeout=timeout, **options)
    return model, loss_fn, pipe


def train_case(mesh, schedule: str, local: bool = False, **options) -> dict:
    """local: each replica is handed its own rows of the global batch (dp_batch="local")."""
    model, loss_fn, pipe = compile_on(mesh, schedule, **options, **({"dp_batch": "local"} if local else {}))
    ref, opt = copy.deepcopy(model), adamw(pipe.parameters())
    opt_ref = adamw(ref.parameters())
    refp = dict(ref.named_parameters())
    got, want, grad_errs = [], [], []
    replica = mesh.get_local_rank("dp")
    for k in range(STEPS):
        x, y = batches(k)
        want.append(eager_accumulated(ref, loss_fn, x, y, DP * M))
        got.append(pipe.step(x.chunk(DP)[replica], y.chunk(DP)[replica]) if local else pipe.step(x, y))
        grad_errs.append(max(rel(whole(p.grad), shard_of(refp[n].grad, whole(p.grad), pipe.rank))
                             for n, p in pipe.named_parameters()))
        opt.step(), opt_ref.step(), opt.zero_grad(), opt_ref.zero_grad()
    param_err = max(rel(whole(p.detach()), shard_of(refp[n].detach(), whole(p.detach()), pipe.rank))
                    for n, p in pipe.named_parameters())
    sharded = [type(p).__name__ == "DTensor" for p in pipe.parameters()]
    return dict(got=got, want=want, grad_err=max(grad_errs), param_err=param_err, sharded=all(sharded),
                replicated=not any(sharded))


def postval_case(mesh, schedule: str, **options) -> dict:
    """Six AdamW steps synchronous and post-validated (the prefix chain runs along each replica's pipeline, the
    sharded partial norms summed over the replicas first), max_norm at the median norm so that some steps clip."""
    steps = 6

    def train(max_norm: float, post_validate: bool):
        _, _, pipe = compile_on(mesh, schedule, **options)
        opt = adamw(pipe.parameters())
        out = [pipe.step(*batches(k), optimizer=opt, max_norm=max_norm, post_validate=post_validate)
               for k in range(steps)]
        pipe.settle()
        return out, [whole(p.detach()) for p in pipe.parameters()], pipe
    probe, _, _ = train(1e9, True)
    max_norm = sorted(x.norm for x in probe)[steps // 2]
    (sync, sync_params, _), (post, post_params, pipe) = train(max_norm, False), train(max_norm, True)
    return dict(sync=sync, post=[float(x) for x in post], clipped=sum(x.clipped for x in post),
                params_equal=all(torch.equal(a, b) for a, b in zip(sync_params, post_params)),
                redone=pipe._pv.boundary.redone, sharded=all(type(p).__name__ == "DTensor" for p in pipe.parameters()))


class OddBlock(torch.nn.Module):
    """Parameters whose shards are uneven: 7 and 5 rows over 2 replicas, a bias of one row (the second replica
    holds none of it), a 0-dim temperature (kept whole on every replica)."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.lin = torch.nn.Linear(d_in, d_out)
        self.gate = torch.nn.Parameter(torch.randn(1, d_out))
        self.temperature = torch.nn.Parameter(torch.tensor(0.7))

    def forward(self, x):
        return torch.tanh(self.lin(x) * self.gate / self.temperature)


def odd_case(mesh, gather: str) -> dict:
    """Sharded training of OddBlocks (7 -> 5 -> 7 -> 5 -> 3 features) against eager, 3 AdamW steps, float64."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(OddBlock(7, 5), OddBlock(5, 7), OddBlock(7, 5), OddBlock(5, 3)).double()
    loss_fn = torch.nn.functional.mse_loss
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(2 * DP * M, 7, generator=g, dtype=torch.float64) for _ in range(STEPS)]
    ys = [torch.randn(2 * DP * M, 3, generator=g, dtype=torch.float64) for _ in range(STEPS)]
    pipe = compile_once(copy.deepcopy(model), schedule="zbv", microbatches=M, loss_fn=loss_fn,
                        example=(xs[0][:2], ys[0][:2]), group=mesh, timeout=120, dp_shard=True, dp_gather=gather)
    ref = copy.deepcopy(model)
    opt, opt_ref = adamw(pipe.parameters()), adamw(ref.parameters())
    refp = dict(ref.named_parameters())
    got, want = [], []
    for x, y in zip(xs, ys):
        want.append(eager_accumulated(ref, loss_fn, x, y, DP * M))
        got.append(pipe.step(x, y))
        opt.step(), opt_ref.step(), opt.zero_grad(), opt_ref.zero_grad()
    local_rows = {n: p._local_tensor.shape[0] if p.dim() else None for n, p in pipe.named_parameters()}
    return dict(got=got, want=want, local_rows=local_rows, param_err=max(
        rel(whole(p.detach()), refp[n].detach()) for n, p in pipe.named_parameters()))


def whole(t: torch.Tensor) -> torch.Tensor:
    """A sharded (DTensor) parameter or gradient gathered from the replicas; any other tensor itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def eval_case(mesh, schedule: str = "zbv", **options) -> dict:
    model, loss_fn, pipe = compile_on(mesh, schedule, **options)
    x, y = batches(0)
    ref = copy.deepcopy(model).eval()
    with torch.no_grad():
        want_out = ref(x)
        want = sum(loss_fn(ref(a), b).item() for a, b in zip(x.chunk(DP * M), y.chunk(DP * M))) / (DP * M)
    got = pipe.eval().evaluate(x, y)
    out = pipe(x)
    # a smaller global batch (an evaluation set's last): 3 microbatches of the example's rows per replica
    rows = x.shape[0] // (DP * M) * DP * 3
    xs, ys = x[:rows], y[:rows]
    with torch.no_grad():
        want_small = sum(loss_fn(ref(a), b).item() for a, b in zip(xs.chunk(DP * 3), ys.chunk(DP * 3))) / (DP * 3)
        want_small_out = ref(xs)
    small_out = pipe(xs)
    return dict(got=got, want=want, out_err=None if out is None else rel(out, want_out),
                holds=out is not None, small=(pipe.evaluate(xs, ys), want_small),
                small_out_err=None if small_out is None else rel(small_out, want_small_out))


def eval_uneven_case(mesh, **options) -> dict:
    """dp_batch="local", each replica evaluating its own rows, replica 1 its set's last, smaller batch (3 and 1
    microbatches): the loss is the mean over the 4 microbatches, not the replicas' means averaged; with
    dp_gather="microbatch" (gathers paired microbatch by microbatch) refused on every rank instead of hanging."""
    model, loss_fn, pipe = compile_on(mesh, "zbv", dp_batch="local", **options)
    x, y = batches(0)
    rows, replica = x.shape[0] // (DP * M), mesh.get_local_rank("dp")
    mine = slice(0, 3 * rows) if replica == 0 else slice(3 * rows, 4 * rows)
    with torch.no_grad():
        want = sum(loss_fn(model(a), b).item() for a, b in zip(x[:4 * rows].chunk(4), y[:4 * rows].chunk(4))) / 4
    try:
        return dict(got=pipe.evaluate(x[mine], y[mine]), want=want)
    except UsageError as e:
        return dict(refused=str(e))


def clip_case(mesh, **options) -> dict:
    model, loss_fn, pipe = compile_on(mesh, "zbv", **options)
    ref = copy.deepcopy(model)
    refp = dict(ref.named_parameters())
    x, y = batches(0)
    eager_accumulated(ref, loss_fn, x, y, DP * M)
    pipe.step(x, y)
    # no gradient element exactly 0 (unused embedding rows are): else -inf's min |g| would be 0 whatever the ranks
    # and replicas combine
    for g in [p.grad for p in ref.parameters()] + [p.grad for p in pipe.parameters()]:
        if g is not None:
            getattr(g, "_local_tensor", g).add_(1e-4)
    out = dict(clean=pipe.grads_finite())
    for norm in (2.0, float("inf"), 0.0, -float("inf")):   # -inf: the min |g|, a min over the replicas' rows
        got = pipe.get_total_norm(norm).item()
        want = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()], norm).item()
        out[str(norm)] = (got, want)
    got = pipe.clip_grad_norm_(0.05).item()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    out["clipped"] = (got, max(rel(whole(p.grad), shard_of(refp[n].grad, whole(p.grad), pipe.rank))
                               for n, p in pipe.named_parameters()))
    # a NaN only replica 1's gradients hold (averaging cannot make one, a gradient hook or a bug can): every rank
    # of both replicas must still skip the optimizer step, or the replicas drift apart
    if mesh.get_local_rank("dp") == 1 and mesh.get_local_rank("pp") == 0:
        grad = next(iter(pipe.parameters())).grad
        getattr(grad, "_local_tensor", grad).view(-1)[0] = float("nan")
    out["finite_after_nan"] = pipe.grads_finite()
    return out


def scaler_case(mesh) -> dict:
    """Sharded, with the pipeline's GradScaler: an inf only replica 1's rows of one gradient hold makes every rank
    of both replicas skip the step and halve the scale (the replicas hold different rows: the found-inf is the
    maximum over them too)."""
    _, _, pipe = compile_on(mesh, "zbv", dp_shard=True)
    opt, scaler = adamw(pipe.parameters()), pipe.grad_scaler(init_scale=16.0)
    pipe.step(*batches(0), scaler=scaler)
    if mesh.get_local_rank("dp") == 1 and mesh.get_local_rank("pp") == 0:
        next(iter(pipe.parameters())).grad._local_tensor.view(-1)[0] = float("inf")
    before = [whole(p.detach()).clone() for p in pipe.parameters()]
    scaler.step(opt)
    scaler.update()
    return dict(unchanged=all(torch.equal(a, whole(p.detach())) for a, p in zip(before, pipe.parameters())),
                scale=scaler.get_scale())


def train_and_save(pipe, model, loss_fn, where: str):
    """Two AdamW steps of `pipe` and of an eager copy of `model` on the global batches, then `pipe` saved at
    `where`; (the eager copy, its optimizer) to go on with."""
    opt = adamw(pipe.parameters())
    ref = copy.deepcopy(model)
    opt_ref = adamw(ref.parameters())
    for k in range(2):
        pipe.step(*batches(k))
        opt.step(), opt.zero_grad()
        eager_accumulated(ref, loss_fn, *batches(k), DP * M)
        opt_ref.step(), opt_ref.zero_grad()
    checkpoint.save(where, pipe, opt)
    dist.barrier()
    return ref, opt_ref


def refused_save(pipe, where: str) -> str:
    """checkpoint.save at a path under a file, which rank 0 cannot prepare: the CheckpointError's text on every
    rank ("" where none was raised). Replica 1 writes nothing of its own either way: it waited for replica 0 and
    returned, or waited until its timeout, and a retry then paired its wait with replica 0's next collective."""
    if dist.get_rank() == 0:
        open(where, "w").close()
    dist.barrier()
    try:
        checkpoint.save(f"{where}/ckpt", pipe)
    except CheckpointError as e:
        return str(e)
    return ""


def checkpoint_case(mesh, where: str, **options) -> dict:
    """A save refused on every rank; two steps at pp=2 x dp=2 (zb-h1), save; every rank loads it at pp=4 x dp=1
    and rank 0 into the plain model, and each takes the third step."""
    model, loss_fn, pipe = compile_on(mesh, "zb-h1", **options)
    refused = refused_save(pipe, f"{where}-under-a-file")
    ref, _ = train_and_save(pipe, model, loss_fn, where)
    want = eager_accumulated(ref, loss_fn, *batches(2), DP * M)
    pp4 = zb.compile(copy.deepcopy(model), schedule="zbv", microbatches=2 * DP * M, loss_fn=loss_fn,
                     example=(batches(0)[0][:1], batches(0)[1][:1]), timeout=120)
    opt4 = adamw(pp4.parameters())
    checkpoint.load(where, pp4, opt4)
    got_pp4 = pp4.step(*batches(2))
    out = dict(want=want, got_pp4=got_pp4, refused=refused)
    if dist.get_rank() == 0:
        plain = copy.deepcopy(model)
        plain_opt = adamw(plain.parameters())
        checkpoint.load(where, plain, plain_opt)
        out["got"] = eager_accumulated(plain, loss_fn, *batches(2), DP * M)
    return out


def sharded_checkpoint_case(mesh, where: str, vocab: bool) -> dict:
    """Two steps at pp=2 x dp=2 sharded (every rank writes its rows), save; load at pp=2 x dp=2 sharded and
    replicated, at pp=4 x dp=1 (all four processes) and on rank 0 into the plain model; each takes the third
    and the fourth step (the fourth reads the loaded AdamW state), against the uninterrupted eager run."""
    schedule = "1f1b" if vocab else "zb-h1"
    model, loss_fn, pipe = compile_on(mesh, schedule, dp_shard=True, vocab_parallel=vocab)
    ref, opt_ref = train_and_save(pipe, model, loss_fn, where)
    want = []
    for k in (2, 3):
        want.append(eager_accumulated(ref, loss_fn, *batches(k), DP * M))
        opt_ref.step(), opt_ref.zero_grad()
    layouts = {"sharded": lambda: compile_on(mesh, schedule, dp_shard=True, vocab_parallel=vocab)[2],
               "replicated": lambda: compile_on(mesh, schedule, vocab_parallel=vocab)[2],
               "pp4": lambda: zb.compile(copy.deepcopy(model), schedule="zbv", microbatches=2 * DP * M,
                                         loss_fn=loss_fn, example=(batches(0)[0][:1], batches(0)[1][:1]),
                                         timeout=120)}
    out = dict(want=want)
    for tag, build in layouts.items():
        loaded = build()
        opt2 = adamw(loaded.parameters())
        checkpoint.load(where, loaded, opt2)
        out[tag] = []
        for k in (2, 3):
            out[tag].append(loaded.step(*batches(k)))
            opt2.step(), opt2.zero_grad()
    # a state dict of whole tensors (the plain model's) into a sharded pipe: each replica keeps its rows (of its
    # pipeline rank's rows of a vocabulary table)
    fresh = compile_on(mesh, schedule, dp_shard=True, vocab_parallel=vocab)[2]
    refsd = ref.state_dict()
    fresh.load_state_dict({k: refsd[k] for k in fresh.state_dict()})
    out["load_state_dict"] = max(rel(whole(p.detach()), shard_of(refsd[n], whole(p), fresh.rank))
                                 for n, p in fresh.named_parameters())
    if dist.get_rank() == 0:
        plain = copy.deepcopy(model)
        plain_opt = adamw(plain.parameters())
        checkpoint.load(where, plain, plain_opt)
        out["plain"] = []
        for k in (2, 3):
            out["plain"].append(eager_accumulated(plain, loss_fn, *batches(k), DP * M))
            plain_opt.step(), plain_opt.zero_grad()
    return out


def errors_case(mesh) -> dict:
    out = {}
    for tag, bad in (("no_pp", lambda: init_device_mesh("cpu", (DP, PP), mesh_dim_names=("dp", "tp"))),
                     ("three_d", lambda: init_device_mesh("cpu", (1, DP, PP), mesh_dim_names=("x", "dp", "pp")))):
        try:
            compile_on(bad(), "1f1b", traced=True)
            out[tag] = "compiled"
        except UsageError as e:
            out[tag] = str(e)
    try:
        compile_on(mesh["pp"], "1f1b", dp_shard=True, traced=True)
        out["shard_without_dp"] = "compiled"
    except UsageError as e:
        out["shard_without_dp"] = str(e)
    try:   # replica 1 (ranks 2 and 3) with another bucket size: named, with the ranks' numbers in the job
        compile_on(mesh, "1f1b", dp_bucket_mb=0.0 if mesh.get_local_rank("dp") == 1 else 25.0)
        out["replicas"] = "compiled"
    except DisagreementError as e:
        out["replicas"] = str(e)
    _, _, pipe = compile_on(mesh, "1f1b")
    x, y = batches(0)
    for tag, rows in (("rows", len(x) - 2), ("half", len(x) // 2)):   # (half: one replica's share of rows)
        try:
            pipe.step(x[:rows], y[:rows])
            out[tag] = "stepped"
        except UsageError as e:
            out[tag] = str(e)
    try:   # replica 1 handed another global batch
        pipe.step(*batches(mesh.get_local_rank("dp")))
        out["batches"] = "stepped"
    except DisagreementError as e:
        out["batches"] = str(e)
    return out


def die_case(mesh, results: dict, out: str) -> dict:
    """One healthy step, then rank 3's trailing W exits the process; how every other rank's step ends."""
    _, _, pipe = compile_on(mesh, "zb-h1", timeout=5)
    pipe.step(*batches(0))
    victim = dist.get_rank() == 3
    if victim:
        prog = pipe.rank_program()
        name = [n for n, _ in prog.named_children() if "_w" in n][-1]

        class Die(torch.nn.Module):
            def forward(self, *args):
                with open(os.path.join(out, "rank3.json"), "w") as fh:
                    json.dump(dict(results, die=dict(victim=True)), fh)
                os._exit(0)

        setattr(prog, name, Die())
    try:
        pipe.step(*batches(1))
        return dict(raised=False)
    except RuntimeFailure as e:
        return dict(raised=True, message=str(e)[-800:])


def run(rank: int, pp: int, out: str) -> dict:
    mesh = init_device_mesh("cpu", (DP, PP), mesh_dim_names=("dp", "pp"))
    cases = {f"train/{s}": (lambda s=s: train_case(mesh, s)) for s in ("1f1b", "zb-h1", "zbv", "interleaved-1f1b")}
    cases["train/zb-h1"] = lambda: train_case(mesh, "zb-h1", traced=True)   # one case through zb.compile's path
    cases["train/1f1b-vocab"] = lambda: train_case(mesh, "1f1b", vocab_parallel=True)
    cases["train/zbv-end"] = lambda: train_case(mesh, "zbv", dp_overlap=False)
    cases["train/zb-h1-bucket0"] = lambda: train_case(mesh, "zb-h1", dp_bucket_mb=0)
    cases["train/zbv-local"] = lambda: train_case(mesh, "zbv", local=True)
    cases["train/dualpipev"] = lambda: train_case(mesh, "dualpipev")
    cases["eval"] = lambda: eval_case(mesh)
    cases["eval/vocab"] = lambda: eval_case(mesh, "1f1b", vocab_parallel=True)
    cases["eval/sharded-vocab"] = lambda: eval_case(mesh, "zbv", vocab_parallel=True, dp_shard=True)
    cases["eval/uneven-local"] = lambda: eval_uneven_case(mesh)
    cases["eval/uneven-local-microbatch"] = lambda: eval_uneven_case(mesh, dp_shard=True, dp_gather="microbatch")
    cases["clip"] = lambda: clip_case(mesh)
    cases["checkpoint"] = lambda: checkpoint_case(mesh, f"{out}/ckpt")
    for s in ("1f1b", "zb-h1", "zbv", "interleaved-1f1b"):
        cases[f"train/sharded-{s}"] = lambda s=s: train_case(mesh, s, dp_shard=True)
    cases["train/sharded-1f1b-vocab"] = lambda: train_case(mesh, "1f1b", vocab_parallel=True, dp_shard=True)
    cases["train/sharded-zbv-microbatch"] = lambda: train_case(mesh, "zbv", dp_shard=True, dp_gather="microbatch")
    cases["train/sharded-zbv-float32"] = lambda: train_case(mesh, "zbv", dtype=torch.float32, dp_shard=True)
    cases["clip/sharded"] = lambda: clip_case(mesh, dp_shard=True)
    cases["scaler/sharded"] = lambda: scaler_case(mesh)
    for gather in ("step", "microbatch"):
        cases[f"odd/{gather}"] = lambda gather=gather: odd_case(mesh, gather)
    cases["checkpoint/sharded"] = lambda: sharded_checkpoint_case(mesh, f"{out}/ckpt-sharded", vocab=False)
    cases["checkpoint/sharded-vocab"] = lambda: sharded_checkpoint_case(mesh, f"{out}/ckpt-sharded-v", vocab=True)
    cases["errors"] = lambda: errors_case(mesh)
    cases["postval/zbv"] = lambda: postval_case(mesh, "zbv")
    cases["postval/sharded-zb-h1"] = lambda: postval_case(mesh, "zb-h1", dp_shard=True)
    results = run_cases(cases)
    results["die"] = run_cases({"die": lambda: die_case(mesh, results, out)})["die"]
    return results


if __name__ == "__main__":
    worker_main(run)
