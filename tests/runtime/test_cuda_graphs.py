"""The CUDA-graph runtime (zbcompile/runtime/graphs.py) and the replay-identity check (runtime/replay_check.py),
exercised on a CPU: every rank a thread of the loopback world, the graph API a stand-in that checks the call order
and the memory each replay touches (tests/support/graph_standin.py). Training with captured steps must equal eager
training step for step, with optimizer steps and zero_grad(set_to_none=True) between steps; programs and callers
that break replay must fail with the reason."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import zbcompile as zb
from support.graph_standin import StandInError, StandInGraphs
from support.models import eager_accumulated, gpt, train_sgd
from support.threaded import assert_graded_where_eager_is, param_holders, run_ranks
from zbcompile.errors import CaptureError, RuntimeFailure, UsageError
from zbcompile.passes.lower import CAPTURE_FINISHING, FINISHING, emit_fx, lower_all
from zbcompile.passes.lower.offload import OffloadChoice
from zbcompile.passes.schedules import GENERATORS, generate
from zbcompile.ir.program.ops import OpKind
from zbcompile.runtime import abi
from zbcompile.runtime.loopback import LoopbackWorld, rank_runtime
from zbcompile.runtime.replay_check import ReplayCheck
from zbcompile.ir.schedule import Schedule
from zbcompile.split import split_model

torch.set_num_threads(1)

STEPS = 5
LR = 0.05


@functools.lru_cache(maxsize=None)
def _case(stages: int, mbs: int, layers: int = 4):
    model, loss_fn, (x, y), _ = gpt(layers=layers, batch=8)
    staged = split_model(model, loss_fn, ((x[: 8 // mbs],), (y[: 8 // mbs],)), num_stages=stages)
    return model, loss_fn, x, y, staged


def _batches(x, y):
    """A different batch every step (rolled tokens), so a replay that read stale inputs would show."""
    return [(torch.roll(x, k, dims=1).contiguous(), torch.roll(y, k, dims=1).contiguous()) for k in range(STEPS)]


def _eager_reference(model, loss_fn, batches, m):
    """Single-process training: per step the accumulated microbatch gradients, then SGD."""
    model = copy.deepcopy(model)
    return train_sgd(model, lambda xb, yb: eager_accumulated(model, loss_fn, xb, yb, m), batches, LR)


def _train(schedule, staged, model, batches, *, finishing=CAPTURE_FINISHING, graphs=True, warmup=2,
           between=None, check=False, apis=None, offload=None):
    """Train STEPS steps on every rank of `schedule` (threads); returns per rank (losses, grads per step, api,
    runtime). A vocabulary-parallel split gets each rank's rows of the vocabulary parameters."""
    pp = schedule.num_ranks
    programs = lower_all(schedule, staged, finishing=finishing, offload=offload)
    world = LoopbackWorld(pp)
    out, errors = [None] * pp, []

    def run(r):
        try:
            api = apis[r] if apis else StandInGraphs()
            rt, mdl = rank_runtime(world, programs, r, emit_fx(programs[r]), model, staged, cuda_graphs=graphs,
                                   graph_api=api, warmup=warmup)
            check_ = ReplayCheck(rt, warmup=warmup) if check else None
            steps = iter(range(len(batches)))

            def step(xb, yb):
                k = next(steps)
                if between is not None:
                    between(r, k, rt, mdl)
                return check_.step((xb, yb)) if check else rt.step_batch((xb, yb))
            losses, grads = train_sgd(mdl, step, batches, LR)
            out[r] = (losses, grads, api, rt)
        except BaseException as e:
            errors.append(e)
            world.abort()

    run_ranks(run, pp, errors)
    return out


def _holders(schedule, staged) -> dict[str, tuple[int, ...]]:
    """Parameter -> the ranks holding it: its stages' ranks; a vocabulary parameter, every rank (its rows)."""
    vocab = staged.vocab.params if staged.vocab is not None else ()
    return param_holders(schedule, staged) | {n: tuple(range(schedule.num_ranks)) for n in vocab}


