"""CompileOptions and the compiler core (zbcompile/options.py, zbcompile/compiler.py).

Every option is checked before anything is traced: a bad value raises UsageError naming the option and what it
accepts, even for a model whose forward would fail (so nothing ran). compile_programs is the one way to build
rank programs: pure (no process group), and the same programs as the split and the lowering run by hand.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zbcompile as zb
from zbcompile.compiler import compile_programs, compile_staged, split_for
from zbcompile.errors import UsageError
from zbcompile.ir.costs import Costs
from zbcompile.options import WARMUP_STEPS, CompileOptions
from zbcompile.passes.lower import lower_all
from zbcompile.passes.schedules import generate
from zbcompile.pipeline_module import PipelineModule
from zbcompile.split import split_model


class Untraceable(nn.Module):
    """A model whose forward fails: any error other than our UsageError means it was traced."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        raise AssertionError("traced: the option was not checked before tracing")


def _loss(out, y):
    return nn.functional.mse_loss(out, y)


GOOD = dict(schedule="1f1b", microbatches=2, loss_fn=_loss, example=((torch.randn(1, 4),), (torch.randn(1, 4),)))

BAD = [
    ("schedule", "zb-h3", "zb-h1"), ("schedule", 3, "a zbcompile.Schedule"),
    ("microbatches", 0, "positive int"), ("microbatches", 2.0, "positive int"), ("microbatches", True, "positive"),
    ("loss_fn", "mse", "callable"), ("pp", 0, "positive int or None"), ("chunks", -1, "positive int or None"),
    ("split_points", "blocks.2", "list of module names"), ("split_points", [1, 2], "list of module names"),
    ("costs", 3, "zbcompile.Costs"), ("mem_limit", -1.0, "number > 0"), ("mem_limit", float("inf"), "finite"),
    ("init_fn", 5, "callable or None"), ("timeout", 0, "number > 0"), ("timeout", "60", "number > 0"),
    ("vocab_parallel", 1, "True or False"), ("offload", -5, "budget in bytes"), ("offload", "half", "auto"),
    ("offload", [100, 0], "one budget per rank"), ("offload", True, "budget"), ("backend", "tvm", "'inductor'"),
    ("cuda_graphs", 0, "cuda_graphs=0"), ("cuda_graphs", -1, "int n >= 1"), ("cuda_graphs", "yes", "False"),
    ("check_batch", 0, "check_batch=0"), ("check_batch", "first", "int n >= 1"),
    ("dp_bucket_mb", -1, "MiB >= 0"), ("dp_bucket_mb", float("nan"), "MiB >= 0"),
    ("dp_overlap", "yes", "True or False"), ("dp_w_pieces", 0, "positive int"), ("dp_batch", "mine", '"local"'),
    ("dp_shard", "yes", "True or False"), ("dp_gather", "layer", '"microbatch"'),
]


@pytest.mark.parametrize("name, value, says", BAD, ids=[f"{n}={v!r}" for n, v, _ in BAD])
def test_a_bad_option_is_refused_by_name_before_tracing(name, value, says):
    with pytest.raises(UsageError) as e:
        zb.compile(Untraceable(), **{**GOOD, name: value})
    assert f"{name}={value!r}" in str(e.value) and says in str(e.value), str(e.value)
    assert not dist.is_initialized()   # refused before any process group was made


def test_options_a_schedule_or_the_group_would_ignore_are_refused_before_tracing():
    """mem_limit on a schedule with a peak of its own, costs on a fixed order (vocab_parallel reads them),
    dp_gather without dp_shard, per-rank offload budgets for another number of ranks, and split points for
    another number of stages: each was ignored, or refused only after tracing."""
    cases = [(dict(schedule="zb-h2", mem_limit=1.0), "mem_limit is read only by schedule.s. zb-auto"),
             (dict(costs=Costs(f=1, b=1, w=1)), "costs is read only by schedule.s. zbv, v-zb, zb-auto"),
             (dict(split_points=["0", "1", "2"]), "runs 2 model stages, so it takes 1 split point.*names 3")]
    for more, says in cases:
        with pytest.raises(UsageError, match=says):
            compile_programs(Untraceable(), CompileOptions(**{**GOOD, **more}), 2)
    for schedule in ("zbv", "zb-auto"):   # schedules that read costs take them
        compile_programs(_mlp(), CompileOptions(**{**GOOD, "schedule": schedule, "microbatches": 4,
                                                   "costs": Costs(f=1, b=1, w=1)}), 2)
    with pytest.raises(UsageError, match="dp_gather='microbatch'.*dp_shard is off"):
        CompileOptions(**GOOD, dp_gather="microbatch")
    with pytest.raises(UsageError, match="offload has 3 budgets but the pipeline has 2 ranks"):
        CompileOptions(**GOOD, offload=[10, 20, 30]).check_ranks(2)
    with pytest.raises(UsageError, match="pp=4 but the process group has 2 ranks"):
        CompileOptions(**GOOD, pp=4).check_ranks(2)


