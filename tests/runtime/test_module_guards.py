"""What a compiled PipelineModule does with the nn.Module calls its compile fixed, and with inputs of the wrong kind,
every rank a thread of this process (support.threaded.loopback_pipes):

- requires_grad_(False) after compile is honoured as eager honours it (no gradient written, .grad left as it was:
  a tied parameter on two ranks and vocabulary shards included); unfreezing a parameter frozen at compile time is
  refused, its gradient was never traced;
- .to / .double / .half / .to("meta") that would change a dtype or device is refused before anything changes; one
  that changes nothing, share_memory() and load_state_dict still work;
- a batch that is not flat tensors with data, and a group that is not a group, raise UsageError;
- after an error inside a step's program (an out-of-range token id), the next call on that rank raises
  RuntimeFailure at once instead of waiting on the peers for the timeout.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import re
import time
import warnings

import pytest
import torch

import zbcompile as zb
from support.loops import eager_step, rel, shard_of
from support.models import Case, convnet, gpt, mlp
from support.threaded import loopback_pipes, run_pipes
from zbcompile import checkpoint
from zbcompile.call_checks import check_hooks
from zbcompile.errors import CheckpointError, DisagreementError, RuntimeFailure, UsageError, ZBCompileWarning
from zbcompile.options import CompileOptions

torch.set_num_threads(1)
PP, M = 2, 4


def _pipes(case, schedule: str = "1f1b", **options):
    model, loss_fn, (x, y), _ = case
    opts = CompileOptions.from_kwargs(None, schedule=schedule, microbatches=M, loss_fn=loss_fn,
                                      example=((x[:x.shape[0] // M],), (y[:y.shape[0] // M],)), **options)
    return model, loss_fn, x, y, loopback_pipes(model, opts, PP)


# ---- requires_grad after compile -----------------------------------------------------------------------------
FROZEN = ("wte.weight", "blocks.0.mlp.fc.weight", "ln_f.weight")   # wte: tied to lm_head (two ranks under 1f1b)


@pytest.mark.parametrize("schedule,vocab", [("1f1b", False), ("zbv", True)])
def test_a_parameter_frozen_after_compile_keeps_its_grad_as_eager_does(schedule, vocab):
    """A step, then requires_grad_(False) on some parameters (on the pipeline and on eager), a second step
    without zero_grad: the frozen ones keep the first step's .grad, every other gradient, the clipped norm and
    the parameters after SGD equal eager's; after zero_grad a third step leaves them None."""
    model, loss_fn, x, y, pipes = _pipes(gpt(layers=4, batch=8), schedule, vocab_parallel=vocab)
    ref = copy.deepcopy(model)
    eager_step(ref, loss_fn, x, y, M)
    for name in FROZEN:
        ref.get_parameter(name).requires_grad_(False)
    eager_step(ref, loss_fn, x.flip(0), y, M)
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    refp = dict(ref.named_parameters())

    def run(r):
        pipe = pipes[r]
        pipe.step(x, y)
        first = {n: p.grad.clone() for n, p in pipe.named_parameters() if n in FROZEN}
        for n, p in pipe.named_parameters():
            p.requires_grad_(n not in FROZEN)
        pipe.step(x.flip(0), y)
        kept = all(torch.equal(p.grad, first[n]) for n, p in pipe.named_parameters() if n in FROZEN)
        norm = pipe.clip_grad_norm_(0.5)
        torch.optim.SGD(pipe.parameters(), lr=0.1).step()
        params = {n: p.detach().clone() for n, p in pipe.named_parameters()}
        pipe.zero_grad()
        pipe.step(x, y)
        none = [n for n, p in pipe.named_parameters() if n in FROZEN and p.grad is not None]
        return kept, norm, params, none

    for r, (kept, norm, params, none) in enumerate(run_pipes(run, PP)):
        assert kept and not none, (r, none)
        assert rel(norm, want) <= 1e-5, (norm, want)
        for n, p in params.items():
            assert rel(p, shard_of(refp[n].detach(), p, r)) <= 1e-5, f"rank {r} {n}"


def test_unfreezing_a_parameter_frozen_at_compile_is_refused():
    """Frozen when compiled, its gradient is not in the graphs: requires_grad_(True) later is refused at the
    next step on every rank that holds it, naming it (before any message: no peer waits)."""
    case = mlp(layers=4, batch=8)
    case.model[0].weight.requires_grad_(False)
    _, _, x, y, pipes = _pipes(case)
    pipes[0].get_parameter("0.weight").requires_grad_(True)
    with pytest.raises(UsageError, match=r"0\.weight had requires_grad=False when the pipeline was compiled.*"
                                         r"Compile again"):
        pipes[0].step(x, y)
    # rank 1 does not hold it; here it is refused a call too, which keeps the ranks' calls in step (a call refused
    # on one rank alone is reported by the next step: test_a_call_refused_on_one_rank_only_is_found_at_the_next_step)
    with pytest.raises(UsageError):
        pipes[1].step(x[:6], y[:6])
    pipes[0].get_parameter("0.weight").requires_grad_(False)
    run_pipes(lambda r: pipes[r].step(x, y), PP)   # frozen again: trains


def test_the_whole_model_frozen_after_compile_is_refused_on_every_rank_as_eager_refuses_it():
    """Eager's backward raises when no parameter requires grad; the pipeline ran the step and dropped every
    gradient, training nothing without a word. Frozen through the model (every rank sees every parameter's flag,
    the others' on meta), every rank refuses the step before any message; a rank whose own parameters were all
    frozen at compile refuses it too (the same decision everywhere, else a peer waits); one parameter trainable
    again and the step trains."""
    case = mlp(layers=4, batch=8)
    for p in [*case.model[0].parameters(), *case.model[2].parameters()]:   # rank 0's layers, frozen at compile:
        p.requires_grad_(False)                                            # it trains nothing of its own
    model, loss_fn, x, y, pipes = _pipes(case)
    assert not any(p.requires_grad for p in pipes[0].parameters())
    ref = copy.deepcopy(model)
    for p in ref.parameters():
        p.requires_grad_(False)
    with pytest.raises(RuntimeError, match="does not require grad"):
        loss_fn(ref(x), y).backward()

    def run(r):
        for p in pipes[r].model.parameters():
            p.requires_grad_(False)
        try:
            pipes[r].step(x, y)
        except UsageError as e:
            refused = str(e)
        pipes[r].model.get_parameter("6.weight").requires_grad_(True)
        pipes[r].step(x, y)
        return refused, sorted(n for n, p in pipes[r].named_parameters() if p.grad is not None)

    (said0, grads0), (said1, grads1) = run_pipes(run, PP)
    assert "every parameter of the model has requires_grad=False" in said0 and said0 == said1
    assert grads0 == [] and grads1 == ["6.weight"]


def test_the_whole_model_frozen_through_each_ranks_pipe_parameters_is_refused_on_every_rank():
    """Frozen through pipe.parameters() on every rank, each rank its own parameters: no rank sees the others'
    flags (they are on meta there, as compiled), so the step ran and dropped every gradient, training nothing
    without a word, where eager's backward raises. Every rank now learns from the step's gather that none
    trained and refuses the step, no gradient written; a rank that still trains a parameter trains alone, as
    eager does."""
    case = mlp(layers=4, batch=8)
    _, _, x, y, pipes = _pipes(case)

    def run(r):
        for p in pipes[r].parameters():
            p.requires_grad_(False)
        try:
            pipes[r].step(x, y)
            refused = None
        except UsageError as e:
            refused = str(e)
        written = [n for n, p in pipes[r].named_parameters() if p.grad is not None]
        if r == PP - 1:
            next(iter(pipes[r].parameters())).requires_grad_(True)
        pipes[r].step(x, y)   # one parameter on the last rank trains: a step
        return refused, written, sorted(n for n, p in pipes[r].named_parameters() if p.grad is not None)

    ran = run_pipes(run, PP)
    for r, (refused, written, after) in enumerate(ran):
        assert refused is not None and "requires_grad=False" in refused and "trained nothing" in refused, (r, refused)
        assert written == [], (r, written)
    assert ran[0][2] == [] and len(ran[-1][2]) == 1, ran


def test_the_whole_model_frozen_through_each_ranks_pipe_parameters_is_refused_by_post_validated_steps_too():
    """The same freezing under step(..., post_validate=True): its prefix chain did not carry whether each rank
    trained, so the step ran and trained nothing without a word. It now does: the call that validates the step
    (here settle()) raises on every rank, nothing changed; a step with one parameter trainable again trains."""
    _, _, x, y, pipes = _pipes(mlp(layers=4, batch=8))

    def run(r):
        pipe = pipes[r]
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        before = {n: p.detach().clone() for n, p in pipe.named_parameters()}
        for p in pipe.parameters():
            p.requires_grad_(False)
        pipe.step(x, y, optimizer=opt, post_validate=True)
        try:
            pipe.settle()
            refused = None
        except UsageError as e:
            refused = str(e)
        same = all(torch.equal(p, before[n]) for n, p in pipe.named_parameters())
        if r == PP - 1:
            next(iter(pipe.parameters())).requires_grad_(True)
        pipe.step(x, y, optimizer=opt, post_validate=True)
        pipe.settle()
        moved = [n for n, p in pipe.named_parameters() if not torch.equal(p, before[n])]
        return refused, same, moved

    ran = run_pipes(run, PP)
    for r, (refused, same, _) in enumerate(ran):
        assert refused is not None and "post-validated step before this call trained nothing" in refused, (r, refused)
        assert same, r
    assert ran[0][2] == [] and len(ran[-1][2]) == 1, ran


