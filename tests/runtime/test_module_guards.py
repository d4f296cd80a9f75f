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
import time

import pytest
import torch

import zbcompile as zb
from support.loops import eager_step, rel, shard_of
from support.models import gpt, mlp
from support.threaded import loopback_pipes, run_pipes
from zbcompile.errors import RuntimeFailure, UsageError
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
    pipes[0].get_parameter("0.weight").requires_grad_(False)
    run_pipes(lambda r: pipes[r].step(x, y), PP)   # frozen again: trains


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
    pipe = pipes[0]
    cases = [(pipe.step, ((x,), (y,)), r"step\(\) takes the whole batch as flat tensors, step\(\*inputs, "
                                       r"\*targets\); batch argument 0 is a tuple: unpack the nested"),
             (pipe.step, (x.tolist(), y), r"batch argument 0 is a list: pass a torch.Tensor"),
             (pipe.step, (x.to("meta"), y.to("meta")), r"step\(\) got batch argument 0 on the meta device.*on cpu"),
             (pipe.evaluate, ((x,), (y,)), r"evaluate\(\*inputs, \*targets\); batch argument 0 is a tuple"),
             (pipe, ([x],), r"pipe\(\*inputs\); batch argument 0 is a list: unpack"),
             (pipe.step, (x.clone().requires_grad_(), y), r"batch argument 0 requiring grad.*pass it detached"),
             (pipe.step, (x.double(), y), r"batch argument 0 is torch.float64, but the model was compiled for "
                                          r"torch.float32 from `example`: pass it as .to\(torch.float32\)")]
    for call, batch, message in cases:
        with pytest.raises(UsageError, match=message):
            call(*batch)
    losses = run_pipes(lambda r: pipes[r].step(x, y), PP)
    assert losses[0] == losses[1]


@pytest.mark.parametrize("group", ["gloo", 3])
def test_a_group_that_is_not_a_process_group_is_refused(group):
    model, loss_fn, (x, y), _ = mlp(layers=4, batch=8)
    with pytest.raises(UsageError, match=r"is not a process group: compile's group takes a ProcessGroup .* "
                                         r"1-D DeviceMesh .* \('dp', 'pp'\), or None"):
        zb.compile(model, schedule="1f1b", microbatches=M, loss_fn=loss_fn, example=(x[:2], y[:2]), group=group)


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