def _assert_equal_to_eager(results, ref_losses, ref_grads, holders, tol=1e-5):
    """Every step: the loss, and on every rank a gradient for exactly the parameters it holds that eager training
    grades (a missing or an extra one fails), each equal to eager's (a vocabulary shard: this rank's rows)."""
    for k in range(STEPS):
        assert_graded_where_eager_is(ref_grads[k], holders, [grads[k] for _, grads, _, _ in results], f"step {k}: ")
    for r, (losses, grads, _, _) in enumerate(results):
        for k in range(STEPS):
            assert abs(losses[k] - ref_losses[k]) <= tol * max(1.0, abs(ref_losses[k])), (r, k, losses[k])
            for n, g in grads[k].items():
                ref = ref_grads[k][n]
                if g.shape != ref.shape:   # a vocabulary shard: this rank's rows
                    ref = ref[r * g.shape[0]:(r + 1) * g.shape[0]]
                err = (g - ref).abs().max().item() / max(ref.abs().max().item(), 1e-12)
                assert err <= tol, (r, k, n, err)


@pytest.mark.parametrize("name", [n for n in GENERATORS if n != "zb-auto"] + ["zb-auto"])
def test_captured_training_equals_eager_for_every_schedule(name):
    """Warm-up 2 eager steps, capture the 3rd, replay to the 5th: every step's loss and gradients equal
    single-process eager training (1e-5), on every rank; the stand-in saw the protocol's call order."""
    sched = generate(name, 2, 4)
    model, loss_fn, x, y, staged = _case(sched.num_model_stages, 4)
    batches = _batches(x, y)
    ref_losses, ref_grads = _eager_reference(model, loss_fn, batches, 4)
    results = _train(sched, staged, model, batches)
    _assert_equal_to_eager(results, ref_losses, ref_grads, _holders(sched, staged))
    for losses, grads, api, rt in results:
        eager = ["side0 waits default", "use side0", "default waits side0"]   # the batch in, the step out
        assert api.log == [*eager, *eager, "synchronize", "pool", "capture", "synchronize",
                           "replay", "replay", "replay"], api.log
        assert rt.captured.captured and rt.captured.steps == STEPS


@pytest.mark.slow
@pytest.mark.parametrize("name", ["1f1b", "zbv", "dualpipev", "v-half"])
def test_captured_training_equals_eager_at_pp4(name):
    sched = generate(name, 4, 8)
    model, loss_fn, x, y, staged = _case(sched.num_model_stages, 8, layers=8)
    batches = _batches(x, y)
    ref_losses, ref_grads = _eager_reference(model, loss_fn, batches, 8)
    _assert_equal_to_eager(_train(sched, staged, model, batches), ref_losses, ref_grads, _holders(sched, staged))


def test_a_two_stage_program_on_one_rank_is_captured():
    """One rank holding both stages (local hand-over, no P2P): the shape the single-GPU tests capture."""
    sched = Schedule.from_text("# zbcompile schedule one-rank: microbatches=2 placement=0,0 pipelines=1\n"
                               "rank 0: 0F0 1F0 1B0 0B0 0F1 1F1 1B1 0B1 1W0 0W0 1W1 0W1\n").validate()
    model, loss_fn, x, y, staged = _case(2, 2)
    batches = _batches(x, y)
    ref_losses, ref_grads = _eager_reference(model, loss_fn, batches, 2)
    _assert_equal_to_eager(_train(sched, staged, model, batches), ref_losses, ref_grads, _holders(sched, staged))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["1f1b", "zbv"])
def test_captured_training_with_vocabulary_parallelism_equals_eager(name):
    """The vocabulary layers' broadcasts, reductions and all-gathers captured with the rest of the step."""
    sched = generate(name, 2, 4, vocab=True)
    model, loss_fn, x, y, _ = _case(sched.num_model_stages, 4)
    staged = split_model(model, loss_fn, ((x[:2],), (y[:2],)), num_stages=sched.num_model_stages, vocab_shards=2)
    batches = _batches(x, y)
    ref_losses, ref_grads = _eager_reference(model, loss_fn, batches, 4)
    results = _train(sched, staged, model, batches)
    _assert_equal_to_eager(results, ref_losses, ref_grads, _holders(sched, staged))
    assert any(op.kind is OpKind.COLLECTIVE for op in results[0][3].ir.ops)


@pytest.mark.parametrize("name", ["zb-h1", "zbv"])
def test_captured_training_with_activation_offload_equals_eager(name):
    """Offload and reload copies into the host pool (made before capture) inside the captured step."""
    sched = generate(name, 2, 4)
    model, loss_fn, x, y, staged = _case(sched.num_model_stages, 4)
    batches = _batches(x, y)
    ref_losses, ref_grads = _eager_reference(model, loss_fn, batches, 4)
    results = _train(sched, staged, model, batches, offload=OffloadChoice(prefetch=1, min_bytes=0))
    _assert_equal_to_eager(results, ref_losses, ref_grads, _holders(sched, staged))
    assert all(rt.ir.host_buffers and rt.ir.of_kind(OpKind.OFFLOAD) for *_, rt in results)