@pytest.mark.parametrize("option", [dict(dp_batch="local"), dict(dp_overlap=False), dict(dp_bucket_mb=0),
                                    dict(dp_w_pieces=1), dict(dp_shard=True)], ids=lambda o: next(iter(o)))
def test_data_parallel_options_without_a_dp_mesh_dimension_are_refused(option):
    """dp_batch="local" (and the reductions' options) with a 1-D group changed nothing, silently, where dp_gather
    without dp_shard is refused: every data-parallel option given without a "dp" mesh dimension is refused,
    naming it; left at their defaults they pass."""
    from zbcompile.data_parallel import Replicas

    name, value = next(iter(option.items()))
    with pytest.raises(UsageError, match=f"{name}={value!r}: data-parallel option.* no 2-D"):
        Replicas.of(CompileOptions(**GOOD, **option), None)
    assert Replicas.of(CompileOptions(**GOOD), None) is None


def test_options_that_shape_a_generated_schedule_are_refused_with_a_ready_one():
    """A ready Schedule as `schedule=` dropped chunks, costs and mem_limit without a word, and vocab_parallel=True
    with a schedule without S / T actions compiled without sharding anything; each is refused before tracing.
    The schedule generated with what the options asked for compiles."""
    m = GOOD["microbatches"]
    plain, vocab = generate("1f1b", 2, m), generate("1f1b", 2, m, vocab=True)
    cases = [(dict(schedule=plain, mem_limit=1.0), "mem_limit=1.0 with a ready Schedule"),
             (dict(schedule=plain, costs=Costs(f=1, b=1, w=1)), "costs=.* with a ready Schedule"),
             (dict(schedule=generate("interleaved-1f1b", 2, m, chunks=2), chunks=3), "chunks=3 with a ready"),
             (dict(schedule=plain, vocab_parallel=True), "vocab_parallel=True .* has no vocabulary actions"),
             (dict(schedule=vocab), "vocab_parallel=False .* has vocabulary actions")]
    for more, says in cases:
        with pytest.raises(UsageError, match=says):
            compile_programs(Untraceable(), CompileOptions(**{**GOOD, **more}), 2)
    compile_programs(_mlp(), CompileOptions(**{**GOOD, "schedule": plain}), 2)


def test_unknown_and_missing_options_are_named():
    with pytest.raises(UsageError, match=r"unknown option\(s\) 'microbatch'.*microbatches"):
        zb.compile(Untraceable(), microbatch=2, **{k: v for k, v in GOOD.items() if k != "microbatches"})
    with pytest.raises(UsageError, match="needs loss_fn, example"):
        zb.compile(Untraceable(), schedule="1f1b", microbatches=2)
    with pytest.raises(UsageError, match="'tvm'"):   # the decorator form checks as early
        zb.compile(**GOOD, backend="tvm")


def test_options_are_held_in_their_normal_form():
    o = CompileOptions(**GOOD, cuda_graphs=True, offload=[10, 20], split_points=["a", "b"], costs="F=1,B=2,W=1")
    assert o.cuda_graphs == WARMUP_STEPS and o.capture
    assert o.offload == (10, 20) and o.split_points == ("a", "b") and o.costs == Costs(f=1, b=2, w=1)
    assert CompileOptions(**GOOD).cuda_graphs is False and not CompileOptions(**GOOD).capture
    assert CompileOptions(**GOOD, cuda_graphs=3).cuda_graphs == 3
    assert o.replace(microbatches=4) == CompileOptions(**{**GOOD, "microbatches": 4}, cuda_graphs=2,
                                                       offload=(10, 20), split_points=("a", "b"),
                                                       costs=Costs(f=1, b=2, w=1))


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))