def test_a_module_of_a_model_compiled_before_is_refused_in_another_model_on_every_rank():
    """Two heads on one backbone, compiled as two models: the first compile kept each rank's stages of the
    backbone and moved the rest to meta. Compiling the second model traced on the rank that kept all of it and
    failed with a raw fake-tensor error on the other (whose peer then waited out its timeout): both refuse now,
    naming the module, before tracing; so does the compiled model itself."""
    model, loss_fn, x, y, pipes = _pipes(mlp(layers=4, batch=8))
    assert not pipes[0].model[0].weight.is_meta and pipes[1].model[0].weight.is_meta
    for pipe in pipes:
        second = torch.nn.Sequential(pipe.model[0], torch.nn.Tanh(), torch.nn.Linear(16, 16))
        with pytest.raises(UsageError, match=r"module `0` \(Linear\) is part of a model compiled before on 2 "
                                             r"ranks.*copy\.deepcopy"):
            zb.compile(second, schedule="1f1b", microbatches=M, loss_fn=loss_fn, example=((x[:2],), (y[:2],)))
        with pytest.raises(UsageError, match="this model was compiled before"):
            zb.compile(pipe.model, schedule="1f1b", microbatches=M, loss_fn=loss_fn, example=((x[:2],), (y[:2],)))
    check_hooks(model, loss_fn)   # the model the pipes were placed from (each rank placed a copy): not refused


class _Scaled(torch.nn.Module):
    """A linear layer with a non-persistent buffer (not in eager's state_dict) and a persistent one."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.register_buffer("scale", torch.full((8,), 0.5), persistent=False)
        self.register_buffer("shift", torch.full((8,), 0.1))

    def forward(self, x):
        return torch.tanh(self.lin(x)) * self.scale + self.shift


def test_state_dict_keys_are_eagers_without_the_non_persistent_buffers():
    """The ranks' pipe.state_dict() keys together are exactly eager's model.state_dict() keys (a buffer registered
    with persistent=False is in neither), and eager's state dict loads into every rank with strict=True."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(_Scaled(), _Scaled(), torch.nn.Linear(8, 4))
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    opts = CompileOptions.from_kwargs(None, schedule="1f1b", microbatches=2, loss_fn=torch.nn.functional.mse_loss,
                                      example=((x[:2],), (y[:2],)), split_points=("1",))
    pipes = loopback_pipes(model, opts, PP)
    want = model.state_dict()
    keys = [set(pipe.state_dict()) for pipe in pipes]
    assert set().union(*keys) == set(want) and not keys[0] & keys[1], keys
    for pipe in pipes:
        pipe.load_state_dict(want, strict=True)


def test_a_vocabulary_parallel_pipe_loads_the_whole_tables_of_the_plain_models_state_dict():
    """The plain model's state dict holds each vocabulary table whole; each rank keeps its own rows of it (rank r:
    rows [r*rows, (r+1)*rows), sliced by hand here), and the next step's loss is eager's on that model."""
    model, loss_fn, x, y, pipes = _pipes(gpt(layers=4, batch=8), vocab_parallel=True)
    torch.manual_seed(123)
    new = copy.deepcopy(model)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    whole = new.state_dict()

    def run(r):
        pipes[r].load_state_dict(whole, strict=False)
        return pipes[r].get_parameter("wte.weight").detach().clone(), pipes[r].step(x, y)

    table = whole["wte.weight"]
    want = sum(float(loss_fn(new(a), b)) for a, b in zip(x.chunk(M), y.chunk(M))) / M
    for r, (rows, loss) in enumerate(run_pipes(run, PP)):
        n = rows.shape[0]
        assert torch.equal(rows[:max(0, min(n, table.shape[0] - r * n))], table[r * n:(r + 1) * n]), r
        assert abs(loss - want) <= 1e-5 * abs(want), (r, loss, want)


def test_freezing_after_a_cuda_graphs_compile_is_refused():
    """A captured step adds into every .grad it captured, so a freeze after a cuda_graphs compile is refused
    (the options stood in for: this machine has no CUDA)."""
    _, _, x, y, pipes = _pipes(mlp(layers=4, batch=8))
    pipe = pipes[0]
    pipe.compiled = dataclasses.replace(pipe.compiled, options=pipe.compiled.options.replace(cuda_graphs=2))
    pipe.get_parameter("0.weight").requires_grad_(False)
    with pytest.raises(UsageError, match=r"0\.weight was frozen .* after the pipeline was compiled with "
                                         "cuda_graphs"):
        pipe.step(x, y)


# ---- dtype / device conversions ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mlp_pipes():
    return _pipes(mlp(layers=4, batch=8))


CONVERSIONS = {"double": lambda p: p.double(), "half": lambda p: p.half(), "bfloat16": lambda p: p.bfloat16(),
               "to(float64)": lambda p: p.to(torch.float64), "to(meta)": lambda p: p.to("meta"),
               "to(cpu, float16)": lambda p: p.to("cpu", torch.float16)}


@pytest.mark.parametrize("convert", CONVERSIONS.values(), ids=CONVERSIONS.keys())
def test_a_conversion_after_compile_is_refused_before_anything_changes(mlp_pipes, convert):
    _, _, x, y, pipes = mlp_pipes
    pipe = pipes[0]
    before = {n: (t.dtype, t.device, t.data_ptr()) for n, t in pipe.state_dict(keep_vars=True).items()}
    with pytest.raises(UsageError, match=r"would turn 0\.weight from torch\.float32 on cpu into .* nothing was "
                                         r"changed\. Convert the model before compiling"):
        convert(pipe)
    assert {n: (t.dtype, t.device, t.data_ptr()) for n, t in pipe.state_dict(keep_vars=True).items()} == before


def test_a_conversion_that_bypasses_the_pipeline_is_refused_at_the_next_step():
    """The original model object, or a part of the pipeline, converted (its tensors changed in place, as
    model.double() does to parameters the pipeline shares): the next step refuses, naming the tensor."""
    _, _, x, y, pipes = _pipes(mlp(layers=4, batch=8))
    pipe = pipes[0]
    param = pipe.get_parameter("0.weight")
    param.data = param.data.double()
    with pytest.raises(UsageError, match=r"0\.weight was converted after compiling, from torch\.float32 on cpu to "
                                         r"torch\.float64 on cpu"):
        pipe.step(x, y)


def test_data_of_another_shape_is_refused_by_step_and_evaluate_and_of_the_same_shape_trains_as_eager():
    """`p.data = t`: a tensor of the same shape and dtype is read by the next step as eager reads it; one of
    another shape made the step fail inside its graphs (a matmul's shape error) and is now refused by step() and
    evaluate() on the rank that holds it, naming the parameter and both shapes, before any message is sent."""
    model, loss_fn, x, y, pipes = _pipes(mlp(layers=4, batch=8))
    ref = copy.deepcopy(model)
    new = torch.randn_like(ref.get_parameter("0.weight"))
    ref.get_parameter("0.weight").data = new.clone()
    eager_step(ref, loss_fn, x, y, M)
    pipes[0].get_parameter("0.weight").data = new.clone()
    run_pipes(lambda r: pipes[r].step(x, y), PP)
    for pipe in pipes:
        for n, p in pipe.named_parameters():
            assert rel(p.grad, ref.get_parameter(n).grad) < 1e-6, n
    param = pipes[0].get_parameter("0.weight")
    param.data = torch.randn(16, 17)
    for call in (lambda: pipes[0].step(x, y), lambda: pipes[0].evaluate(x, y)):
        with pytest.raises(UsageError, match=r"rank 0: 0\.weight has shape \[16, 17\] but was compiled with shape "
                                             r"\[16, 16\].*p\.copy_\(new\)"):
            call()


def test_the_original_model_converted_whole_is_refused_as_a_conversion_on_every_rank():
    """pipe.model.double() replaces each buffer with a converted copy: it was refused as a buffer "replaced",
    with advice for a new module. Every rank (holding the buffer, or its meta stand-in) now names the
    conversion."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 8),
                                torch.nn.Linear(8, 8))
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    _, _, _, _, pipes = _pipes(Case(model, torch.nn.functional.mse_loss, (x, y), 4))
    for pipe in pipes:
        pipe.model.double()
        with pytest.raises(UsageError, match=r"buffer 1\.running_mean was converted after compiling, from "
                                             r"torch\.float32 on (cpu|meta) to torch\.float64"):
            pipe.step(x, y)


def test_a_part_converted_on_every_rank_is_refused_on_every_rank_at_once():
    """The same edit on every rank (`pipe.model[0].double()`, a part only rank 0 holds) was refused on rank 0
    alone: the others, whose copy of the part is on meta, entered the step and waited for rank 0 until the
    timeout. Their meta stand-ins are converted too, so every rank refuses before sending anything."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    _, _, _, _, pipes = _pipes(Case(model, torch.nn.functional.mse_loss, (x, y), 4), timeout=5)
    for r, pipe in enumerate(pipes):
        pipe.model[0].double()
        with pytest.raises(UsageError, match=rf"rank {r}: 0\.weight was converted after compiling, from "
                                             r"torch\.float32 on (cpu|meta) to torch\.float64"):
            pipe.step(x, y)


