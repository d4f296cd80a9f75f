"""The compiler core: a model and its options -> every rank's program, in one pure function.

    compiled = compile_programs(model, options, num_ranks=2)
    compiled.schedule               the Schedule (generated from options.schedule, or the one given)
    compiled.staged                 the StagedModel (trace -> partition -> [shard_vocab] -> split_fbw)
    compiled.programs[r]            rank r's finished RankProgram (lowered, offloaded, checked for capture)
    compiled.offload                per rank, what activation offload chose (None without offload)

No process group and no runtime: `zbcompile.api` places the result on the ranks of a process group, `inspect`
prints it, the tests' loopback world and the benchmarks run it. Each stage of the compile logs its time on the
`zbcompile` logger (silent unless configured).

The stages, and the options each reads:

    schedule_for   options.schedule / microbatches / chunks / costs / mem_limit / vocab_parallel -> Schedule
    split_for      options.loss_fn / example / split_points, the schedule's placement      -> StagedModel
    lower          passes.lower.lower_all with the pass lists options.cuda_graphs / backend pick
    offload        options.offload: plan_offload per rank, then the one offload entry of the lowering
    check_capture  with cuda_graphs: what blocks CUDA-graph capture, as CaptureError
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
import warnings
from contextlib import contextmanager
from typing import Sequence

import torch
from torch import nn

from zbcompile.errors import UsageError, ZBCompileWarning
from zbcompile.ir.names import Role, key_of, role_of
from zbcompile.ir.program import RankProgram
from zbcompile.ir.schedule import Kind, Schedule
from zbcompile.ir.stages import StagedModel
from zbcompile.options import CompileOptions

__all__ = ["Compiled", "compile_programs", "compile_staged", "compile_forward", "compile_boundary", "schedule_for",
           "split_for", "lower", "check_fits", "TIME_MODELS"]

log = logging.getLogger("zbcompile")

# the offload planner's time model for a device type (passes/analysis/offload_plan.DEVICES)
TIME_MODELS = {"cuda": "h100", "cpu": "cpu"}


@dataclasses.dataclass(frozen=True, eq=False)
class Compiled:
    """What one compile made, for every rank."""

    options: CompileOptions
    staged: StagedModel
    schedule: Schedule
    programs: tuple[RankProgram, ...]
    offload: tuple | None = None   # per rank, an offload_plan.RankOffload (None: no offload asked for)
    replicas: int = 1              # data-parallel replicas the programs average their gradients over

    def stages_of(self, rank: int) -> list:
        """The model stages `rank` runs, in the schedule's stage order (a model stage once per placement)."""
        sched = self.schedule
        return [self.staged.stages[sched.model_stage(s)] for s, r in enumerate(sched.placement) if r == rank]

    def counted_params(self, rank: int) -> tuple[str, ...]:
        """The parameters whose gradients `rank` counts in a pipeline-wide sum (a norm, an inf check): each
        parameter once over the pipeline, on the lowest rank holding it (a tied or mirrored parameter has a full
        gradient on every rank holding it), and this rank's rows of every vocabulary parameter (disjoint)."""
        from zbcompile.distributed import holders

        mine = [n for n, ranks in holders(self.schedule, self.staged).items()
                if not n.startswith("buffer:") and ranks[0] == rank]
        vocab = self.staged.vocab.params if self.staged.vocab is not None else ()
        return tuple(dict.fromkeys([*mine, *vocab]))