ZOO = ["mlp", "convnet", "skipnet", "masknet", "cast_net", "latent_net", "rope_net", "hf_gpt2", "dict_lm"]


@pytest.mark.parametrize("case_name", ZOO)
def test_captured_training_of_the_model_zoo_equals_eager(case_name):
    """Other architectures under capture: BatchNorm (buffers written in place), skip connections, masks, dtype
    casts, rotary embeddings, a HuggingFace GPT-2, a dict-returning LM; zbv where the model has 4 stages to cut,
    else 1f1b; 2 microbatches per step, a different sample order every step."""
    from support import models

    case = getattr(models, case_name)()
    x, y = case.example
    sched = generate("zbv" if case.max_stages >= 4 else "1f1b", 2, 2)
    half = x.shape[0] // 2
    staged = split_model(case.model, case.loss_fn, ((x[:half],), (y[:half],)), num_stages=sched.num_model_stages)
    batches = [(torch.roll(x, k, dims=0), torch.roll(y, k, dims=0)) for k in range(STEPS)]
    ref_losses, ref_grads = _eager_reference(case.model, case.loss_fn, batches, 2)
    _assert_equal_to_eager(_train(sched, staged, case.model, batches), ref_losses, ref_grads,
                           _holders(sched, staged))


@pytest.mark.slow
def test_replay_check_passes_for_every_schedule_and_equals_eager():
    """The replay-identity check itself (eager steps, footprints compared from step 2 on) for each schedule."""
    for name in ("gpipe", "1f1b", "zb-h1", "zb-h2", "zbv", "v-min", "dualpipe", "interleaved-1f1b"):
        sched = generate(name, 2, 4)
        model, loss_fn, x, y, staged = _case(sched.num_model_stages, 4)
        batches = _batches(x, y)
        ref_losses, ref_grads = _eager_reference(model, loss_fn, batches, 4)
        results = _train(sched, staged, model, batches, graphs=False, check=True, warmup=1)
        _assert_equal_to_eager(results, ref_losses, ref_grads, _holders(sched, staged))


# ---- what breaks replay fails with the reason ---------------------------------------------------------------
def _fails(match, error=CaptureError, **kw):
    sched = generate("1f1b", 2, 4)
    model, loss_fn, x, y, staged = _case(2, 4)
    with pytest.raises(error, match=match):
        _train(sched, staged, model, _batches(x, y), **kw)


def test_a_parameter_rebound_after_capture_is_refused_until_put_back():
    def rebind(r, k, rt, mdl):
        if k == 3:
            w = mdl.get_parameter("blocks.0.ln1.weight") if r == 0 else mdl.get_parameter("ln_f.weight")
            w.data = w.data.clone()
    _fails(r"param:(blocks\.0\.ln1|ln_f)\.weight moved since the step was captured", between=rebind)

    # refused before any device work: with the parameter's storage put back, the next replay goes on
    sched = generate("1f1b", 2, 4)
    model, loss_fn, x, y, staged = _case(2, 4)
    batches = _batches(x, y)
    ref_losses, ref_grads = _eager_reference(model, loss_fn, batches, 4)
    moved = {}

    def move_and_restore(r, k, rt, mdl):
        w = mdl.get_parameter("ln_f.weight" if r == 1 else "blocks.0.ln1.weight")
        if k == 3:
            moved[r] = w.data
            w.data = w.data.clone()
            with pytest.raises(CaptureError, match="moved since the step was captured"):
                rt.step_batch(batches[k])
            w.data = moved[r]
    _assert_equal_to_eager(_train(sched, staged, model, batches, between=move_and_restore), ref_losses, ref_grads,
                           _holders(sched, staged))


def test_the_replay_check_names_a_rebound_parameter_and_renewed_receive_buffers():
    def rebind(r, k, rt, mdl):
        if k == 3 and r == 1:
            w = mdl.get_parameter("ln_f.weight")
            w.data = w.data.clone()
    _fails(r"touched other memory than step 2 did \(entry \d+: param:ln_f.weight then", graphs=False, check=True,
           warmup=1, between=rebind)

    def renew(r, k, rt, mdl):
        if k == 3:
            rt.ctx.renew_buffers()
    _fails(r"the messages differ from step 2's \(entry \d+: \('recv'", graphs=False, check=True, warmup=1,
           between=renew)


