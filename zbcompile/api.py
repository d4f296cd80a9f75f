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

import functools
import os
import warnings
from datetime import timedelta
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import fx, nn

from zbcompile.errors import LoweringError, RuntimeFailure, ZBCompileWarning
from zbcompile.passes.lower import emit_fx, lower_all
from zbcompile.runtime import RankRuntime, StepTimings, process_threads, tune_io_threads
from zbcompile.schedule import Schedule
from zbcompile.stages import StagedModel

__all__ = ["compile", "PipelineModule"]


def compile(model: nn.Module | None = None, *, schedule: str | Schedule, microbatches: int,
            loss_fn: Callable[..., torch.Tensor], example, pp: int | None = None, chunks: int | None = None,
            split_points: Sequence[str] | None = None, group=None, costs=None, mem_limit: float | None = None,
            init_fn: Callable[[nn.Module], None] | None = None, timeout: float = 60.0):
    """Compile `model` for pipeline-parallel training; returns a PipelineModule (or, without `model`, a
    class decorator whose instances are PipelineModules).

    schedule: a name for `zbcompile.passes.schedules.generate` (gpipe, 1f1b, interleaved-1f1b, zb-h1, zb-h2,
        zb-auto, zbv, v-min, v-half, v-zb, dualpipe, dualpipev) or a ready Schedule. ScheduleError passes
        through (e.g. too few microbatches).
    example: `(inputs, targets)` for ONE microbatch, as `zbcompile.split.split_model` takes it.
    pp: pipeline ranks; defaults to the size of `group` and must equal it.
    group: a ProcessGroup, a 1-D DeviceMesh (or a named dimension of one, `mesh["pp"]`), or None for the
        default group (initialized here from the torchrun environment when needed: gloo on CPU, NCCL on CUDA).
    costs / mem_limit: read by zb-auto (and zbv / v-zb, which polish their order for uneven costs).
    timeout: seconds any wait may block before RuntimeFailure.
    On CPU the runtime asks glibc to keep freed memory for reuse (`runtime.retain_freed_cpu_memory`, a
    process-wide setting): large per-microbatch tensors then stop page-faulting fresh memory every time.
    init_fn: for a model built on the meta device. Each rank gives real storage (on its device) only to the
        parameters and buffers its own stages use, then calls `init_fn(module)` on every module that directly
        holds one of them — or, without init_fn, that module's `reset_parameters()`. Copies of one parameter
        on several ranks (tied weights, DualPipe's mirrored stages) are then made equal from the lowest rank.
    """
    options = dict(schedule=schedule, microbatches=microbatches, loss_fn=loss_fn, example=example, pp=pp,
                   chunks=chunks, split_points=split_points, group=group, costs=costs, mem_limit=mem_limit,
                   init_fn=init_fn, timeout=timeout)
    if model is None:
        def decorate(cls: type[nn.Module]):
            @functools.wraps(cls, updated=())
            def build(*args, **kwargs) -> PipelineModule:
                return compile(cls(*args, **kwargs), **options)
            build.__wrapped__ = cls
            return build
        return decorate
    pg, rank, world = _resolve_group(group, timeout)
    pp = world if pp is None else pp
    if pp != world:
        raise LoweringError(f"pp={pp} but the process group has {world} ranks; launch with "
                            f"`torchrun --nproc-per-node {pp}` (or pass a group of {pp} ranks)")
    sched = _schedule(schedule, pp, microbatches, chunks, costs, mem_limit)
    from zbcompile.split import split_model

    trace_example = _to_meta(example) if _is_meta(model) else example
    staged = split_model(model, loss_fn, trace_example, num_stages=sched.num_model_stages,
                         split_points=split_points, placement=_model_stage_placement(sched))
    return PipelineModule.from_staged(model, staged, sched, group=pg, init_fn=init_fn, timeout=timeout,
                                      _resolved=(pg, rank, world))


