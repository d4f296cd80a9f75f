"""The public entry: `zbcompile.compile` turns a model into a pipeline-parallel trainer for this rank.

    pipe = zb.compile(model, schedule="zbv", microbatches=8, loss_fn=loss_fn, example=(inputs, targets))
    opt = torch.optim.AdamW(pipe.parameters())          # this rank's own nn.Parameters
    loss = pipe.step(x, y)                               # whole batch; same mean loss on every rank
    opt.step(); opt.zero_grad()

or as a class decorator:

    @zb.compile(schedule="1f1b", microbatches=8, loss_fn=loss_fn, example=(inputs, targets))
    class Net(nn.Module): ...
    pipe = Net(cfg)                                      # a PipelineModule

Under torchrun (or any initialized process group) each process compiles the same model; pipeline rank =
rank in `group`. `compile` runs split -> schedule -> lower and keeps only this rank's stages' parameters.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Callable, Sequence

import torch
from torch import fx, nn

from zbcompile.distributed import (collective_group, device_for, is_meta, keep_only, p2p_channels, resolve_group,
                                   shard_vocab_params, stage_ranks, sync_copies, to_device)
from zbcompile.errors import UsageError, ZBCompileWarning
from zbcompile.ir.names import Role, key_of, role_of
from zbcompile.ir.program.values import VOCAB_OFFSET
from zbcompile.passes.analysis.capture import check_capture
from zbcompile.passes.lower import CAPTURE_FINISHING, emit_fx, lower_all
from zbcompile.runtime import RankRuntime, StepTimings
from zbcompile.runtime import abi, graphs
from zbcompile.ir.schedule import Schedule
from zbcompile.ir.stages import StagedModel

__all__ = ["compile", "PipelineModule", "CompileOptions"]


@dataclasses.dataclass(frozen=True)
class CompileOptions:
    """Everything `compile` takes besides the model (see its docstring for each)."""

    schedule: str | Schedule
    microbatches: int
    loss_fn: Callable[..., torch.Tensor]
    example: object
    pp: int | None = None
    chunks: int | None = None
    split_points: Sequence[str] | None = None
    group: object = None
    costs: object = None
    mem_limit: float | None = None
    init_fn: Callable[[nn.Module], None] | None = None
    timeout: float = 60.0
    vocab_parallel: bool = False
    offload: int | str | Sequence[int] | None = None
    backend: str | None = None
    cuda_graphs: bool | int = False


def compile(model: nn.Module | None = None, *, schedule: str | Schedule, microbatches: int,
            loss_fn: Callable[..., torch.Tensor], example, pp: int | None = None, chunks: int | None = None,
            split_points: Sequence[str] | None = None, group=None, costs=None, mem_limit: float | None = None,
            init_fn: Callable[[nn.Module], None] | None = None, timeout: float = 60.0,
            vocab_parallel: bool = False, offload: int | str | Sequence[int] | None = None,
            backend: str | None = None, cuda_graphs: bool | int = False):
    """Compile `model` for pipeline-parallel training; returns a PipelineModule (or, without `model`, a
    class decorator whose instances are PipelineModules).

    schedule: a name for `zbcompile.passes.schedules.generate` (gpipe, 1f1b, interleaved-1f1b, zb-h1, zb-h2,
        zb-auto, zbv, v-min, v-half, v-zb, dualpipe, dualpipev) or a ready Schedule. ScheduleError passes
        through (e.g. too few microbatches).
    example: `(inputs, targets)` for ONE microbatch, as `zbcompile.split.split_model` takes it.
    split_points: where to cut (module names to cut before, `after:<module>`, torch's `split_spec` dict of
        SplitPoints, or `pipe_split:<k>`). Default: the model's `pipe_split()` markers if it has any, else cuts
        balanced per rank for the schedule's placement.
    pp: pipeline ranks; defaults to the size of `group` and must equal it.
    group: a ProcessGroup, a 1-D DeviceMesh (or a named dimension of one, `mesh["pp"]`), or None for the
        default group (initialized here from the torchrun environment when needed: gloo on CPU, NCCL on CUDA).
    costs / mem_limit: read by zb-auto (and zbv / v-zb, which polish their order for uneven costs).
    timeout: seconds any wait may block before RuntimeFailure.
    On CPU the runtime asks glibc to keep freed memory for reuse (`runtime.host.retain_freed_cpu_memory`, a
    process-wide setting): large per-microbatch tensors then stop page-faulting fresh memory every time.
    init_fn: for a model built on the meta device. Each rank gives real storage (on its device) only to the
        parameters and buffers its own stages use, then calls `init_fn(module)` on every module that directly
        holds one of them — or, without init_fn, that module's `reset_parameters()`. Copies of one parameter
        on several ranks (tied weights, DualPipe's mirrored stages) are then made equal from the lowest rank.
    vocab_parallel: shard the input embedding and the output layer + cross-entropy over every rank
        (vocabulary parallelism; passes/shard_vocab.py): each rank holds rows [r * V/p, (r + 1) * V/p) of each
        vocabulary parameter and runs 1/p of their work in S, T, IF, IB actions the schedule gets
        (passes/schedules/vocab.py). The step must look up token ids in an embedding and end in
        `cross_entropy(linear(x, W), targets)`; VocabError says what was found otherwise.
    offload: activation offload (PipeOffload; passes/analysis/offload_plan.py). A device-memory budget in bytes
        (one for every rank, or one per rank): each rank's planned peak (`memory_plan()`) must fit it, so the
        saved tensors of the longest-lived forwards are copied to a host pool after their F and back before
        their backward, as few as fit; OffloadError says the smallest budget that works. "auto": offload what
        the time model says hides behind compute. None: no offload. `pipe.offload_report` says what was chosen.
    backend: "inductor" compiles every stage graph (F, B, W, BW and the gradient-accumulating variants) with torch
        inductor (C++ on CPU, Triton on CUDA; passes/lower/compiled.py), once per distinct graph, cached across
        runs by inductor's FX graph cache; None runs the aten stage graphs as they are. UsageError for others.
    cuda_graphs: run each rank's whole step as one CUDA graph (runtime/graphs.py): True runs 2 eager warm-up
        steps and captures the third, replaying it from then on; an int n >= 1 runs n warm-up steps. The
        program is lowered for capture (CAPTURE_FINISHING) and checked (passes/analysis/capture.py: CaptureError
        with the table of what blocks it). .grad stays one persistent tensor per parameter, added into like
        backward() does (zero_grad() either way works); parameters must be updated in place. Needs a CUDA
        device: CaptureError otherwise, never a silent eager fallback.
    """
    options = CompileOptions(schedule=schedule, microbatches=microbatches, loss_fn=loss_fn, example=example,
                             pp=pp, chunks=chunks, split_points=split_points, group=group, costs=costs,
                             mem_limit=mem_limit, init_fn=init_fn, timeout=timeout, vocab_parallel=vocab_parallel,
                             offload=offload, backend=backend, cuda_graphs=cuda_graphs)
    if model is None:
        return functools.partial(_decorate, options=options)
    return compile_with(model, options)


def _decorate(cls: type[nn.Module], *, options: CompileOptions):
    @functools.wraps(cls, updated=())
    def build(*args, **kwargs) -> PipelineModule:
        return compile_with(cls(*args, **kwargs), options)
    build.__wrapped__ = cls
    return build


def compile_with(model: nn.Module, options: CompileOptions) -> PipelineModule:
    """split -> schedule -> lower -> runtime for this rank, under `options`."""
    from zbcompile.split import split_model

    _check_cuda_graphs(options.cuda_graphs)
    resolved = resolve_group(options.group, options.timeout)
    _, _, world = resolved
    pp = world if options.pp is None else options.pp
    if pp != world:
        raise UsageError(f"pp={pp} but the process group has {world} ranks; launch with "
                         f"`torchrun --nproc-per-node {pp}` (or pass a group of {pp} ranks)")
    sched = _schedule(options, pp)
    example = options.example
    if is_meta(model):   # traced on meta; the graphs' tensor factories then target the device the rank runs on
        example = to_device(example, device_for(model, resolved[0]))
    staged = split_model(model, options.loss_fn, example, num_stages=sched.num_model_stages,
                         split_points=options.split_points, placement=model_stage_placement(sched),
                         vocab_shards=pp if options.vocab_parallel else None)
    return _build(model, staged, sched, resolved, options.init_fn, options.timeout, options.offload,
                  options.backend, options.cuda_graphs)


def _check_cuda_graphs(cuda_graphs: bool | int) -> None:
    """A bad cuda_graphs value, or capture where there is no CUDA, is refused before anything is traced or any
    process group is made."""
    if _warmup_steps(cuda_graphs) is not None:
        graphs.capture_api(None)


def _warmup_steps(cuda_graphs: bool | int) -> int | None:
    """cuda_graphs -> eager warm-up steps before capture (None: no capture)."""
    if cuda_graphs is False:
        return None
    if cuda_graphs is True:
        return 2
    if isinstance(cuda_graphs, int) and cuda_graphs >= 1:
        return cuda_graphs
    raise UsageError(f"cuda_graphs={cuda_graphs!r}: give True (2 eager warm-up steps, then capture), an int n >= 1 "
                     "(n warm-up steps), or False")


def _build(model: nn.Module, staged: StagedModel, schedule: Schedule, resolved, init_fn, timeout: float,
           offload=None, backend: str | None = None, cuda_graphs: bool | int = False):
    pg, rank, world = resolved
    if schedule.num_ranks != world:
        raise UsageError(f"schedule {schedule.name!r} has {schedule.num_ranks} ranks but the process group "
                         f"has {world}")
    if schedule.num_model_stages != len(staged.stages):
        raise UsageError(f"schedule {schedule.name!r} needs {schedule.num_model_stages} model stages but the "
                         f"split made {len(staged.stages)}")
    if bool(schedule.vocab_shards) != (staged.vocab is not None):
        raise UsageError(f"schedule {schedule.name!r} {'has' if schedule.vocab_shards else 'has no'} vocabulary "
                         f"actions but the model was split {'without' if staged.vocab is None else 'with'} "
                         "vocabulary parallelism; build both with vocab_parallel / vocab_shards, or neither "
                         "(passes.schedules.vocab.insert_vocab adds the vocabulary actions to a schedule)")
    warmup = _warmup_steps(cuda_graphs)
    device = device_for(model, pg)
    api = graphs.capture_api(device) if warmup is not None else None
    more = {"finishing": CAPTURE_FINISHING} if warmup is not None else {}
    programs = lower_all(schedule, staged, backend=backend, **more)
    report = None
    if offload is not None:
        programs, report = _offload(programs, offload, device)
    if warmup is not None:
        check_capture(programs)
    _warn_mirrored_buffer_updates(staged, schedule)
    mine = [staged.stages[schedule.model_stage(s)] for s, r in enumerate(schedule.placement) if r == rank]
    vocab = staged.vocab.params if staged.vocab is not None else ()
    owned_params = tuple(dict.fromkeys([p for st in mine for p in st.params] + list(vocab)))
    owned_buffers = tuple(dict.fromkeys(b for st in mine for b in st.buffers))
    was_meta = is_meta(model)
    keep_only(model, owned_params, owned_buffers, device, init_fn)
    sync_copies(model, staged, schedule, rank, pg, timeout)
    constants = {}
    if staged.vocab is not None:
        shard_vocab_params(model, staged.vocab, rank, pg, initialized_here=was_meta, timeout=timeout)
        constants[VOCAB_OFFSET] = torch.tensor(rank * staged.vocab.rows, device=device)
    params = {n: model.get_parameter(n) for n in owned_params}
    buffers = {n: model.get_buffer(n) for n in owned_buffers}
    runtime = RankRuntime(programs[rank], emit_fx(programs[rank], abi), pg=pg, device=device, params=params,
                          buffers=buffers, timeout=timeout, channels=p2p_channels(pg, timeout), peers=programs,
                          constants=constants,
                          collectives=collective_group(pg, timeout) if staged.vocab is not None else None,
                          cuda_graphs=warmup is not None, graph_api=api, warmup=warmup or 2)
    pipe = PipelineModule(model, staged, schedule, programs, runtime, rank, owned_params, owned_buffers, pg)
    pipe.offload_report = report
    return pipe


def _offload(programs, offload, device: torch.device):
    """Plan the offload for `offload` (a budget or "auto") on every rank and add it to the finished programs.
    The time model's device: an H100-like one on CUDA, this machine's CPU elsewhere (offload_plan.DEVICES)."""
    from zbcompile.passes.analysis.offload_plan import DEVICES, plan_offload
    from zbcompile.passes.lower import offload_programs

    report = plan_offload(programs, offload, device=DEVICES["h100" if device.type == "cuda" else "cpu"])
    return offload_programs(programs, [r.choice for r in report]), report


class PipelineModule(nn.Module):
    """This rank's share of a pipeline-parallel model: its parameters, its buffers and its compiled step.

    As an nn.Module it holds exactly this rank's share of the user's model under the model's own fully qualified
    names (`zbcompile.checkpoint.attach_share`): the parameters its stages use — the user's own nn.Parameter
    objects, so any torch optimizer works on parameters() — and the persistent buffers they read. A tied
    parameter is one Parameter under each of its names, as in the model itself: named_parameters() gives it
    once, under its first name; state_dict() under every name. So torch's state-dict helpers and
    torch.distributed.checkpoint see the user's keys (zbcompile/checkpoint.py: saving and loading at any layout).
    step(*batch) puts this step's gradients into their .grad (adding to what is there, like backward()).
    """

    def __init__(self, model: nn.Module, staged: StagedModel, schedule: Schedule, programs, runtime: RankRuntime,
                 rank: int, owned: tuple[str, ...], owned_buffers: tuple[str, ...] = (), group=None):
        from zbcompile.checkpoint import attach_share

        super().__init__()
        # Not a child module: the user's model keeps meta tensors for what other ranks hold, and its state
        # here is this rank's share only (attached below), under the same names.
        self.__dict__["model"] = model
        self.staged = staged
        self.schedule = schedule
        self.programs = programs
        self.runtime = runtime
        self.rank = rank
        self.process_group = group
        self._owned = owned
        self._fx: dict[int, fx.GraphModule] = {rank: runtime.program}
        self._plan = None
        self.offload_report = None   # per rank, what activation offload chose (compile's offload=)
        # per flat argument: the whole batch's shape and dtype (None: not traced), for step()'s one-comparison check
        self._batch_specs = tuple(runtime.batch_specs.get(i) for i in range(staged.num_inputs + staged.num_targets))
        attach_share(self, model, owned, owned_buffers)   # last: the user's names may shadow the attributes above

    @classmethod
    def from_staged(cls, model: nn.Module, staged: StagedModel, schedule: Schedule, *, group=None,
                    init_fn: Callable[[nn.Module], None] | None = None, timeout: float = 60.0,
                    offload: int | str | Sequence[int] | None = None,
                    cuda_graphs: bool | int = False) -> PipelineModule:
        """Build from an already split model (split once, try several schedules). The split's stage graphs
        create tensors (masks, positions) on the device they were traced for: the example's, or for a model on
        the meta device the device `compile` runs on."""
        _check_cuda_graphs(cuda_graphs)
        return _build(model, staged, schedule, resolve_group(group, timeout), init_fn, timeout, offload,
                      cuda_graphs=cuda_graphs)

    # ---- training ------------------------------------------------------------------------------
    def step(self, *batch: torch.Tensor) -> float:
        """One training step on the whole batch (model inputs, then loss targets; split on dim 0 into
        microbatches). Returns the batch's mean loss, the same value on every rank."""
        specs = self._batch_specs
        if len(batch) != len(specs):
            raise UsageError(f"step() takes {self.staged.num_inputs} model input(s) then "
                                 f"{self.staged.num_targets} target(s), {len(specs)} tensors; got {len(batch)}")
        for t, spec in zip(batch, specs):
            if spec is None or t.shape != spec[0] or t.dtype != spec[1]:
                self._check_microbatch_shapes(batch, self.schedule.num_microbatches)   # raises what is wrong
                break
        return self.runtime.step_batch(batch)

    __call__ = step

    def _check_microbatch_shapes(self, batch: Sequence[torch.Tensor], m: int) -> None:
        """Every argument splits into m microbatches of the shape the programs were traced for (static
        shapes, fixed P2P buffer sizes)."""
        specs = self.runtime.data_specs
        for i, t in enumerate(batch):
            if t.dim() == 0 or t.shape[0] % m:
                rows = t.shape[0] if t.dim() else 0
                raise UsageError(f"batch argument {i} has {rows} rows, which do not split into {m} equal "
                                     f"microbatches; use a batch size that is a multiple of {m}")
            spec = specs.get(i)
            if spec is None:
                continue
            shape, dtype = spec
            if t.dtype != dtype or t.shape[0] // m != shape[0] or t.shape[1:] != shape[1:]:
                got = (t.shape[0] // m, *t.shape[1:])
                raise UsageError(
                    f"batch argument {i}: {m} microbatches of shape {list(got)} ({t.dtype}), but the model was "
                    f"compiled for microbatches of shape {list(shape)} ({dtype}) from `example`; pass a batch of "
                    f"{m} x {shape[0]} rows with the example's other sizes, or compile again for this shape")

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """nn.Module.load_state_dict, but all or nothing: keys and shapes are checked against this rank's share
        first (`zbcompile.checkpoint.check_state_dict`), so a state dict of another model raises CheckpointError
        naming the first mismatches before any tensor is written. Tensors are copied in place (assign=True is
        refused: the compiled program holds the live parameters and buffers)."""
        from zbcompile.checkpoint import check_state_dict

        if assign:
            raise UsageError("PipelineModule.load_state_dict(assign=True): the compiled step holds this rank's "
                             "parameters and buffers, so they are loaded in place; call it with assign=False")
        check_state_dict(state_dict, self.state_dict(keep_vars=True), strict=strict, where=f"rank {self.rank}")
        return super().load_state_dict(state_dict, strict=strict)

    # ---- inspection ----------------------------------------------------------------------------
    def rank_program(self, rank: int | None = None) -> fx.GraphModule:
        """The generated program of `rank` (default: this rank); `.code` prints sends, receives, frees."""
        rank = self.rank if rank is None else rank
        if rank not in self._fx:
            self._fx[rank] = emit_fx(self.programs[rank], abi)
        return self._fx[rank]

    def memory_plan(self):
        """Every rank's device memory over one step, computed from the rank programs (passes/analysis/memory.py):
        per rank the resident bytes, the bytes live after every op by category, and the peak and where it is.
        `.table()` prints it; `.to_json()` is what `zbcompile inspect --memory --json` writes."""
        from zbcompile.passes.analysis.memory import memory_plan

        if self._plan is None:
            self._plan = memory_plan(self.programs)
        return self._plan

    def measure_memory(self, *batch: torch.Tensor):
        """Run one training step (as step()) and measure the memory it allocates, independently of the plan:
        `torch.cuda.max_memory_allocated` on CUDA, a tracker of every storage the step's aten ops allocate on
        CPU (zbcompile.runtime.memory). Returns (loss, MemoryMeasurement); compare `.peak` with
        `memory_plan()[rank].peak_dynamic_bytes`. The plan assumes the step starts with `.grad` None
        (optimizer.zero_grad()'s default)."""
        from zbcompile.runtime.memory import measure

        return measure(lambda: self.step(*batch), self.runtime.device)

    @property
    def last_step(self) -> StepTimings | None:
        """Per-action start / end of every rank for the last step, and `.bubble` per rank."""
        return self.runtime.last_step

    def chrome_trace(self, path: str) -> str:
        """Write the last step as a Chrome trace (open in Perfetto / chrome://tracing)."""
        if self.runtime.last_step is None:
            raise UsageError("no step has run yet; call step() first")
        return self.runtime.last_step.save_chrome_trace(path)


# ---- helpers --------------------------------------------------------------------------------------
def _schedule(options: CompileOptions, pp: int) -> Schedule:
    schedule, m = options.schedule, options.microbatches
    if isinstance(schedule, Schedule):
        if schedule.num_ranks != pp or schedule.num_microbatches != m:
            raise UsageError(f"schedule {schedule.name!r} is for {schedule.num_ranks} ranks and "
                             f"{schedule.num_microbatches} microbatches, not pp={pp}, microbatches={m}")
        return schedule.validate().check_order()
    from zbcompile.passes.schedules import generate

    return generate(schedule, pp, m, chunks=options.chunks, costs=options.costs, mem_limit=options.mem_limit,
                    vocab=options.vocab_parallel)


def model_stage_placement(sched: Schedule) -> tuple[int, ...]:
    """Per model stage, a group id for balancing the split: the set of ranks running it. Most schedules run each
    model stage on one rank; DualPipe runs stage m on ranks m and p-1-m (half the microbatches each), so m and
    p-1-m share one group, whose summed weight is then the load of both ranks."""
    ids: dict[frozenset[int], int] = {}
    return tuple(ids.setdefault(frozenset(h), len(ids)) for h in stage_ranks(sched))


def _warn_mirrored_buffer_updates(staged: StagedModel, schedule: Schedule) -> None:
    """DualPipe runs each model stage on two ranks, each copy for half of the microbatches. Gradients and
    losses are exact, but buffers the forward updates (BatchNorm running statistics) then follow two halves
    of the step on two ranks instead of all microbatches in order on one: say so (once per compile)."""
    for k, ranks in enumerate(stage_ranks(schedule)):
        updated = [key_of(n) for n in staged.stages[k].f.outputs if role_of(n) is Role.BUFFER]
        if len(ranks) > 1 and updated:
            more = f" and {len(updated) - 3} more" if len(updated) > 3 else ""
            warnings.warn(
                f"schedule {schedule.name!r} runs model stage {k} on ranks {sorted(ranks)}, each copy for half of "
                f"the microbatches, and that stage's forward updates buffers ({', '.join(updated[:3])}{more}, e.g. "
                "BatchNorm running statistics): each rank's copy follows only its own half of every step, so the "
                "copies drift apart and differ from eager training. Gradients and losses are not affected. For "
                "buffers that match eager training use a schedule without mirrored stages (e.g. dualpipev).",
                ZBCompileWarning, stacklevel=3)
            return