def test_a_step_whose_allocations_outlive_it_is_refused(monkeypatch):
    """A receive whose buffer outlives the step (what an unslotted receive feeding .grad would be): in a graph it
    is pool memory that the next replay overwrites."""
    kept = []
    real = abi.recv_into

    def recv_keeping(ctx, peer, tag, slot, what):
        buf = torch.empty_like(ctx.bufs[slot])
        kept.append(buf)
        return abi._post_recv(ctx, buf, peer, tag, what)
    monkeypatch.setattr(abi, "recv_into", recv_keeping)
    try:
        _fails("outlive it", graphs=False, check=True, warmup=1)
        kept.clear()
        _fails("outlive it", error=StandInError)
    finally:
        monkeypatch.setattr(abi, "recv_into", real)


def test_timed_programs_are_refused_by_the_runtime():
    _fails("lowered for capture", finishing=FINISHING)


def test_ranks_that_disagree_when_to_capture_are_refused():
    sched = generate("1f1b", 2, 4)
    model, loss_fn, x, y, staged = _case(2, 4)
    programs = lower_all(sched, staged, finishing=CAPTURE_FINISHING)
    world = LoopbackWorld(2)
    errors = []

    def run(r):
        try:
            rt, _ = rank_runtime(world, programs, r, emit_fx(programs[r]), model, staged, timeout=10,
                                 cuda_graphs=True, graph_api=StandInGraphs(), warmup=1 + r)
            for b in _batches(x, y)[:3]:
                rt.step_batch(b)
        except BaseException as e:
            errors.append(e)
            world.abort()
    with pytest.raises(CaptureError, match=r"the ranks disagree when to capture the step as a CUDA graph "
                                           r"\(eager steps left\) \(per rank: \[1.0, 2.0\]\)"):
        run_ranks(run, 2, errors)


class _NeverDone(StandInGraphs):
    def mark(self):
        class Stuck:
            def query(self):
                return False
        return Stuck()


def test_the_watchdog_raises_when_the_device_never_finishes_and_the_runtime_stays_failed():
    sched = generate("1f1b", 2, 4)
    model, loss_fn, x, y, staged = _case(2, 4)
    programs = lower_all(sched, staged, finishing=CAPTURE_FINISHING)
    world = LoopbackWorld(2)
    errors, second = [], []

    def run(r):
        try:
            rt, _ = rank_runtime(world, programs, r, emit_fx(programs[r]), model, staged, timeout=0.2,
                                 cuda_graphs=True, graph_api=_NeverDone(), warmup=1)
            try:
                rt.step_batch(_batches(x, y)[0])
            except RuntimeFailure as e:
                errors.append(e)
            try:
                rt.step_batch(_batches(x, y)[0])
            except RuntimeFailure as e:
                second.append(e)
        except BaseException as e:
            errors.append(e)
    run_ranks(run, 2, [])
    assert len(errors) == 2 and all("did not finish within 0.2 s on the device" in str(e) for e in errors), errors
    assert len(second) == 2 and all("compile again" in str(e) for e in second), second


def test_event_timing_programs_stamp_every_action():
    """capture_ready programs call stamp_event (device events on CUDA, the host clock here): the step's timings
    still cover every action, in order."""
    sched = generate("zbv", 2, 4)
    model, loss_fn, x, y, staged = _case(4, 4)
    programs = lower_all(sched, staged, finishing=CAPTURE_FINISHING)
    assert all(p.event_timing for p in programs)
    assert "abi_stamp_event(ctx, 0)" in emit_fx(programs[0]).code and "perf_counter" not in emit_fx(programs[0]).code
    results = _train(sched, staged, model, _batches(x, y), graphs=False)
    timings = results[0][3].last_step
    assert timings.span > 0
    for row in timings.actions:
        assert row and all(s < e for _, s, e in row)   # every stamp was written: each action took time
        assert all(a[2] <= b[1] for a, b in zip(row, row[1:]))


def test_compile_refuses_cuda_graphs_without_cuda_and_bad_values():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    model, loss_fn, x, y, _ = _case(2, 4)
    with pytest.raises(CaptureError, match="need a CUDA device"):
        zb.compile(model, schedule="1f1b", microbatches=4, loss_fn=loss_fn, example=((x[:2],), (y[:2],)),
                   cuda_graphs=True)
    for bad in (0, -1, "yes"):
        with pytest.raises(UsageError, match="cuda_graphs="):
            zb.compile(model, schedule="1f1b", microbatches=4, loss_fn=loss_fn, example=((x[:2],), (y[:2],)),
                       cuda_graphs=bad)