class _Blur(torch.nn.Module):
    """A fixed 4-D filter kept as a buffer (a blur before downsampling, as anti-aliased CNNs have)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("filt", torch.full((4, 1, 3, 3), 1 / 9))

    def forward(self, x):
        return torch.nn.functional.conv2d(x, self.filt, padding=1, groups=4)


def test_a_conversion_that_would_replace_a_buffer_is_refused_on_every_rank_before_anything_changes():
    """pipe.to(memory_format=torch.channels_last) replaced the 4-D buffer in the pipe's container only: the next
    step refused on rank 0 ("replaced after compile", blaming the user) while rank 1, holding no buffer, entered
    the step and waited; pipe.to_empty() likewise. Both are refused on every rank now (the other ranks try the
    conversion on their meta copy), naming the buffer, with the buffer still the compiled one; a step then runs."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(4, 4, 3, padding=1), _Blur(), torch.nn.Conv2d(4, 4, 3, padding=1),
                                torch.nn.Conv2d(4, 4, 3, padding=1))
    x, y = torch.randn(8, 4, 6, 6), torch.randn(8, 4, 6, 6)
    model, loss_fn, _, _, pipes = _pipes(Case(model, torch.nn.functional.mse_loss, (x, y), 4), timeout=10)
    want = eager_step(copy.deepcopy(model), loss_fn, x, y, M)

    def run(r):
        pipe = pipes[r]
        compiled = dict(pipe.named_buffers()).get("1.filt")
        for convert in (lambda p: p.to(memory_format=torch.channels_last), lambda p: p.to_empty(device="cpu")):
            with pytest.raises(UsageError, match=rf"rank {r}: this conversion would replace buffer 1\.filt with a "
                                                 r"new tensor .* nothing was changed"):
                convert(pipe)
        assert dict(pipe.named_buffers()).get("1.filt") is compiled
        return pipe.step(x, y)

    assert all(abs(loss - want) <= 1e-6 * abs(want) for loss in run_pipes(run, PP))


def test_a_conversion_that_changes_nothing_and_state_loading_still_work(mlp_pipes):
    """.to(float32) / .float() / .cpu() / .to("cpu") on a float32 CPU pipeline, share_memory() and a
    state-dict round trip are accepted, and the pipeline then steps as eager does."""
    model, loss_fn, x, y, pipes = mlp_pipes
    ref = copy.deepcopy(model)
    want = eager_step(ref, loss_fn, x, y, M)

    def run(r):
        pipe = pipes[r]
        assert pipe.to(torch.float32) is pipe and pipe.float() is pipe and pipe.cpu() is pipe
        pipe.to("cpu").share_memory()
        pipe.load_state_dict({k: v.clone() for k, v in pipe.state_dict().items()})
        pipe.zero_grad()
        return pipe.step(x, y)

    assert all(abs(loss - want) <= 1e-6 * abs(want) for loss in run_pipes(run, PP))
    for pipe in pipes:
        for n, p in pipe.named_parameters():
            assert rel(p.grad, ref.get_parameter(n).grad) <= 1e-5, n


# ---- batches and groups of the wrong kind ----------------------------------------------------------------------
def test_a_batch_that_is_not_flat_tensors_is_refused_and_the_pipeline_still_trains(mlp_pipes):
    """(inputs,), (targets,) as in `example`, a list of numbers, the meta device, a tensor requiring grad (its
    .grad would stay None), another dtype: UsageError saying what step() takes, before any message; evaluate()
    and pipe(x) alike. The pipeline then trains as before."""
    _, _, x, y, pipes = mlp_pipes

    def refused(r):   # on every rank, as a loop would hand every rank the same wrong batch
        pipe = pipes[r]
        for call, batch, message in _not_flat(pipe, x, y):
            with pytest.raises(UsageError, match=message):
                call(*batch)
        return pipe.step(x, y)

    losses = run_pipes(refused, PP)
    assert losses[0] == losses[1]


def _not_flat(pipe, x, y):
    return [(pipe.step, ((x,), (y,)), r"step\(\) takes the whole batch as flat tensors, step\(\*inputs, "
                                      r"\*targets\); batch argument 0 is a tuple: unpack the nested"),
            (pipe.step, (x.tolist(), y), r"batch argument 0 is a list: pass a torch.Tensor"),
            (pipe.step, (x.to("meta"), y.to("meta")), r"step\(\) got batch argument 0 on the meta device.*on cpu"),
            (pipe.evaluate, ((x,), (y,)), r"evaluate\(\*inputs, \*targets\); batch argument 0 is a tuple"),
            (pipe, ([x],), r"pipe\(\*inputs\); batch argument 0 is a list: unpack"),
            (pipe.step, (x.clone().requires_grad_(), y), r"batch argument 0 requiring grad.*pass it detached"),
            (pipe.step, (x.double(), y), r"batch argument 0 is torch.float64, but the model was compiled for "
                                         r"torch.float32 from `example`: pass it as .to\(torch.float32\)")]


@pytest.mark.parametrize("group", ["gloo", 3])
def test_a_group_that_is_not_a_process_group_is_refused(group):
    model, loss_fn, (x, y), _ = mlp(layers=4, batch=8)
    with pytest.raises(UsageError, match=r"is not a process group: compile's group takes a ProcessGroup .* "
                                         r"1-D DeviceMesh .* \('dp', 'pp'\), or None"):
        zb.compile(model, schedule="1f1b", microbatches=M, loss_fn=loss_fn, example=(x[:2], y[:2]), group=group)


# ---- module modes, dropout and hooks changed after compile -------------------------------------------------------
def _refused_then_trains(pipes, x, y, change, undo, match: str) -> None:
    """`change(rank's model)` makes step(), evaluate() and pipe(x) refuse on every rank, before anything runs;
    `undo` makes the pipeline train again."""
    def run(r):
        model = pipes[r].model
        change(model)
        for call in (lambda: pipes[r].step(x, y), lambda: pipes[r].evaluate(x, y), lambda: pipes[r](x)):
            with pytest.raises(UsageError, match=match):
                call()
        undo(model)
        return pipes[r].step(x, y)

    assert all(torch.isfinite(torch.tensor(loss)) for loss in run_pipes(run, PP))


def _first(model, kind):
    return next(m for m in model.modules() if isinstance(m, kind))


def test_a_module_switched_to_eval_or_its_dropout_changed_after_compile_is_refused():
    """The usual fine-tuning moves on the compiled model's own modules, which the traced step never sees:
    BatchNorm statistics frozen by bn.eval() kept updating, Dropout(p=0) kept dropping, model.eval() on the
    original model changed nothing. pipe.train() / pipe.eval() are the switches the step honours."""
    model, loss_fn, x, y, pipes = _pipes(convnet(blocks=4, batch=8))
    bn = torch.nn.BatchNorm2d
    _refused_then_trains(pipes, x, y, lambda m: _first(m, bn).eval(), lambda m: _first(m, bn).train(),
                         r"module .* \(BatchNorm2d\) changed after compile \(train mode -> eval mode\)")
    _refused_then_trains(pipes, x, y, lambda m: m.eval(), lambda m: m.train(),
                         r"module \(the model\) .* changed after compile")
    _, _, x, y, pipes = _pipes(gpt(layers=4, dropout=0.2, batch=8))
    drop = torch.nn.Dropout
    _refused_then_trains(pipes, x, y, lambda m: setattr(_first(m, drop), "p", 0.0),
                         lambda m: setattr(_first(m, drop), "p", 0.2),
                         r"\(Dropout\) changed after compile \(train mode, p=0.2 -> train mode, p=0.0\)")



def test_a_module_parameter_or_buffer_replaced_after_compile_is_refused():
    """A new head for fine-tuning assigned to the compiled model, a parameter re-created on the pipe, a buffer
    re-assigned: the compiled step kept reading the objects it was traced with (trained the old head, left the
    new parameter without a gradient) without a word."""
    _, _, x, y, pipes = _pipes(gpt(layers=4, batch=8))
    kept = {}

    def swap(get_owner, name, make):
        def change(model):
            owner = get_owner(model)
            kept[id(model)] = owner, getattr(owner, name)
            setattr(owner, name, make(getattr(owner, name)))

        def undo(model):
            owner, old = kept.pop(id(model))
            setattr(owner, name, old)
        return change, undo

    def pipe_of(model):
        return next(pipe for pipe in pipes if pipe.model is model)

    def first_owner(model):   # the pipe's container holding its first parameter
        name = next(n for n, _ in pipe_of(model).named_parameters())
        return pipe_of(model).get_submodule(name.rpartition(".")[0])

    head = swap(lambda m: m, "lm_head", lambda old: torch.nn.Linear(old.in_features, old.out_features, bias=False))
    _refused_then_trains(pipes, x, y, *head, r"module lm_head was replaced after compile")
    param = swap(first_owner, "weight", lambda old: torch.nn.Parameter(torch.zeros_like(old)))
    _refused_then_trains(pipes, x, y, *param, r"parameter .*weight was replaced after compile")
    _, _, x, y, pipes = _pipes(convnet(blocks=4, batch=8))
    buffer = swap(lambda m: _first(m, torch.nn.BatchNorm2d), "running_mean", torch.zeros_like)
    _refused_then_trains(pipes, x, y, *buffer, r"buffer .*running_mean was replaced after compile")


