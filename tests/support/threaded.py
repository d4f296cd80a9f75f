"""Run every rank's program of a schedule as threads of this process (a LoopbackWorld instead of torch.distributed).

This checks the lowering end to end — P2P matching, gradient accumulation and the shared-gradient sums —
without starting processes; tests/distributed/test_dist.py runs the same under torch.distributed.
"""

from __future__ import annotations

import copy
import threading

import torch

from zbcompile.compiler import compile_staged, split_for
from zbcompile.options import CompileOptions
from zbcompile.passes.lower import OffloadChoice, emit_fx
from zbcompile.passes.schedules import generate
from zbcompile.runtime.loopback import LoopbackWorld, rank_runtime


def run_threaded(model, staged, schedule, batch, *, timeout: float = 30.0, patch=None, then=(),
                 staged_inputs: bool = True, offload=None, device: str = "cpu", measure: bool | str = False,
                 backend: str | None = None, capture: bool = False, replicas: int = 1, **dp_options):
    """One step on `batch` (inputs then targets), then one on each batch of `then`, gradients accumulating;
    returns (last losses per rank, models per rank, runtimes). `patch(rank, program)` may instrument a rank's
    GraphModule before it runs. staged_inputs=False makes the runtime cut every batch into fresh microbatch
    slices even where the lowering found static input buffers safe. offload: an OffloadChoice for every rank or
    one per rank (activation offload as given, not planned).
    device: where every rank runs (the model and batch must be there already). measure: each rank's last step
    is measured (RankRuntime.measure_step; measure="tracker": by the storage tracker on any device), kept as
    `runtime.measured`. backend: compile's (the stage graphs' compiler). capture: lowered for CUDA-graph capture
    (CAPTURE_FINISHING), run eagerly. replicas: lowered for that many data-parallel replicas and run as the only
    one (its reductions average over itself); dp_options: CompileOptions' dp_* (dp_shard=True: the sharded
    programs, each gather and reduce-scatter over the one replica). The programs are the compiler's
    (zbcompile.compiler.compile_staged)."""
    pp = schedule.num_ranks
    options = CompileOptions(schedule=schedule, microbatches=schedule.num_microbatches, backend=backend,
                             cuda_graphs=capture, **dp_options)
    choices = None if offload is None else (offload,) * pp if isinstance(offload, OffloadChoice) else offload
    programs = compile_staged(staged, schedule, options, offload_choices=choices, lint_capture=False,
                              replicas=replicas).programs
    if not staged_inputs:
        programs = tuple(p.replace(staged_inputs=False) for p in programs)
    models = [None] * pp
    world = LoopbackWorld(pp)
    steps = (batch, *then)
    losses, runtimes, errors = [None] * pp, [None] * pp, []

    def run(r: int) -> None:
        try:
            gm = emit_fx(programs[r])
            if patch is not None:
                patch(r, gm)
            runtimes[r], models[r] = rank_runtime(world, programs, r, gm, model, staged, device=device,
                                                  timeout=timeout)
            for k, b in enumerate(steps):
                if measure and k == len(steps) - 1:
                    method = "tracker" if measure == "tracker" else "auto"
                    losses[r], runtimes[r].measured = runtimes[r].measure_step(b, method)
                else:
                    losses[r] = runtimes[r].step_batch(b)
        except BaseException as e:  # reported in the main thread
            errors.append(e)
            world.abort()

    run_ranks(run, pp, errors)
    return losses, models, runtimes