def building(fn):
    """`fn` run with gradients on and outside inference mode, whatever mode its caller is in (compile called
    inside torch.no_grad() or torch.inference_mode()): the trace differentiates the step, and the tensors
    compile makes (the step's static buffers) are written by every step, which inference tensors cannot be."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        with torch.inference_mode(False), torch.enable_grad():
            return fn(*args, **kwargs)
    return call


@building
def compile_programs(model: nn.Module, options: CompileOptions, num_ranks: int, *,
                     device: torch.device | str | None = None, time_model: str | None = None,
                     lint_capture: bool = True, replicas: int = 1) -> Compiled:
    """Trace, split, schedule and lower `model` for `num_ranks` pipeline ranks, each pipeline one of `replicas`
    data-parallel replicas (more than one: the programs average the gradients over them). `device`: where the
    ranks run (a model on the meta device is traced with the example moved there; None: as given). time_model:
    the offload planner's device model (h100, a100, cpu; default by the device's type). lint_capture: with
    cuda_graphs, raise CaptureError for programs that cannot be captured (inspect --capture-check lists the
    problems instead)."""
    with _phase("schedule", f"{options.schedule if isinstance(options.schedule, str) else options.schedule.name}, "
                            f"{num_ranks} ranks, {options.microbatches} microbatches"):
        schedule = schedule_for(options, num_ranks)
    with _phase("split", f"{schedule.num_model_stages} model stages (trace, partition, split F/B/W)"):
        staged = split_for(model, options.loss_fn, options.example, schedule, split_points=options.split_points,
                           device=device)
    return compile_staged(staged, schedule, options, device=device, time_model=time_model,
                          lint_capture=lint_capture, replicas=replicas)


def compile_staged(staged: StagedModel, schedule: Schedule, options: CompileOptions, *,
                   device: torch.device | str | None = None, time_model: str | None = None,
                   offload_choices: Sequence | None = None, lint_capture: bool = True,
                   replicas: int = 1) -> Compiled:
    """compile_programs from an already split model (split once, try several schedules or options).
    offload_choices: one passes.lower.OffloadChoice per rank (or None), taken as they are instead of planning
    options.offload (the tests and benchmarks that try given choices)."""
    check_fits(staged, schedule)
    with _phase("lower", f"{schedule.name}, {schedule.num_ranks} ranks"):
        programs = lower(schedule, staged, options, replicas)
    report = None
    if offload_choices is not None:
        programs = _with_offload(programs, offload_choices)
    elif options.offload is not None:
        with _phase("offload", str(options.offload)):
            programs, report = _offload(programs, options.offload, time_model or TIME_MODELS.get(
                torch.device(device or "cpu").type, "cpu"))
    if options.capture and lint_capture:
        from zbcompile.passes.analysis.capture import check_capture

        check_capture(programs)
    _warn_mirrored_buffer_updates(staged, schedule)
    compiled = Compiled(options, staged, schedule, programs, report, replicas)
    _warn_ranks_without_parameters(compiled)
    return compiled


def compile_forward(compiled: Compiled, training: bool, outputs: bool = False,
                    microbatches: int | None = None, means: bool = False) -> tuple[RankProgram, ...]:
    """Every rank's forward-only program for `compiled` (an evaluation step): the schedule's F actions over the
    same split's forward graphs without their backward outputs (passes/forward_only.py), in train or eval mode,
    lowered as the training step is (no CUDA-graph capture: it runs eagerly). With `outputs`, the loss stage
    returns the model's outputs instead of the loss (the program returns them: OUTPUTS). microbatches: that
    many microbatches of the compiled shape instead of the schedule's number (a batch of another size). means:
    Bernoulli draws eval mode cannot switch off become their expectation (checked: zbcompile/eval_check.py)."""
    from zbcompile.passes.forward_only import forward_stages, output_stages

    staged = (output_stages if outputs else forward_stages)(compiled.staged, training, means)
    schedule = compiled.schedule.forward_only(loss=not outputs, microbatches=microbatches)
    if outputs:
        _check_one_output_rank(compiled.schedule, staged)
    with _phase("lower", f"{schedule.name} ({'train' if training else 'eval'} mode)"):
        return lower(schedule, staged, dataclasses.replace(compiled.options, cuda_graphs=False), compiled.replicas)


def compile_boundary(compiled: Compiled):
    """Every rank's post-validated step (passes/lower/step_boundary.py): (first, validating, tags), the step with
    the prefix chain at its end, and the same step validating the last one at its deadline."""
    from zbcompile.passes.lower.step_boundary import boundary_programs

    with _phase("lower", f"{compiled.schedule.name} post-validated"):
        return boundary_programs(compiled.programs)


def _check_one_output_rank(schedule: Schedule, staged: StagedModel) -> None:
    """The model's outputs come back whole on one rank: refuse a schedule that runs the loss stage on several
    (DualPipe's two directions each end in a copy of it)."""
    last = len(staged.stages) - 1
    ranks = sorted({r for r, acts in enumerate(schedule.ranks) for a in acts
                    if a.kind is Kind.F and schedule.model_stage(a.stage) == last})
    if len(ranks) > 1:
        raise UsageError(f"schedule {schedule.name!r} runs the last stage on ranks {ranks}, so the model's outputs "
                         "would come back in pieces; call evaluate(*batch) for the loss, or compile with a schedule "
                         "that ends on one rank (1f1b, zbv, dualpipev ...) to get the outputs")


def schedule_for(options: CompileOptions, num_ranks: int) -> Schedule:
    """The schedule options ask for on `num_ranks` ranks: generated from its name, or the given one checked."""
    schedule, m = options.schedule, options.microbatches
    if isinstance(schedule, Schedule):
        if schedule.num_ranks != num_ranks or schedule.num_microbatches != m:
            raise UsageError(f"schedule {schedule.name!r} is for {schedule.num_ranks} ranks and "
                             f"{schedule.num_microbatches} microbatches, not pp={num_ranks}, microbatches={m}")
        _check_ready(schedule, options)
        return schedule.validate().check_order()
    from zbcompile.passes.schedules import generate

    _check_read(options)
    return generate(schedule, num_ranks, m, chunks=options.chunks, costs=options.costs,
                    mem_limit=options.mem_limit, vocab=options.vocab_parallel)


def _check_ready(schedule: Schedule, options: CompileOptions) -> None:
    """UsageError for the options that shape a generated schedule (chunks, costs, mem_limit, vocab_parallel)
    given with a ready Schedule, which has its order, stages and vocabulary actions already: they would be
    ignored without a word (vocab_parallel=True with a schedule without S / T actions: nothing sharded)."""
    given = [name for name in ("chunks", "costs", "mem_limit") if getattr(options, name) is not None]
    if given:
        raise UsageError(f"{given[0]}={getattr(options, given[0])!r} with a ready Schedule ({schedule.name!r}): "
                         f"{given[0]} shapes a schedule as it is generated, and this one is made already, so it "
                         f"would be ignored. Drop {given[0]}, or pass it to zbcompile.generate(..., {given[0]}=...) "
                         "or give the schedule by name")
    if bool(schedule.vocab_shards) != bool(options.vocab_parallel):
        has = "has" if schedule.vocab_shards else "has no"
        raise UsageError(f"vocab_parallel={options.vocab_parallel} with a ready Schedule ({schedule.name!r}) that "
                         f"{has} vocabulary actions (S / T): generate it with vocab={bool(options.vocab_parallel)} "
                         "(zbcompile.generate), or give the schedule by name")


def _check_read(options: CompileOptions) -> None:
    """UsageError for mem_limit or costs given to a schedule that does not read them (a fixed order whatever the
    costs; a peak of its own), which would otherwise be ignored without a word. Vocabulary parallelism reads
    costs whatever the schedule (it places its S / T actions by them)."""
    from zbcompile.passes.schedules import SCHEDULES

    accepts = SCHEDULES[options.schedule].accepts   # (a name CompileOptions has checked)
    unread = [name for name in ("mem_limit", "costs") if getattr(options, name) is not None
              and name not in accepts and not (name == "costs" and options.vocab_parallel)]
    if unread:
        readers = [n for n, spec in SCHEDULES.items() if unread[0] in spec.accepts]
        raise UsageError(f"{unread[0]} is read only by schedule(s) {', '.join(readers)}"
                         f"{' (and by vocab_parallel)' if unread[0] == 'costs' else ''}; schedule "
                         f"{options.schedule!r} runs a fixed order with a peak of its own and would ignore it: drop "
                         f"{unread[0]}, or pick one of those schedules")


@building
def split_for(model: nn.Module, loss_fn, example, schedule: Schedule, *, split_points=None,
              device: torch.device | str | None = None) -> StagedModel:
    """The split `schedule` needs: its number of model stages, cuts balanced per group of ranks that run a
    stage (`Schedule.stage_groups`) unless `split_points` says where, vocabulary layers sharded over
    every rank when the schedule has vocabulary actions. A model on the meta device is traced with the
    example moved to `device` (where given), so that the tensors its graphs create land where the rank runs."""
    from zbcompile.distributed import is_meta, to_device
    from zbcompile.split import split_model

    if loss_fn is None or example is None:
        raise UsageError("compiling a model needs loss_fn and example (one microbatch's (inputs, targets)); "
                         "only a model split already (PipelineModule.from_staged) goes without")
    if split_points is not None:
        _check_split_count(split_points, schedule)
    if device is not None and is_meta(model):
        example = to_device(example, torch.device(device))
    groups = schedule.stage_groups()   # one group (every stage on one rank): balance the stages themselves
    return split_model(model, loss_fn, example, num_stages=schedule.num_model_stages, split_points=split_points,
                       placement=groups if len(set(groups)) > 1 else None,
                       vocab_shards=schedule.num_ranks if schedule.vocab_shards else None)


def _check_split_count(split_points, schedule: Schedule) -> None:
    from zbcompile.split import split_point_names

    n, stages = len(split_point_names(split_points)), schedule.num_model_stages
    if n + 1 != stages:
        raise UsageError(f"schedule {schedule.name!r} on {schedule.num_ranks} ranks runs {stages} model stages, so "
                         f"it takes {stages - 1} split point(s), but split_points names {n}: give {stages - 1}, or "
                         "leave split_points out for a balanced split")


def check_fits(staged: StagedModel, schedule: Schedule) -> None:
    """UsageError where a split and a schedule built apart do not go together."""
    if schedule.num_model_stages != len(staged.stages):
        raise UsageError(f"schedule {schedule.name!r} needs {schedule.num_model_stages} model stages but the "
                         f"split made {len(staged.stages)}")
    if bool(schedule.vocab_shards) != (staged.vocab is not None):
        raise UsageError(f"schedule {schedule.name!r} {'has' if schedule.vocab_shards else 'has no'} vocabulary "
                         f"actions but the model was split {'without' if staged.vocab is None else 'with'} "
                         "vocabulary parallelism; build both with vocab_parallel / vocab_shards, or neither "
                         "(passes.schedules.vocab.insert_vocab adds the vocabulary actions to a schedule)")


def lower(schedule: Schedule, staged: StagedModel, options: CompileOptions,
          replicas: int = 1) -> tuple[RankProgram, ...]:
    """Every rank's finished program: passes.lower.pipeline's pass list for the options (with `replicas` > 1,
    the gradients' data-parallel reductions placed as options.dp_bucket_mb / dp_overlap say)."""
    from zbcompile.passes.lower import DataParallel, Lowering, lower_all

    # activation offload pairs each F's saved tensors with one W: the W's stay whole there
    dp = (DataParallel(options.dp_bucket_mb, options.dp_overlap, 1 if options.offload else options.dp_w_pieces,
                       shard=replicas if options.dp_shard else 0, gather=options.dp_gather)
          if replicas > 1 else None)
    return lower_all(schedule, staged, Lowering(capture=options.capture, backend=options.backend, dp=dp))


def _offload(programs, budget, time_model: str):
    """Plan the offload for `budget` (bytes, per-rank bytes or "auto") on every rank and add it."""
    from zbcompile.passes.analysis.offload_plan import DEVICES, plan_offload

    report = plan_offload(programs, budget, device=DEVICES[time_model])
    return _with_offload(programs, [r.choice for r in report]), report


def _with_offload(programs, choices):
    from zbcompile.passes.lower import offload_programs

    return offload_programs(programs, choices)


@contextmanager
def _phase(name: str, what: str):
    """Log a compile phase's start and time (`zbcompile` logger: INFO, silent unless configured)."""
    log.info("%s: %s ...", name, what)
    start = time.perf_counter()
    yield
    log.info("%s: done in %.2f s", name, time.perf_counter() - start)


def _warn_ranks_without_parameters(compiled: Compiled) -> None:
    """A rank whose stages hold no parameter (ops only: the cuts fell between a model's few layers) trains
    nothing, and the usual loop's `torch.optim.AdamW(pipe.parameters())` raises torch's "empty parameter list"
    there: say so at compile, with the ways out."""
    if compiled.staged.vocab is not None:   # every rank holds rows of the vocabulary parameters
        return
    empty = [r for r in range(compiled.schedule.num_ranks) if not any(st.params for st in compiled.stages_of(r))]
    if empty:
        warnings.warn(ZBCompileWarning(
            f"schedule {compiled.schedule.name!r}: rank(s) {empty} hold no parameter (their stages only run "
            "ops), so an optimizer built from pipe.parameters() there raises torch's \"empty parameter list\". Make "
            "the optimizer only where there are parameters (`if any(True for _ in pipe.parameters())`), or give "
            "split_points that put a layer on every rank"), stacklevel=3)


def _warn_mirrored_buffer_updates(staged: StagedModel, schedule: Schedule) -> None:
    """DualPipe runs each model stage on two ranks, each copy for half of the microbatches. Buffers the forward
    updates then follow two halves of the step on two ranks instead of all microbatches in order on one. For
    BatchNorm's running statistics (which a training forward does not read) gradients and losses stay exact: say
    so (once per compile). Any other update (an EMA the forward reads back) would change them: refused."""
    from zbcompile.passes.forward_only import other_buffer_updates

    for k, ranks in enumerate(schedule.stage_ranks()):
        read_back = other_buffer_updates(staged.stages[k].f) if len(ranks) > 1 else []
        if read_back:
            raise UsageError(
                f"schedule {schedule.name!r} runs model stage {k} on ranks {sorted(ranks)}, each copy for half of the "
                f"microbatches, and that stage's forward updates buffer(s) {', '.join(read_back)} (not BatchNorm "
                "running statistics): each copy would see only its own half of every step's updates, so a forward "
                "reading them back (an EMA) computes other losses and gradients than eager training, silently. Use "
                "a schedule without mirrored stages (dualpipev, zbv), or make the update outside forward")
    for k, ranks in enumerate(schedule.stage_ranks()):
        updated = [key_of(n) for n in staged.stages[k].f.outputs if role_of(n) is Role.BUFFER]
        if len(ranks) > 1 and updated:
            more = f" and {len(updated) - 3} more" if len(updated) > 3 else ""
            warnings.warn(
                f"schedule {schedule.name!r} runs model stage {k} on ranks {sorted(ranks)}, each copy for half of "
                f"the microbatches, and that stage's forward updates buffers ({', '.join(updated[:3])}{more}, e.g. "
                "BatchNorm running statistics): each rank's copy follows only its own half of every step, so the "
                "copies drift apart and differ from eager training. Gradients and losses are not affected. For "
                "buffers that match eager training use a schedule without mirrored stages (e.g. dualpipev).",
                ZBCompileWarning, stacklevel=4)
            return