def test_step_with_an_optimizer_of_nothing_here_or_no_optimizer_is_refused_before_it_runs():
    """step(optimizer=...) with an optimizer over another model's parameters updated nothing while the gradients
    piled up, silently; a non-optimizer failed with an AttributeError after the step had run; LBFGS (whose step
    combines every parameter's values, each rank holding a share) raised a raw TypeError after the exchange, and
    stepped with a closure it trained silently unlike eager. All are refused before anything runs (no .grad
    written, no parameter changed); zb.compile of something that is not a module is refused too."""
    model, loss_fn, x, y, pipes = _pipes(mlp(layers=4, batch=8))
    foreign = torch.optim.SGD(copy.deepcopy(model).parameters(), lr=0.1)

    def run(r):
        pipe = pipes[r]
        lbfgs = torch.optim.LBFGS(pipe.parameters())
        for optimizer, match in ((foreign, "over none of this rank's"), (3, "takes a torch.optim.Optimizer"),
                                 (lbfgs, "LBFGS over a pipeline's parameters: its step combines")):
            with pytest.raises(UsageError, match=match):
                pipe.step(x, y, optimizer=optimizer)
        assert all(p.grad is None for p in pipe.parameters())
        before = [p.detach().clone() for p in pipe.parameters()]
        with pytest.raises(UsageError, match="LBFGS over a pipeline's parameters"):   # the closure way: unchanged
            lbfgs.step(lambda: torch.tensor(pipe.step(x, y)))
        assert all(torch.equal(a, p) for a, p in zip(before, pipe.parameters()))
        return pipe.step(x, y, optimizer=torch.optim.SGD(pipe.parameters(), lr=0.1))

    assert all(torch.isfinite(torch.tensor(loss)) for loss in run_pipes(run, PP))
    plain = copy.deepcopy(model)   # LBFGS over a model that is no pipeline's still steps
    lbfgs = torch.optim.LBFGS(plain.parameters(), max_iter=2)

    def closure():
        lbfgs.zero_grad()
        loss = loss_fn(plain(x), y)
        loss.backward()
        return loss

    first = closure().item()
    lbfgs.step(closure)
    assert loss_fn(plain(x), y).item() < first
    with pytest.raises(UsageError, match="takes an nn.Module"):
        zb.compile("abc", schedule="1f1b", microbatches=M, loss_fn=loss_fn, example=((x[:2],), (y[:2],)))


def test_an_optimizer_refused_on_one_rank_is_refused_on_every_rank():
    """An optimizer over none of rank 0's parameters was refused there while rank 1 went into the step and
    waited for rank 0 until the timeout. The first step with an optimizer compares the ranks' checks: every
    rank raises at once, nothing runs, and the pipeline then trains."""
    model, loss_fn, x, y, pipes = _pipes(mlp(layers=4, batch=8))
    foreign = torch.optim.SGD(copy.deepcopy(model).parameters(), lr=0.1)

    def run(r):
        pipe = pipes[r]
        own = torch.optim.SGD(pipe.parameters(), lr=0.1)
        start = time.monotonic()
        with pytest.raises(UsageError, match="over none of this rank's" if r == 0 else r"refused on rank\(s\) \[0\]"):
            pipe.step(x, y, optimizer=foreign if r == 0 else own)
        assert time.monotonic() - start < 20 and all(p.grad is None for p in pipe.parameters())
        return pipe.step(x, y, optimizer=own)

    assert all(torch.isfinite(torch.tensor(loss)) for loss in run_pipes(run, PP))


def test_the_pipes_containers_refuse_what_would_act_on_a_module():
    """pipe.<name> holds this rank's tensors under the model's names but is not the user's module: a hook on it
    was never called, .eval() on it changed nothing, pipe.apply(init) re-initialized nothing, pipe.blocks[0]
    raised a raw TypeError. Each is refused saying where the module is and what to do; the pipe still trains.
    pipe.eval() sets every container's `training` (they stayed True)."""
    _, _, x, y, pipes = _pipes(gpt(layers=4, batch=8))

    def run(r):
        pipe = pipes[r]
        blocks = pipe.get_submodule("blocks")
        attempts = {"a forward hook": lambda: blocks.register_forward_hook(lambda *a: None),
                    "a forward pre-hook": lambda: blocks.register_forward_pre_hook(lambda *a: None),
                    "a backward hook": lambda: blocks.register_full_backward_hook(lambda *a: None),
                    ".train() / .eval()": blocks.eval, ".apply(fn)": lambda: pipe.apply(lambda m: None),
                    "indexing": lambda: blocks[0], "a call": lambda: blocks(x)}
        for what, attempt in attempts.items():
            with pytest.raises(UsageError, match=re.escape(what) + r".* is not your module"):
                attempt()
        modes = []   # pipe.eval() / train(): every module of the pipe reports the pipe's mode, as torch's do
        for switch in (pipe.eval, pipe.train):
            switch()
            modes.append({m.training for m in pipe.modules()})
        assert modes == [{False}, {True}], modes
        assert all(m.training for m in pipe.model.modules())   # the user's modules keep the traced mode
        return pipe.step(x, y)

    assert all(torch.isfinite(torch.tensor(loss)) for loss in run_pipes(run, PP))

def _no_decay_names(model: torch.nn.Module) -> set[str]:
    """HF Trainer's get_decay_parameter_names, inverted: the parameters of LayerNorm / Embedding modules (found
    with isinstance over named_children) and every bias."""
    def decayed(mod):
        out = []
        for name, child in mod.named_children():
            if not isinstance(child, (torch.nn.LayerNorm, torch.nn.Embedding)):
                out += [f"{name}.{n}" for n in decayed(child)]
        return out + list(mod._parameters)
    keep = {n for n in decayed(model) if "bias" not in n}
    return {n for n, _ in model.named_parameters()} - keep


def test_optimizer_groups_chosen_by_module_type_are_eagers():
    """Optimizer groups built by module type found none of the pipe's LayerNorms or Embeddings (its containers
    were plain modules), so AdamW decayed them where eager did not: parameters 1e-2 off after three steps, no
    error. The containers now pass isinstance for the user's class, read its settings and print as it does; a new
    value for a setting (a norm's eps) is refused, not ignored. Float64, against eager's same loop."""
    case = gpt(layers=4, batch=8)
    case.model.double()
    model, loss_fn, x, y, pipes = _pipes(case)
    ref = copy.deepcopy(model)

    def adamw(m, skip):
        named = list(m.named_parameters())
        return torch.optim.AdamW([{"params": [p for n, p in named if n not in skip], "weight_decay": 0.5},
                                  {"params": [p for n, p in named if n in skip], "weight_decay": 0.0}], lr=0.01)

    eager_skip = _no_decay_names(ref)
    assert any(".ln1." in n for n in eager_skip) and "wte.weight" in eager_skip, eager_skip
    opt = adamw(ref, eager_skip)
    for _ in range(3):
        eager_step(ref, loss_fn, x, y, M)
        opt.step(), opt.zero_grad()

    def run(r):
        pipe = pipes[r]
        skip = _no_decay_names(pipe)
        assert skip == eager_skip & {n for n, _ in pipe.named_parameters()}, skip ^ eager_skip
        norm = next(m for m in pipe.modules() if isinstance(m, torch.nn.LayerNorm))
        assert norm.eps == 1e-5 and "(ln1): LayerNorm((32,), eps=1e-05, elementwise_affine=True" in repr(pipe)
        with pytest.raises(UsageError, match=r"setting \.eps = 0\.1 .* is not your module"):
            norm.eps = 0.1
        norm.eps = 1e-5   # its own value is no change
        opt = adamw(pipe, skip)
        for _ in range(3):
            pipe.step(x, y)
            opt.step(), opt.zero_grad()
        return {n: p.detach().clone() for n, p in pipe.named_parameters()}

    want = {n: p.detach() for n, p in ref.named_parameters()}
    for got in run_pipes(run, PP):
        for n, p in got.items():
            assert rel(p, want[n]) <= 1e-10, n


class _Annealed(torch.nn.Module):
    """Logits divided by a Python temperature and by a buffer: the first is baked into the trace, the second an
    input of every step."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
                                            for _ in range(4)])
        self.head = torch.nn.Linear(8, 3)
        self.temperature = 1.0
        self.register_buffer("scale", torch.ones((), dtype=torch.float64))

    def forward(self, x):
        return self.head(self.layers(x)) / self.temperature / self.scale


LOSS_CFG = {"aux": 0.0}


def test_a_plain_value_the_trace_read_and_the_loop_changed_is_refused():
    """A Python number the forward or the loss reads (an annealed temperature, a loss weight in a closure or in
    a global dict) was baked into the graphs, and changing it was silently ignored: eager's loss moved, the
    pipeline's did not. Each is refused at the next call, naming the value; setting it back, an attribute no
    code of the model reads (a step counter kept on the model) and a buffer changed in place (the way to anneal)
    are fine, the buffer's new value read by the step as eager reads it."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    weight = 0.0

    def loss_fn(out, y):
        return F.cross_entropy(out, y) + (weight + LOSS_CFG["aux"]) * out.pow(2).mean()

    model = _Annealed().double()
    x, y = torch.randn(8, 8, dtype=torch.float64), torch.randint(0, 3, (8,))
    _, _, _, _, pipes = _pipes(Case(model, loss_fn, (x, y), 4))
    ref = copy.deepcopy(model)

    def attempt(change, undo, error):
        change()
        for r in range(PP):
            with pytest.raises(UsageError, match=error):
                pipes[r].step(x, y)
        undo()

    attempt(lambda: [setattr(p.model, "temperature", 0.5) for p in pipes],
            lambda: [setattr(p.model, "temperature", 1.0) for p in pipes],
            r"model attribute temperature changed after compile \(1.0 -> 0.5\)")
    attempt(lambda: LOSS_CFG.update(aux=5.0), lambda: LOSS_CFG.update(aux=0.0),
            r"loss_fn's global LOSS_CFG\['aux'\] changed after compile \(0.0 -> 5.0\)")

    def set_weight(v):
        nonlocal weight
        weight = v

    attempt(lambda: set_weight(1.0), lambda: set_weight(0.0), r"loss_fn's weight changed after compile")
    for p in (*pipes, ref):
        p_model = getattr(p, "model", p)
        p_model.steps_seen = 7               # bookkeeping no code of the model reads
    with torch.no_grad():
        ref.scale.fill_(0.25)
        held = [dict(p.named_buffers())["scale"] for p in pipes if "scale" in dict(p.named_buffers())]
        assert held
        for buf in held:
            buf.fill_(0.25)   # on the rank holding it, in place
    want = eager_step(ref, loss_fn, x, y, M)
    got = run_pipes(lambda r: pipes[r].step(x, y), PP)
    assert all(abs(g - want) <= 1e-12 * abs(want) for g in got), (got, want)