class PipelineModule:
    """This rank's share of a pipeline-parallel model: its parameters and its compiled step.

    parameters() / named_parameters(): exactly the parameters this rank's stages use — the user's own
    nn.Parameter objects (canonical names; a tied parameter once), so any torch optimizer works on them.
    step(*batch) puts this step's gradients into their .grad (adding to what is there, like backward()).
    """

    def __init__(self, model: nn.Module, staged: StagedModel, schedule: Schedule, programs, runtime: RankRuntime,
                 rank: int, owned: tuple[str, ...]):
        self.model = model
        self.staged = staged
        self.schedule = schedule
        self.programs = programs
        self.runtime = runtime
        self.rank = rank
        self._owned = owned
        self._fx: dict[int, fx.GraphModule] = {rank: runtime.program}
        # per flat argument: the whole batch's shape and dtype (None: not traced), for step()'s one-comparison check
        self._batch_specs = tuple(runtime.batch_specs.get(i) for i in range(staged.num_inputs + staged.num_targets))

    @classmethod
    def from_staged(cls, model: nn.Module, staged: StagedModel, schedule: Schedule, *, group=None,
                    init_fn: Callable[[nn.Module], None] | None = None, timeout: float = 60.0,
                    _resolved=None) -> PipelineModule:
        """Build from an already split model (split once, try several schedules)."""
        pg, rank, world = _resolved or _resolve_group(group, timeout)
        if schedule.num_ranks != world:
            raise LoweringError(f"schedule {schedule.name!r} has {schedule.num_ranks} ranks but the process group "
                                f"has {world}")
        if schedule.num_model_stages != len(staged.stages):
            raise LoweringError(f"schedule {schedule.name!r} needs {schedule.num_model_stages} model stages but the "
                                f"split made {len(staged.stages)}")
        programs = lower_all(schedule, staged)
        _warn_mirrored_buffer_updates(staged, schedule)
        mine = [staged.stages[schedule.model_stage(s)] for s, r in enumerate(schedule.placement) if r == rank]
        owned_params = tuple(dict.fromkeys(p for st in mine for p in st.params))
        owned_buffers = tuple(dict.fromkeys(b for st in mine for b in st.buffers))
        device = _device_for(model, pg)
        _keep_only(model, owned_params, owned_buffers, device, init_fn)
        _retarget(staged, device)
        _sync_copies(model, staged, schedule, rank, pg, timeout)
        params = {n: model.get_parameter(n) for n in owned_params}
        buffers = {n: model.get_buffer(n) for n in owned_buffers}
        runtime = RankRuntime(programs[rank], emit_fx(programs[rank]), pg=pg, device=device, params=params,
                              buffers=buffers, timeout=timeout, channels=_p2p_channels(pg, timeout))
        return cls(model, staged, schedule, programs, runtime, rank, owned_params)

    # ---- training ------------------------------------------------------------------------------
    def step(self, *batch: torch.Tensor) -> float:
        """One training step on the whole batch (model inputs, then loss targets; split on dim 0 into
        microbatches). Returns the batch's mean loss, the same value on every rank."""
        specs = self._batch_specs
        if len(batch) != len(specs):
            raise RuntimeFailure(f"step() takes {self.staged.num_inputs} model input(s) then "
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
                raise RuntimeFailure(f"batch argument {i} has {rows} rows, which do not split into {m} equal "
                                     f"microbatches; use a batch size that is a multiple of {m}")
            spec = specs.get(i)
            if spec is None:
                continue
            shape, dtype = spec
            if t.dtype != dtype or t.shape[0] // m != shape[0] or t.shape[1:] != shape[1:]:
                got = (t.shape[0] // m, *t.shape[1:])
                raise RuntimeFailure(
                    f"batch argument {i}: {m} microbatches of shape {list(got)} ({t.dtype}), but the model was "
                    f"compiled for microbatches of shape {list(shape)} ({dtype}) from `example`; pass a batch of "
                    f"{m} x {shape[0]} rows with the example's other sizes, or compile again for this shape")

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        for name in self._owned:
            yield name, self.model.get_parameter(name)

    def parameters(self) -> Iterator[nn.Parameter]:
        for _, p in self.named_parameters():
            yield p

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.parameters():
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    # ---- inspection ----------------------------------------------------------------------------
    def rank_program(self, rank: int | None = None) -> fx.GraphModule:
        """The generated program of `rank` (default: this rank); `.code` prints sends, receives, frees."""
        rank = self.rank if rank is None else rank
        if rank not in self._fx:
            self._fx[rank] = emit_fx(self.programs[rank])
        return self._fx[rank]

    @property
    def last_step(self) -> StepTimings | None:
        """Per-action start / end of every rank for the last step, and `.bubble` per rank."""
        return self.runtime.last_step

    def chrome_trace(self, path: str) -> str:
        """Write the last step as a Chrome trace (open in Perfetto / chrome://tracing)."""
        if self.runtime.last_step is None:
            raise RuntimeFailure("no step has run yet; call step() first")
        return self.runtime.last_step.save_chrome_trace(path)


# ---- helpers --------------------------------------------------------------------------------------
def _schedule(schedule, pp, microbatches, chunks, costs, mem_limit) -> Schedule:
    if isinstance(schedule, Schedule):
        if schedule.num_ranks != pp or schedule.num_microbatches != microbatches:
            raise LoweringError(f"schedule {schedule.name!r} is for {schedule.num_ranks} ranks and "
                                f"{schedule.num_microbatches} microbatches, not pp={pp}, microbatches={microbatches}")
        return schedule.validate().check_order()
    from zbcompile.passes.schedules import generate

    return generate(schedule, pp, microbatches, chunks=chunks, costs=costs, mem_limit=mem_limit)


def _model_stage_placement(sched: Schedule) -> tuple[int, ...]:
    """Per model stage, a group id for balancing the split: the set of ranks running it. Most schedules run each
    model stage on one rank; DualPipe runs stage m on ranks m and p-1-m (half the microbatches each), so m and
    p-1-m share one group, whose summed weight is then the load of both ranks."""
    ids: dict[frozenset[int], int] = {}
    return tuple(ids.setdefault(frozenset(h), len(ids)) for h in _model_stage_ranks(sched))


def _model_stage_ranks(sched: Schedule) -> list[set[int]]:
    """Per model stage, the ranks that run it (two for DualPipe's mirrored stages, one otherwise)."""
    holders: list[set[int]] = [set() for _ in range(sched.num_model_stages)]
    for s, r in enumerate(sched.placement):
        holders[sched.model_stage(s)].add(r)
    return holders


def _warn_mirrored_buffer_updates(staged: StagedModel, schedule: Schedule) -> None:
    """DualPipe runs each model stage on two ranks, each copy for half of the microbatches. Gradients and
    losses are exact, but buffers the forward updates (BatchNorm running statistics) then follow two halves
    of the step on two ranks instead of all microbatches in order on one: say so (once per compile)."""
    for k, ranks in enumerate(_model_stage_ranks(schedule)):
        updated = [n[len("buffer:"):] for n in staged.stages[k].f.outputs if n.startswith("buffer:")]
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


def _resolve_group(group, timeout: float):
    """(ProcessGroup or None, pipeline rank, pipeline size)."""
    if group is not None and hasattr(group, "get_group") and hasattr(group, "mesh"):
        if group.ndim != 1:
            raise LoweringError(f"a {group.ndim}-D DeviceMesh was given; pass its pipeline dimension, mesh['pp']")
        group = group.get_group()
    if group is None:
        if not dist.is_initialized():
            if "WORLD_SIZE" not in os.environ:
                return None, 0, 1
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            dist.init_process_group(backend, timeout=timedelta(seconds=max(timeout, 1.0)))
        group = dist.group.WORLD
    if group is dist.group.WORLD:
        group = dist.distributed_c10d._get_default_group()
    return group, group.rank(), group.size()


_CHANNELS: dict[tuple, tuple] = {}


def _p2p_channels(pg, timeout: float) -> tuple | None:
    """Two groups over the pipeline group's ranks, one per P2P direction (StepContext explains why), made
    once per pipeline group and reused by every compile on it. None for a one-rank pipeline or a group that
    is not a torch.distributed ProcessGroup (tests' stand-ins), which then carries both directions."""
    if pg is None or pg.size() < 2 or not isinstance(pg, dist.ProcessGroup) or not dist.is_initialized():
        return None
    ranks = dist.get_process_group_ranks(pg)
    key = (dist.distributed_c10d._get_process_group_name(pg), tuple(ranks))
    live = dist.distributed_c10d._world.pg_map
    if key in _CHANNELS and all(c in live for c in _CHANNELS[key]):
        return _CHANNELS[key]
    backend = dist.get_backend(pg)
    before = process_threads() if backend == "gloo" else set()
    channels = tuple(dist.new_group(ranks, timeout=timedelta(seconds=max(timeout, 1.0)), backend=backend,
                                    use_local_synchronization=True) for _ in ("up", "down"))
    if backend == "gloo":   # only the threads these groups started (runtime.py says why)
        tune_io_threads(process_threads() - before)
    for c in channels:
        if c.rank() != pg.rank():  # new_group numbers ranks in sorted order; programs use pg's numbering
            raise LoweringError(f"the pipeline group's ranks {ranks} are not in ascending order, so P2P groups "
                                f"over them would number the ranks differently; pass a group with sorted ranks")
    _CHANNELS[key] = channels
    return channels


def _is_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def _to_meta(example):
    return torch.utils._pytree.tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, example)


def _device_for(model: nn.Module, pg) -> torch.device:
    for p in model.parameters():
        if not p.is_meta:
            return p.device
    if pg is not None and dist.get_backend(pg) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _keep_only(model: nn.Module, params: Sequence[str], buffers: Sequence[str], device: torch.device,
               init_fn) -> None:
    """Drop (to meta) what this rank does not use; give real storage to owned meta tensors and initialize them."""
    keep = {id(model.get_parameter(n)) for n in params}
    keep_buf = {id(model.get_buffer(n)) for n in buffers}
    swapped: dict[int, torch.Tensor] = {}
    to_init: dict[int, nn.Module] = {}
    with torch.no_grad():
        for mod in model.modules():
            for name, p in list(mod._parameters.items()):
                if p is None:
                    continue
                if id(p) not in swapped:
                    if id(p) in keep:
                        swapped[id(p)] = p if not p.is_meta else nn.Parameter(
                            torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                    else:
                        swapped[id(p)] = p if p.is_meta else nn.Parameter(
                            torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
                new = swapped[id(p)]
                if new is not p:
                    mod._parameters[name] = new
                    if not new.is_meta:
                        to_init[id(mod)] = mod
            for name, b in list(mod._buffers.items()):
                if b is None:
                    continue
                if id(b) in keep_buf and b.is_meta:
                    mod._buffers[name] = torch.zeros_like(b, device=device)
                    to_init[id(mod)] = mod
                elif id(b) not in keep_buf and not b.is_meta:
                    mod._buffers[name] = torch.empty_like(b, device="meta")
        for mod in to_init.values():
            if init_fn is not None:
                init_fn(mod)
            elif hasattr(mod, "reset_parameters"):
                mod.reset_parameters()
            else:
                raise LoweringError(f"cannot initialize {type(mod).__name__} built on the meta device: it has no "
                                    f"reset_parameters(); pass init_fn=... to zbcompile.compile")


def _retarget(staged: StagedModel, device: torch.device) -> None:
    """Stage graphs traced on the meta device create tensors there (arange, masks): point them at `device`."""
    for stage in staged.stages:
        for graph in (stage.f, stage.b, stage.w, stage.bw):
            changed = False
            for node in graph.gm.graph.nodes:
                dev = node.kwargs.get("device")
                if dev is not None and torch.device(dev).type == "meta":
                    node.kwargs = {**node.kwargs, "device": device}
                    changed = True
            if changed:
                graph.gm.recompile()


def _sync_copies(model: nn.Module, staged: StagedModel, schedule: Schedule, rank: int, pg, timeout: float) -> None:
    """Make every copy of a parameter / buffer held by several ranks equal to the lowest rank's copy."""
    if pg is None:
        return
    holders: dict[str, set[int]] = {}
    for s, r in enumerate(schedule.placement):
        stage = staged.stages[schedule.model_stage(s)]
        for n in stage.params + tuple(f"buffer:{b}" for b in stage.buffers):
            holders.setdefault(n, set()).add(r)
    works = []
    for tag, (name, ranks) in enumerate(sorted(holders.items())):
        if len(ranks) < 2 or rank not in ranks:
            continue
        t = model.get_buffer(name[7:]) if name.startswith("buffer:") else model.get_parameter(name)
        first = min(ranks)
        if rank == first:
            works += [pg.send([t.detach()], q, tag) for q in sorted(ranks) if q != rank]
        else:
            works.append(pg.recv([t.detach()], first, tag))
    for w in works:
        if w.wait(timedelta(seconds=timeout)) is False:
            raise RuntimeFailure(f"rank {rank}: making shared parameter copies equal timed out")