def run_ranks(run, pp: int, errors: list) -> None:
    """`run(rank)` for every rank in its own thread; re-raise the first error a rank recorded."""
    threads = [threading.Thread(target=run, args=(r,)) for r in range(pp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def max_grad_error(reference, models, owned) -> tuple[float, str]:
    """Largest relative gradient error over every parameter each rank owns (tied aliases by canonical name)."""
    worst, where = 0.0, ""
    ref = dict(reference.named_parameters())
    for r, mdl in enumerate(models):
        mine = dict(mdl.named_parameters())
        for name in owned[r]:
            g, want = mine[name].grad, ref[name].grad
            if g is None:
                return float("inf"), f"rank {r}: {name} has no grad"
            err = ((g - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()
            if err > worst:
                worst, where = err, f"rank {r}: {name}"
    return worst, where


def vocab_rank_grads(ranks, staged, schedule, reference):
    """Per rank of a vocabulary-parallel run, each parameter it holds (its stages' and the vocabulary shards) as
    (rank, name, the rank's parameter, eager's gradient): for a vocabulary parameter the rank's rows of it (the
    shard may run past V: padded rows); None where eager has no gradient."""
    expected, vocab = dict(reference.named_parameters()), staged.vocab
    for r, mdl in enumerate(ranks):
        mine = {n for s, owner in enumerate(schedule.placement) if owner == r
                for n in staged.stages[schedule.model_stage(s)].params} | set(vocab.params)
        for name, p in mdl.named_parameters():
            if name not in mine:
                continue
            want = expected[name].grad
            if want is not None and name in vocab.params:
                want = want[r * vocab.rows:(r + 1) * vocab.rows]
            yield r, name, p, want


def param_holders(schedule, staged) -> dict[str, tuple[int, ...]]:
    """Parameter fqn -> the ranks whose stages use it (buffers left out)."""
    from zbcompile.distributed import holders

    return {n: rs for n, rs in holders(schedule, staged).items() if not n.startswith("buffer:")}


def assert_graded_where_eager_is(eager, holders, graded, what: str = "") -> list[set[str]]:
    """The union check of the equivalence tests: a parameter that eager autograd gives a gradient has one on
    every rank holding it (`holders`: fqn -> ranks, as param_holders gives them) and no other gradient exists
    anywhere; a parameter without an eager gradient has none on any rank. `eager`: the names eager autograd
    graded; `graded`: per rank, the names with a gradient there. Returns per rank the names to compare values of.
    A comparison that only walked the gradients one side has would pass with a gradient missing."""
    eager = set(eager)
    owned = [{n for n, rs in holders.items() if r in rs and n in eager} for r in range(len(graded))]
    assert eager, f"{what}eager autograd graded nothing"
    assert set().union(*owned) == eager, f"{what}eager gradients no rank holds: {sorted(eager - set().union(*owned))}"
    for r, names in enumerate(graded):
        names = set(names)
        assert names == owned[r], (f"{what}rank {r}: gradients missing {sorted(owned[r] - names)}, "
                                   f"unexpected {sorted(names - owned[r])}")
    return owned


def loopback_pipes(model, options, pp: int, *, compiled=None):
    """Every rank's PipelineModule of one compile (zbcompile.compiler + place.place, as zb.compile builds them),
    each over a copy of `model`, wired through a LoopbackWorld: the user-facing pipeline in one process.
    options: a CompileOptions; compiled: an existing compile to place instead of compiling again.
    Run them with run_pipes (every rank's calls in its own thread, as torchrun's processes would)."""
    import copy

    from zbcompile.place import place
    from zbcompile.compiler import compile_programs

    compiled = compiled or compile_programs(model, options, pp)
    world = LoopbackWorld(pp)
    pipes = [None] * pp

    def build(r: int) -> None:   # in threads: placing a vocabulary split already talks to the peers
        pipes[r] = place(copy.deepcopy(model), compiled, (world.group(r), r, pp))

    run_pipes(build, pp, world=world)
    return pipes


def run_pipes(fn, pp: int, *, world=None) -> list:
    """fn(rank) on every rank in its own thread; returns the results in rank order, re-raising the first error
    (after aborting the loopback world, so that no peer waits for it)."""
    results, errors = [None] * pp, []

    def run(r: int) -> None:
        try:
            results[r] = fn(r)
        except BaseException as e:
            errors.append(e)
            if world is not None:
                world.abort()

    run_ranks(run, pp, errors)
    return results


def distinct_microbatches(tensors, m: int, seed: int = 1) -> tuple[torch.Tensor, ...]:
    """m microbatches shaped like each example tensor (one microbatch), concatenated on dim 0: each a shuffle of
    the example's own values (token ids stay in the vocabulary, a mask stays 0/1) by a fixed generator, so no two
    are equal and a pipeline that mixed microbatches up (fed one twice, paired one's targets with another's
    inputs, summed a gradient into the wrong step) would differ from eager."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in tensors:
        flat = t.reshape(-1)
        out.append(torch.cat([flat[torch.randperm(flat.numel(), generator=g)].view_as(t) for _ in range(m)]))
    for t in out[:1]:
        assert len({tuple(c.flatten().tolist()) for c in t.chunk(m)}) == m, "two microbatches are equal"
    return tuple(out)


def eager_microbatches(model, loss_fn, batch, n: int, m: int, *, keywords=()):
    """Eager autograd on a copy of `model`, microbatch by microbatch as the pipeline cuts the batch (inputs then
    targets; `keywords` names the first inputs passed by keyword): each loss / m, backward, summed. Returns
    (the copy with its gradients, the step's loss)."""
    ref = copy.deepcopy(model)
    total = 0.0
    for mb in zip(*(t.chunk(m) for t in batch)):
        kwargs = dict(zip(keywords, mb))
        loss = loss_fn(ref(*mb[len(keywords):n], **kwargs), *mb[n:]) / m
        loss.backward()
        total += loss.item()
    return ref, total


def threaded_step_matches_eager(case, schedule: str, pp: int, *, split_points=None) -> None:
    """One pipelined step over 2*pp distinct microbatches (ranks as threads) against eager autograd on the same
    microbatches: losses and every gradient within 1e-5 relative, a gradient exactly where eager has one, and
    every buffer the step updates (on the rank whose stage holds it) as eager left it."""
    sched = generate(schedule, pp, 2 * pp)
    inputs, targets = [(x,) if isinstance(x, torch.Tensor) else tuple(x) for x in case.example]
    staged = split_for(case.model, case.loss_fn, (inputs, targets), sched, split_points=split_points)
    batch = distinct_microbatches(inputs + targets, 2 * pp)
    n = len(inputs)
    ref, want = eager_microbatches(case.model, case.loss_fn, batch, n, 2 * pp)
    losses, ranks, _ = run_threaded(case.model, staged, sched, batch)
    assert all(abs(v - want) <= 1e-5 * abs(want) for v in losses), (losses, want)
    eager = {name for name, p in ref.named_parameters() if p.grad is not None}
    graded = [{name for name, p in mdl.named_parameters() if p.grad is not None} for mdl in ranks]
    owned = assert_graded_where_eager_is(eager, param_holders(sched, staged), graded)
    err, where = max_grad_error(ref, ranks, owned)
    assert err <= 1e-5, where
    assert_buffers_match(ref, ranks, sched, staged)


def assert_buffers_match(ref, ranks, sched, staged) -> list[set[str]]:
    """Each rank's buffers of its own stages equal eager's (`ref`) after the same microbatches, in order; returns
    per rank the names of those buffers."""
    want = dict(ref.named_buffers())
    owned = []
    for r, mdl in enumerate(ranks):
        mine = {n for s, rank in enumerate(sched.placement) if rank == r
                for n in staged.stages[sched.model_stage(s)].buffers}
        for name, buf in mdl.named_buffers():
            if name in mine:
                torch.testing.assert_close(buf, want[name], rtol=1e-5, atol=1e-6, msg=f"rank {r}: buffer {name}")
        owned.append(mine)
    return owned