@dataclasses.dataclass
class _Config:
    scale: float = 1.0


SKIP = False
SHIFT = 0.0


OFFSET = torch.zeros(8, dtype=torch.float64)
REVERSAL = 1.0


class _Reverse(torch.autograd.Function):
    """Gradient reversal scaled by a global (DANN anneals it): only the backward reads it."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return -REVERSAL * g


def _tilted(m, x):
    """A helper the forward calls, reading an attribute the model's own methods never name, and globals."""
    return x * m.tilt + SHIFT + OFFSET


class _ReadsEverywhere(torch.nn.Module):
    """A forward reading Python values from everywhere a model keeps them: a config object, a private
    attribute, a list, an attribute of a child, a module global, a plain (unregistered) tensor attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(4)])
        self.cfg, self._temp, self.mix = _Config(), 1.0, [1.0, 1.0]
        self.layers[2].gain = 1.0
        self.gate = torch.ones(8, dtype=torch.float64)
        self.tilt = 1.0

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if i == 0:
                x = x * self.cfg.scale / self._temp * self.mix[0] * self.gate
            if i == 1:
                x = _Reverse.apply(x)
            if i == 2:
                x = x * layer.gain + (1.0 if SKIP else 0.0)
        return _tilted(self, x)


class _WeightedLoss:
    """A callable loss object (not a module) with a weight of its own."""

    def __init__(self) -> None:
        self.w = 1.0

    def __call__(self, out, y):
        return self.w * ((out - y) ** 2).mean()


def _plain_loss(out, y, w=1.0):
    return w * ((out - y) ** 2).mean()


POWER = 2


def _residual(out, y):
    return (out - y).abs() ** POWER


def _helped_loss(out, y):
    """A loss whose helper reads a global the loss's own code never names."""
    return _residual(out, y).mean()


@pytest.mark.fresh_split   # the traced tensor constant must be this model's own (changed in place below)
@pytest.mark.parametrize("change", ["config", "private", "list", "child", "global", "gate", "forward", "helper",
                                    "helper global", "global tensor", "function global"])
def test_a_value_the_model_reads_from_anywhere_changed_after_compile_is_refused(change):
    """Each of these was read by the trace and ignored when the loop changed it (eager's loss moved, the
    pipeline's did not), also where only a helper function the forward calls reads it, or only the backward of a
    custom autograd.Function (gradients moved, not the loss): refused at the next call,
    naming it; put back, the pipeline trains as before. A plain
    tensor attribute changed in place is read by every step, as in eager."""
    global SKIP, SHIFT, OFFSET, REVERSAL
    torch.manual_seed(0)
    model = _ReadsEverywhere().double()
    x, y = torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64)
    _, _, _, _, pipes = _pipes(Case(model, _plain_loss, (x, y), 4))
    ref = copy.deepcopy(model)
    gates = {id(p.model): p.model.gate for p in pipes}   # (each rank's model is a copy of its own)

    def apply(m, undo=False):
        if change == "config":
            m.cfg.scale = 1.0 if undo else 3.0
        elif change == "private":
            m._temp = 1.0 if undo else 0.25
        elif change == "list":
            m.mix[0] = 1.0 if undo else 3.0
        elif change == "child":
            m.layers[2].gain = 1.0 if undo else 3.0
        elif change == "gate":
            m.gate = gates[id(m)] if undo else gates[id(m)] * 2
        elif change == "helper":
            m.tilt = 1.0 if undo else 3.0
        elif undo:
            del m.forward
        else:
            m.forward = lambda inp: type(m).forward(m, inp) * 2

    names = {"config": r"cfg\.scale changed .*\(1\.0 -> 3\.0\)", "private": r"_temp changed", "list": r"mix changed",
             "child": r"layers\.2\.gain changed", "global": r"global SKIP changed after compile \(False -> True\)",
             "gate": r"gate was replaced", "forward": r"forward changed", "helper": r"attribute tilt changed",
             "helper global": r"global SHIFT changed after compile \(0\.0 -> 1\.0\)",
             "global tensor": r"global OFFSET was replaced",
             "function global": r"global REVERSAL changed after compile \(1\.0 -> 0\.5\)"}
    if "global" in change:   # one value for every rank's copy: changed once, each rank refuses
        offset = OFFSET
        SKIP, SHIFT = change == "global", 1.0 if change == "helper global" else 0.0
        OFFSET = offset + 1 if change == "global tensor" else offset
        REVERSAL = 0.5 if change == "function global" else 1.0
        try:
            for r in range(PP):
                with pytest.raises(UsageError, match=names[change]):
                    pipes[r].step(x, y)
        finally:
            SKIP, SHIFT, OFFSET, REVERSAL = False, 0.0, offset, 1.0
    else:
        _refused_then_trains(pipes, x, y, apply, lambda m: apply(m, undo=True), names[change])
    with torch.no_grad():   # (the threads' programs read the traced model's tensor constants)
        for held in (ref, model):
            held.gate.mul_(0.5)
    eager_step(ref, _plain_loss, x, y, M)   # ref's parameters are as the pipes' before their last step
    ref.zero_grad()
    want = eager_step(ref, _plain_loss, x, y, M)
    got = run_pipes(lambda r: pipes[r].step(x, y), PP)
    assert all(abs(g - want) <= 1e-12 * abs(want) for g in got), (got, want)


@pytest.mark.parametrize("loss", ["object", "partial", "module buffer", "closure tensor", "helper global"])
def test_a_value_the_loss_reads_changed_after_compile_is_refused(loss):
    """A loss object's weight, a functools.partial's bound keyword, nn.CrossEntropyLoss's class weights
    reassigned, a tensor in the loss's closure rebound, a global its helper reads: each was ignored; now refused
    at the next call."""
    global POWER
    torch.manual_seed(0)
    weights = torch.ones(3, dtype=torch.float64)

    def closure_loss(out, y):
        return torch.nn.functional.cross_entropy(out, y, weight=weights)

    loss_fn = {"object": _WeightedLoss(), "partial": functools.partial(_plain_loss, w=1.0),
               "module buffer": torch.nn.CrossEntropyLoss(weight=torch.ones(3, dtype=torch.float64)),
               "closure tensor": closure_loss, "helper global": _helped_loss}[loss]
    classes = loss in ("module buffer", "closure tensor")
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)],
                                torch.nn.Linear(8, 3 if classes else 8)).double()
    x = torch.randn(8, 8, dtype=torch.float64)
    y = torch.randint(0, 3, (8,)) if classes else torch.randn(8, 8, dtype=torch.float64)
    _, _, _, _, pipes = _pipes(Case(model, loss_fn, (x, y), 4))
    run_pipes(lambda r: pipes[r].step(x, y), PP)
    if loss == "object":
        loss_fn.w, match = 3.0, r"loss_fn attribute w changed after compile \(1\.0 -> 3\.0\)"
    elif loss == "partial":
        loss_fn.keywords["w"], match = 3.0, r"loss_fn's bound keyword w changed"
    elif loss == "helper global":
        POWER, match = 3, r"loss_fn's global POWER changed after compile \(2 -> 3\)"
    elif loss == "module buffer":
        loss_fn.weight, match = torch.full((3,), 2.0, dtype=torch.float64), r"buffer loss_fn\.weight was replaced"
    else:
        weights, match = weights * 2, r"loss_fn's weights was replaced"
    try:
        for r in range(PP):
            with pytest.raises(UsageError, match=match):
                pipes[r].step(x, y)
    finally:
        POWER = 2


def test_hooks_for_every_module_and_a_swapped_hook_are_refused():
    """A hook registered for every module (torch.nn.modules.module.register_module_forward_hook) after compile,
    and a traced forward hook removed while another module gets one (the hook count unchanged): the step ran
    without them, silently. A global backward hook at compile is refused before tracing, naming it."""
    from torch.nn.modules.module import register_module_forward_hook, register_module_full_backward_hook

    model, loss_fn, (x, y), _ = mlp(layers=4, batch=8)
    traced = _first(model, torch.nn.Linear).register_forward_hook(lambda m, i, o: o * 2)
    _, _, x, y, pipes = _pipes(Case(model, loss_fn, (x, y), 4))
    handle = register_module_forward_hook(lambda m, i, o: None)
    try:
        for r in range(PP):
            with pytest.raises(UsageError, match=r"added to or removed from every module"):
                pipes[r].step(x, y)
    finally:
        handle.remove()
    for pipe in pipes:   # each rank's copy of the model: its first Linear's hook moves to the second
        layers = [m for m in pipe.model.modules() if isinstance(m, torch.nn.Linear)]
        del layers[0]._forward_hooks[traced.id]
        layers[1].register_forward_hook(lambda m, i, o: o * 2)
    for r in range(PP):
        with pytest.raises(UsageError, match=r"hook was added to or removed from"):
            pipes[r].step(x, y)
    handle = register_module_full_backward_hook(lambda m, gi, go: None)
    try:
        with pytest.raises(UsageError, match="backward hook is registered for every module"):
            zb.compile(model, schedule="1f1b", microbatches=M, loss_fn=loss_fn, example=(x[:2], y[:2]))
    finally:
        handle.remove()