@pytest.mark.parametrize("schedule", ["1f1b", "zbv", "dualpipev"])
def test_compile_programs_is_the_split_and_lowering_by_hand(schedule):
    """Pure (no process group is made) and the same programs, op for op, as split_model with the schedule's
    placement then lower_all."""
    options = CompileOptions(**{**GOOD, "schedule": schedule, "microbatches": 4})
    compiled = compile_programs(_mlp(), options, 2)
    assert not dist.is_initialized()
    sched = generate(schedule, 2, 4)
    staged = split_model(_mlp(), _loss, GOOD["example"], num_stages=sched.num_model_stages,
                         placement=sched.stage_groups())
    assert compiled.schedule.to_text() == sched.to_text()
    assert [p.to_text() for p in compiled.programs] == [p.to_text() for p in lower_all(sched, staged)]
    assert [len(compiled.stages_of(r)) for r in range(2)] == [sched.placement.count(r) for r in range(2)]


def test_split_for_and_compile_staged_refuse_what_does_not_fit():
    sched = generate("zbv", 2, 4)
    staged = split_for(_mlp(), _loss, GOOD["example"], sched)
    assert len(staged.stages) == sched.num_model_stages == 4
    options = CompileOptions(schedule=generate("1f1b", 2, 4), microbatches=4)
    with pytest.raises(UsageError, match="needs 2 model stages but the split made 4"):
        compile_staged(staged, options.schedule, options)
    with pytest.raises(UsageError, match="needs loss_fn and example"):
        compile_programs(_mlp(), options, 2)


def test_from_staged_takes_every_option():
    """PipelineModule.from_staged used to drop `backend` silently; now it takes compile's options and checks
    them before any process group is made."""
    sched = generate("1f1b", 2, 4)
    staged = split_for(_mlp(), _loss, GOOD["example"], sched)
    with pytest.raises(UsageError, match="backend='tvm'"):
        PipelineModule.from_staged(_mlp(), staged, sched, backend="tvm")
    with pytest.raises(UsageError, match=r"unknown option\(s\) 'microbatch'"):
        PipelineModule.from_staged(_mlp(), staged, sched, microbatch=4)
    assert not dist.is_initialized()


def test_a_decorated_model_class_stays_a_class_to_isinstance_and_subclassing():
    """@zb.compile(...) returned a function: `isinstance(pipe, Net)` raised TypeError and `class Big(Net)` failed
    ("function() argument 'code' must be code"). The pipelines it makes are its instances, a class derived from
    it is a plain model class (the decorator is not inherited), and it keeps the class's name and doc."""
    from support.threaded import loopback_pipes

    x = torch.randn(8, 4)
    options = dict(schedule="1f1b", microbatches=4, loss_fn=nn.functional.mse_loss, example=((x[:2],), (x[:2],)))

    @zb.compile(**options)
    class Net(nn.Sequential):
        """Four layers."""

        def __init__(self):
            super().__init__(*(nn.Linear(4, 4) for _ in range(4)))

    class Big(Net):
        pass

    assert (Net.__name__, Net.__doc__) == ("Net", "Four layers.") and "model class" in repr(Net)
    assert issubclass(Big, nn.Sequential) and isinstance(Big(), nn.Sequential) and not isinstance(Big(), Net)
    pipe = loopback_pipes(Net.__wrapped__(), CompileOptions.from_kwargs(None, **options), 2)[0]
    assert isinstance(pipe, Net) and isinstance(pipe, PipelineModule)
    assert isinstance(loopback_pipes(Big(), CompileOptions.from_kwargs(None, **options), 2)[0], Net)   # a Net too
    assert not isinstance(loopback_pipes(nn.Sequential(*(nn.Linear(4, 4) for _ in range(4))),
                                         CompileOptions.from_kwargs(None, **options), 2)[0], Net)