class _Calibrated(torch.nn.Linear):
    """Extra state through torch's API (a quantization calibration), kept on the module."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calibration = {"amax": 1.0}

    def get_extra_state(self):
        return dict(self.calibration)

    def set_extra_state(self, state) -> None:
        self.calibration = dict(state)


class _Renamed(torch.nn.Linear):
    """Its own state-dict code: an extra entry saved, a legacy name of its weight accepted on load."""

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "version"] = torch.tensor(2)

    def _load_from_state_dict(self, state_dict, prefix, *args):
        if prefix + "w_old" in state_dict:
            state_dict[prefix + "weight"] = state_dict.pop(prefix + "w_old")
        state_dict.pop(prefix + "version", None)
        super()._load_from_state_dict(state_dict, prefix, *args)


def test_a_modules_own_state_dict_code_runs_on_the_pipe(tmp_path):
    """torch's extra-state API made pipe.state_dict() raise torch's internal RuntimeError ("should never be
    called"), and a module's own _save_to_state_dict / _load_from_state_dict were skipped (its extra key
    missing, a legacy key not loaded). The pipe's state dict has eager's keys and values for this rank's
    modules, and loads what eager loads. zbcompile.checkpoint refuses extra state before writing anything."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(_Calibrated(8, 8), torch.nn.Tanh(), _Renamed(8, 8), torch.nn.Tanh(),
                                torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)).double()
    x, y = torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64)
    _, _, _, _, pipes = _pipes(Case(model, _plain_loss, (x, y), 4), split_points=["4"])
    want = model.state_dict()
    legacy = {("2.w_old" if k == "2.weight" else k): torch.zeros_like(v) if isinstance(v, torch.Tensor) else v
              for k, v in want.items()}
    assert want["0._extra_state"] == {"amax": 1.0} and "2.version" in want

    def run(r):
        pipe = pipes[r]
        got = pipe.state_dict()
        for k, v in got.items():
            assert k in want and (torch.equal(v, want[k]) if isinstance(v, torch.Tensor) else v == want[k]), k
        if r == 0:
            assert {"0._extra_state", "2.version", "2.weight"} <= got.keys(), got.keys()
            pipe.model[0].calibration = {"amax": 3.0}   # the module's state: the pipe's state dict reads it
            assert pipe.state_dict()["0._extra_state"] == {"amax": 3.0}
            pipe.load_state_dict(dict(legacy))   # strict: the module's own load code renames the legacy key
            assert torch.equal(pipe.get_parameter("2.weight"), torch.zeros(8, 8, dtype=torch.float64))
            before = {k: v.clone() for k, v in pipe.state_dict().items() if isinstance(v, torch.Tensor)}
            with pytest.raises(CheckpointError, match=r"unexpected: 2\.w_older"):   # and nothing is left written
                pipe.load_state_dict({**{k: v + 1 if isinstance(v, torch.Tensor) else v for k, v in legacy.items()
                                         if k != "2.w_old"},
                                      "2.w_older": legacy["2.w_old"]})
            assert all(torch.equal(v, before[k]) for k, v in pipe.state_dict().items() if k in before)
            assert pipe.model[0].calibration == {"amax": 1.0}
            with pytest.raises(CheckpointError, match=r"0\._extra_state: a module's extra state .* nothing was"):
                checkpoint.save(tmp_path / "ckpt", pipe)   # (DCP would flatten it into keys a load cannot match)
            assert not list(tmp_path.iterdir())
        return pipe.step(x, y)

    assert all(torch.isfinite(torch.tensor(v)) for v in run_pipes(run, PP))


class _HalvedOnSave(torch.nn.Linear):
    """A storage convention kept by state-dict hooks (as quantization and parametrization code keep one): the
    weight is saved halved with a `format` entry beside it, and doubled back on load."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.calls = []
        self.register_state_dict_pre_hook(lambda m, prefix, keep_vars: m.calls.append("save"))
        self._register_state_dict_hook(self._halve)
        self._register_load_state_dict_pre_hook(self._double)
        self.register_load_state_dict_post_hook(lambda m, keys: m.calls.append("loaded"))

    @staticmethod
    def _halve(module, destination, prefix, local_metadata):
        destination[prefix + "weight"] = destination[prefix + "weight"] / 2
        destination[prefix + "format"] = torch.tensor(2)

    @staticmethod
    def _double(state_dict, prefix, *args):
        state_dict[prefix + "weight"] = state_dict[prefix + "weight"] * 2
        state_dict.pop(prefix + "format", None)


def test_a_modules_state_dict_hooks_run_on_the_pipe_and_the_whole_models_state_dict_loads_strictly():
    """The state-dict hooks of the user's modules never ran on the pipe: its state dict held the weight
    unhalved and no `format` (loaded into the plain model, the weight came out doubled, silently), and the plain
    model's own state dict was refused. The hooks run now, with the user's module as theirs, so the pipe's
    state dict is the plain model's for this rank's entries both ways. And the plain model's whole state dict
    loads with strict=True (the other ranks' entries are the model's, not unexpected); a key of no stage is
    still refused, as a CheckpointError that is also torch's RuntimeError."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(_HalvedOnSave(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8),
                                torch.nn.Linear(8, 8)).double()
    x, y = torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64)
    other = copy.deepcopy(model)
    for p in other.parameters():
        torch.nn.init.normal_(p, generator=torch.Generator().manual_seed(3))
    model, loss_fn, _, _, pipes = _pipes(Case(model, _plain_loss, (x, y), 4), split_points=["2"])
    want_sd = model.state_dict()
    ref = copy.deepcopy(other)
    want = eager_step(ref, loss_fn, x, y, M)

    def run(r):
        pipe = pipes[r]
        got = pipe.state_dict()
        assert all(torch.equal(v, want_sd[k]) for k, v in got.items()), r
        assert r != 0 or {"0.weight", "0.format"} <= got.keys()
        with pytest.raises(RuntimeError, match=r"unexpected: 9\.weight"):
            pipe.load_state_dict({**other.state_dict(), "9.weight": torch.zeros(1)})
        result = pipe.load_state_dict(other.state_dict())
        assert not result.missing_keys and not result.unexpected_keys, result
        return pipe.step(x, y)

    assert all(abs(loss - want) <= 1e-12 * abs(want) for loss in run_pipes(run, PP))
    assert torch.equal(pipes[0].get_parameter("0.weight"), other[0].weight)
    assert {"save", "loaded"} <= set(pipes[0].model[0].calls)
    for pipe in pipes:
        for n, p in pipe.named_parameters():
            assert rel(p.grad, ref.get_parameter(n).grad) <= 1e-10, n


def test_swa_update_bn_on_a_pipe_is_refused_before_it_resets_the_statistics():
    """torch.optim.swa_utils.update_bn(loader, pipe) found no batch norm among the pipe's containers and returned
    having done nothing. Their batch norms are batch norms to torch now (settings, repr, a state dict without
    num_batches_tracked loads as into nn.BatchNorm2d), and update_bn is refused before any statistic changes:
    the compiled step would average them with its traced momentum, not update_bn's cumulative one."""
    from torch.optim import swa_utils

    model, _, x, y, pipes = _pipes(convnet(blocks=4, batch=8))
    bn = model.features[0].bn

    def run(r):
        pipe = pipes[r]
        norms = [m for m in pipe.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
        assert norms and all(m.momentum == bn.momentum and m.eps == bn.eps for m in norms), norms
        assert f"{bn.num_features}, eps={bn.eps}, momentum={bn.momentum}" in repr(pipe)
        before = copy.deepcopy(pipe.state_dict())
        with pytest.raises(UsageError, match="update_bn does this.*nothing was changed"):
            swa_utils.update_bn([x], pipe)
        with pytest.raises(UsageError, match="momentum = None"):
            norms[0].momentum = None
        norms[0].momentum = bn.momentum   # the same value is no change
        old = {k: v for k, v in before.items() if not k.endswith("num_batches_tracked")}
        pipe.load_state_dict(old)   # a checkpoint from before num_batches_tracked existed, strict as eager takes it
        after = pipe.state_dict()
        assert after.keys() == before.keys() and all(torch.equal(before[k], after[k]) for k in before)
        return pipe.step(x, y)

    assert all(torch.isfinite(torch.tensor(loss)) for loss in run_pipes(run, PP))


def test_a_hook_added_after_compile_is_refused():
    """A forward hook or a gradient hook registered on the compiled model after compile: the traced graphs never
    call it (it was dropped without a word)."""
    _, _, x, y, pipes = _pipes(mlp(layers=4, batch=8))
    handles = {}

    def add(kind):
        def change(model):   # (a gradient hook on a parameter of this rank: another rank's it never makes)
            held = {id(p) for pipe in pipes if pipe.model is model for p in pipe.parameters()}
            target = (next(p for p in model.parameters() if id(p) in held) if kind == "grad"
                      else _first(model, torch.nn.Linear))
            handles[id(model)] = (target.register_hook(lambda g: g * 0) if kind == "grad"
                                  else target.register_forward_hook(lambda *a: None))
        return change

    for kind in ("grad", "forward"):
        _refused_then_trains(pipes, x, y, add(kind), lambda m: handles.pop(id(m)).remove(),
                             "a hook was added to or removed from .* after compile")


def test_a_hook_on_the_pipe_itself_is_refused_where_step_would_never_run_it():
    """A backward hook registered on the PipelineModule was accepted and never called by step() (eager calls it in
    every backward); a forward hook ran for pipe(x) only, never in step() or evaluate(). Both are refused, and
    nothing is registered."""
    _, _, x, y, pipes = _pipes(mlp(layers=4, batch=8))
    pipe = pipes[0]
    for register in (pipe.register_forward_hook, pipe.register_forward_pre_hook, pipe.register_full_backward_hook,
                     pipe.register_full_backward_pre_hook, pipe.register_backward_hook):
        with pytest.raises(UsageError, match="on the PipelineModule itself would never run in step"):
            register(lambda *a: None)
    assert not (pipe._forward_hooks or pipe._forward_pre_hooks or pipe._backward_hooks or pipe._backward_pre_hooks)


def test_a_gradient_hook_on_a_parameter_one_rank_holds_is_refused_on_every_rank():
    """The user's loop adds a gradient hook to one parameter on every rank: only rank 0 holds it, and only rank 0
    refused; rank 1 ran into the step and waited out the timeout for rank 0's activations (RuntimeFailure, the
    process groups lost). Every rank now also watches the other ranks' parameters (on meta there)."""
    _, _, x, y, pipes = _pipes(mlp(layers=4, batch=8))
    handles = {}

    def add(model):
        handles[id(model)] = _first(model, torch.nn.Linear).weight.register_hook(lambda g: g * 2)

    _refused_then_trains(pipes, x, y, add, lambda m: handles.pop(id(m)).remove(),
                         r"a hook was added to or removed from 0.weight after compile")


@pytest.mark.parametrize("hook", ["grad", "post_accumulate", "full_backward"])
def test_hooks_the_compiled_step_would_never_call_are_refused_before_tracing(hook):
    model, loss_fn, (x, y), _ = mlp(layers=4, batch=8)
    layer = _first(model, torch.nn.Linear)
    {"grad": lambda: layer.weight.register_hook(lambda g: g * 2),
     "post_accumulate": lambda: layer.weight.register_post_accumulate_grad_hook(lambda p: None),
     "full_backward": lambda: layer.register_full_backward_hook(lambda *a: None)}[hook]()
    with pytest.raises(UsageError, match="gradient hook" if hook != "full_backward" else "backward hook"):
        zb.compile(model, schedule="1f1b", microbatches=M, loss_fn=loss_fn, example=(x[:2], y[:2]))


def test_a_loss_modules_backward_hook_is_refused_before_tracing_and_one_added_after_compile_at_the_step():
    """A backward hook on the loss module (nn.MSELoss with a hook tripling the gradient) was never called, so
    every gradient came out a third of eager's, without a word: the hook check walked the model's modules only.
    It is refused before tracing now, and a hook added to the loss module after compile at the next step."""
    model, _, (x, y), _ = mlp(layers=4, batch=8)
    loss = torch.nn.MSELoss()
    loss.register_full_backward_hook(lambda m, gi, go: tuple(g * 3 for g in gi))
    with pytest.raises(UsageError, match=r"module loss_fn \(MSELoss\) has a backward hook"):
        zb.compile(model, schedule="1f1b", microbatches=M, loss_fn=loss, example=(x[:2], y[:2]))
    _, _, x, y, pipes = _pipes(mlp(layers=4, batch=8)._replace(loss_fn=torch.nn.MSELoss()))
    for pipe in pipes:
        handle = pipe.compiled.options.loss_fn.register_forward_hook(lambda *a: None)
        with pytest.raises(UsageError, match="a hook was added to or removed from loss_fn after compile"):
            pipe.step(x, y)
        handle.remove()
    assert all(torch.isfinite(torch.tensor(v)) for v in run_pipes(lambda r: pipes[r].step(x, y), PP))


class _Ramped(torch.nn.Module):
    """Its output scaled by torch.linspace(0, 1, d): a tensor of the default dtype, made inside forward."""

    def __init__(self, ramp: bool = True) -> None:
        super().__init__()
        self.layers, self.ramp = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)]), ramp

    def forward(self, x):
        x = self.layers(x)
        return x * torch.linspace(0, 1, x.shape[-1]) if self.ramp else x


@pytest.mark.parametrize("ramp", [True, False])
def test_a_default_dtype_changed_since_compile_is_refused_where_an_op_reads_it(ramp):
    """torch.set_default_dtype(torch.float64) between compile and step: linspace then made float64 tensors in
    float32 graphs, the backward crashed with torch's raw dtype error on one rank and the other waited out its
    timeout. Every rank now refuses step() and evaluate() naming the op, and steps as eager once the default is
    back; a model without such an op is not refused (its graphs name every dtype)."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    model, loss_fn, _, _, pipes = _pipes(Case(_Ramped(ramp), torch.nn.functional.mse_loss, (x, y), 4))
    want = eager_step(copy.deepcopy(model), loss_fn, x, y, M)

    def call(r):
        if ramp:
            for what in (lambda: pipes[r].step(x, y), lambda: pipes[r].evaluate(x, y)):
                with pytest.raises(UsageError, match=r"runs under the default dtype float64 but the step was "
                                                     r"compiled under float32, and its op aten\.linspace"):
                    what()
            return None
        return pipes[r].step(x, y)

    torch.set_default_dtype(torch.float64)   # (for the whole process: every rank's thread)
    try:
        got = run_pipes(call, PP)
    finally:
        torch.set_default_dtype(torch.float32)
    if not ramp:
        assert all(abs(v - want) <= 1e-5 * abs(want) for v in got), (got, want)
    assert all(abs(v - want) <= 1e-6 * abs(want) for v in run_pipes(lambda r: pipes[r].step(x, y), PP))


def test_anomaly_detection_around_a_step_warns_that_it_has_no_effect():
    """torch.autograd.detect_anomaly() around step(): the stage graphs' backward does not run through autograd,
    so a NaN gradient came without anomaly mode's error, and nothing said so. The step now warns (and still
    equals eager); without anomaly mode it does not."""
    model, loss_fn, x, y, pipes = _pipes(mlp(batch=8))
    want = eager_step(copy.deepcopy(model), loss_fn, x, y, M)
    with pytest.warns(ZBCompileWarning, match=r"anomaly detection .* a NaN or inf gradient is written without "
                                               r"anomaly mode's error.* pipe\.grads_finite\(\)"):
        with torch.autograd.detect_anomaly(check_nan=True):
            got = run_pipes(lambda r: pipes[r].step(x, y), PP)
    assert all(abs(v - want) <= 1e-6 * abs(want) for v in got), (got, want)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ZBCompileWarning)
        run_pipes(lambda r: pipes[r].step(x, y), PP)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "set_grad_enabled(False)"])
def test_compile_called_with_gradients_off_builds_the_training_step(mode):
    """compile inside torch.no_grad() (or with gradients switched off) raised an internal SplitError
    ("unexpected forward placeholders"); inside torch.inference_mode() it made the step's static buffers
    inference tensors, so the first step outside it crashed with torch's raw error (on one rank, the other
    waiting out its timeout). compile builds the training step in whatever mode it is called: the steps, taken
    with gradients on, equal eager's. (Grad mode is per thread: each rank's thread places its share in it.)"""
    from support.threaded import LoopbackWorld
    from zbcompile.place import place
    from zbcompile.compiler import compile_programs

    model, loss_fn, (x, y), _ = mlp(batch=8)
    model, x, y = model.double(), x.double(), y.double()
    want = eager_step(copy.deepcopy(model), loss_fn, x, y, M)
    modes = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode,
             "set_grad_enabled(False)": lambda: torch.set_grad_enabled(False)}
    options = CompileOptions.from_kwargs(None, schedule="1f1b", microbatches=M, loss_fn=loss_fn,
                                         example=((x[:x.shape[0] // M],), (y[:y.shape[0] // M],)))
    with modes[mode]():
        compiled = compile_programs(model, options, PP)
    world, pipes = LoopbackWorld(PP), [None] * PP

    def build(r):
        with modes[mode]():
            pipes[r] = place(copy.deepcopy(model), compiled, (world.group(r), r, PP))
        assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()

    run_pipes(build, PP, world=world)
    got = run_pipes(lambda r: [pipes[r].step(x, y) for _ in range(2)], PP)
    assert all(abs(v[0] - want) <= 1e-12 * abs(want) for v in got), (got, want)


mean = 0.0   # a training loop's running mean of the loss: a global the model below never reads
scale = 1.0


class _AttributeNamesLikeGlobals(torch.nn.Module):
    """A forward that calls the method `mean` and reads the attribute `scale`: names a global shares here."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.scale = 0.5

    def forward(self, x):
        h = self.l1(x)
        return self.l2(torch.tanh(h - h.mean(-1, keepdim=True))) * self.scale


def test_a_global_that_shares_a_name_with_an_attribute_the_model_reads_may_change():
    """The watch of globals took every name in the forward's code (co_names) for a global it reads, attribute
    and method names too: a loop rebinding its global `mean` (or `scale`) had the next step refused ("global
    mean changed after compile"), though the model only calls the method `h.mean`. Only names the code looks up
    as globals are watched: the steps run, equal to eager's."""
    global mean, scale
    torch.manual_seed(0)
    model = _AttributeNamesLikeGlobals().double()
    x, y = torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64)
    _, loss_fn, _, _, pipes = _pipes(Case(model, _plain_loss, (x, y), 4))
    ref = copy.deepcopy(model)
    for _ in range(3):
        want = eager_step(ref, loss_fn, x, y, M)
        got = run_pipes(lambda r: pipes[r].step(x, y), PP)
        assert all(abs(v - want) <= 1e-12 * abs(want) for v in got), (got, want)
        mean, scale = 0.9 * mean + 0.1 * got[0], scale * 2


# ---- the optimizer step, for the edit loop ---------------------------------------------------------------------
def test_the_optimizer_step_clips_and_post_validates_as_eager_does():
    """The fast tier's check of step(optimizer=, max_norm=) (tests/e2e/test_training_loop.py and
    test_post_validation.py hold the full ones, all slow): a synchronous step, then two post-validated ones,
    each clipped (3-norm) with SGD, equal eager's clip_grad_norm_ + SGD step by step (loss, norm, clipped,
    every parameter; float32, the split the other tests here use)."""
    model, loss_fn, x, y, pipes = _pipes(mlp(batch=8))
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    batches = [(x, y), (x.flip(0), y), (x * 0.5, y.flip(0))]
    want = []
    for xb, yb in batches:
        loss = eager_step(ref, loss_fn, xb, yb, M)
        norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type=3.0))
        ref_opt.step()
        ref_opt.zero_grad()
        want.append((loss, norm))

    def run(r):
        opt = torch.optim.SGD(pipes[r].parameters(), lr=0.5, momentum=0.9)
        first = pipes[r].step(*batches[0], optimizer=opt, max_norm=0.05, norm_type=3.0)
        later = [pipes[r].step(*b, optimizer=opt, max_norm=0.05, norm_type=3.0, post_validate=True)
                 for b in batches[1:]]
        pipes[r].settle()
        return [(float(first), first.norm, first.clipped)] + [(float(v.loss), v.norm, v.clipped) for v in later]

    for got in run_pipes(run, PP):
        for (loss, norm, clipped), (want_loss, want_norm) in zip(got, want):
            assert abs(loss - want_loss) <= 1e-5 * abs(want_loss) and abs(norm - want_norm) <= 1e-5 * want_norm
            assert clipped and want_norm > 0.1, (got, want)
    params = dict(ref.named_parameters())
    for pipe in pipes:
        for n, p in pipe.named_parameters():
            assert rel(p.detach(), params[n].detach()) <= 1e-5, n


# ---- an error inside a step ----------------------------------------------------------------------------------
def test_after_an_error_inside_a_step_the_next_call_fails_at_once():
    """An out-of-range token id: rank 0's embedding raises IndexError (as eager does) with the step's messages
    half-exchanged; rank 1 times out. Rank 0's next step raises RuntimeFailure at once, naming the earlier error,
    instead of waiting on the peer for the timeout; a refused batch before it, though, leaves the pipeline usable."""
    timeout = 3.0
    model, loss_fn, x, y, pipes = _pipes(gpt(layers=4, batch=8), timeout=timeout)
    bad = x.clone()
    bad[0, 0] = 10_000

    def run(r):
        with pytest.raises(UsageError):
            pipes[r].step((x,), (y,))   # refused before anything ran: not a failure
        try:
            pipes[r].step(bad, y)
            first = None
        except (IndexError, RuntimeFailure) as e:
            first = type(e).__name__
        start = time.perf_counter()
        with pytest.raises(RuntimeFailure, match="failed earlier .*while its program ran: IndexError"
                           if r == 0 else "failed earlier"):
            pipes[r].step(x, y)
        return first, time.perf_counter() - start

    (first0, waited0), (first1, _) = run_pipes(run, PP)
    assert (first0, first1) == ("IndexError", "RuntimeFailure")
    assert waited0 < timeout / 3, waited0


def test_an_optimizer_step_that_fails_on_one_rank_leaves_that_pipeline_unusable():
    """A hook of the user's optimizer raises on rank 1, after the ranks exchanged the step's norms: rank 0
    updated, rank 1 did not. Retried, rank 1's step paired its batch with rank 0's next one and trained on
    silently. Its next call now fails at once, naming the error; rank 0's waits for it time out."""
    timeout = 3.0
    _, _, x, y, pipes = _pipes(gpt(layers=4, batch=8), timeout=timeout)

    def run(r):
        opt = torch.optim.SGD(pipes[r].parameters(), lr=0.1)
        if r == 1:
            def fail_once(optimizer, args, kwargs):
                handle.remove()
                raise ValueError("a hook of the user's")
            handle = opt.register_step_pre_hook(fail_once)
        outcomes = []
        for _ in range(2):
            try:
                pipes[r].step(x, y, optimizer=opt, max_norm=1.0)
                outcomes.append("ok")
            except (ValueError, RuntimeFailure) as e:
                outcomes.append(str(e).splitlines()[0])
        return outcomes

    rank0, rank1 = run_pipes(run, PP)
    assert rank0[0] == "ok" and "from rank 1 failed (peer dead or stalled?)" in rank0[1], rank0
    assert rank1[0] == "a hook of the user's" and "failed earlier" in rank1[1] and "optimizer step" in rank1[1], rank1


def test_ranks_making_different_calls_together_are_told_so_on_every_rank():
    """clip_grad_norm_ on one rank and grads_finite on the other gathered values of different sizes: gloo aborted
    the process from its I/O thread, where nothing can catch it, and the peer read garbage (a norm of inf). Each
    gather now goes with a header naming its call; a norm of another order on each rank is refused too."""
    _, _, x, y, pipes = _pipes(gpt(layers=4, batch=8))
    run_pipes(lambda r: pipes[r].step(x, y), PP)
    calls = [lambda pipe: pipe.clip_grad_norm_(1.0), lambda pipe: pipe.grads_finite()]

    def run(r):
        with pytest.raises(DisagreementError, match=r"different calls of the pipeline together \(rank 0: 'the "
                                                    r"gradient norm .*rank 1: 'grads_finite\(\)'"):
            calls[r](pipes[r])
        with pytest.raises(DisagreementError, match=r"norm of different orders \(norm_type per rank: \[2.0, 1.0\]"):
            pipes[r].get_total_norm(2.0 if r == 0 else 1.0)
        return float(pipes[r].get_total_norm())   # and the pipeline goes on

    first, second = run_pipes(run, PP)
    assert first == second and first > 0


def test_copying_or_pickling_a_pipeline_is_refused_with_what_to_do_instead():
    """AveragedModel (an EMA) deep-copies its module: the copy failed on a process group's pickling."""
    import pickle

    _, _, _, _, pipes = _pipes(mlp(layers=4, batch=8))
    for attempt in (lambda: copy.deepcopy(pipes[0]), lambda: torch.optim.swa_utils.AveragedModel(pipes[0]),
                    lambda: pickle.dumps(pipes[0])):
        with pytest.raises(UsageError, match=r"cannot be copied .* For an EMA of the weights keep copies"):
            attempt()


def test_a_batch_that_does_not_split_says_the_size_the_step_takes():
    """4 microbatches of the example's 2 rows: 6 rows are refused naming 8 (the message said "a multiple of 4",
    but 12 rows are refused as well: static shapes)."""
    _, _, x, y, pipes = _pipes(mlp(layers=4, batch=8))
    with pytest.raises(UsageError, match=r"has 6 rows, which do not split into 4 equal microbatches; the compiled "
                                         r"step takes 4 microbatches of 2 rows \(example's\), a batch of 8 rows"):
        pipes[0].step(x[:6], y[:6])


def test_a_call_refused_on_one_rank_only_is_found_at_the_next_step():
    """Rank 1 alone refuses a batch (a UsageError it catches, as a loop skipping bad batches would); rank 0's
    next step then pairs with rank 1's next but one, mixing two batches. Both ranks now raise DisagreementError
    naming the calls (it trained on silently before); evaluate() counts its calls the same way."""
    _, _, x, y, pipes = _pipes(mlp(layers=4, batch=8))

    def run(r):
        pipes[r].step(x, y)
        if r == 1:
            with pytest.raises(UsageError):
                pipes[r].step(x[:6], y[:6])
        with pytest.raises(DisagreementError) as err:
            pipes[r].step(x * 2, y)
        pipes[r].evaluate(x, y)   # its own count: in step
        return str(err.value)

    for r, text in enumerate(run_pipes(run, PP)):
        assert text.startswith(f"rank {r}: the ranks are out of step (rank 0: call 2; rank 1: call 3)"), text


def test_rank_program_refuses_a_rank_the_pipeline_does_not_have(mlp_pipes):
    """rank_program(5) raised a raw IndexError, rank_program('0') a TypeError, rank_program(-1) gave the last."""
    pipe = mlp_pipes[4][0]
    assert "send" in pipe.rank_program(1).code or "recv" in pipe.rank_program(1).code
    for bad in (5, -1, "0"):
        with pytest.raises(UsageError, match=r"rank is one of 0\.\.1"):
            pipe.rank_program(bad)


def test_a_rank_outside_the_group_it_is_given_is_told_so():
    """dist.new_group(ranks) gives the ranks outside `ranks` a placeholder int: named as such, not as "group=-100
    (int) is not a process group"."""
    import torch.distributed as dist

    from zbcompile.distributed import resolve_group

    with pytest.raises(UsageError, match="is not a member of the group given to compile"):
        resolve_group(dist.GroupMember.NON_GROUP_MEMBER, 30.0)
