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
rank in `group`. compile = CompileOptions (checked before anything is traced) -> compiler.compile_programs
(every rank's program, no process group) -> `place.place` (this rank's share of the model, its runtime).
"""

from __future__ import annotations

import functools

from torch import nn

from zbcompile import call_checks
from zbcompile.compiler import compile_programs, compile_staged
from zbcompile.data_parallel import Replicas
from zbcompile.distributed import device_for, resolve_group, split_mesh
from zbcompile.ir.schedule import Schedule
from zbcompile.ir.stages import StagedModel
from zbcompile.options import CompileOptions
from zbcompile.pipeline_module import PipelineModule
from zbcompile.place import place
from zbcompile.runtime import graphs

__all__ = ["compile", "compile_with", "from_staged", "PipelineModule", "CompileOptions"]


def compile(model: nn.Module | None = None, **options):
    """Compile `model` for pipeline-parallel training; returns a PipelineModule (or, without `model`, a class
    decorator whose instances are PipelineModules). The options (schedule, microbatches, loss_fn, example are
    required; pp, chunks, split_points, group, costs, mem_limit, init_fn, timeout, vocab_parallel, offload,
    backend, cuda_graphs) are those of `zbcompile.options.CompileOptions`, whose docstring says what each does;
    a bad one raises UsageError before anything is traced."""
    checked = CompileOptions.from_kwargs(**options)
    if model is None:
        return functools.partial(_decorate, options=checked)
    return compile_with(model, checked)


def _decorate(cls: type[nn.Module], *, options: CompileOptions) -> Compiling:
    return Compiling(cls, options)


class Compiling:
    """A model class under @zbcompile.compile(...): calling it builds the model and compiles it. `isinstance(pipe,
    Net)` holds for the pipelines it made, and a class derived from it (`class Big(Net)`) derives from the model
    class itself: a plain model (a decorator is not inherited), which zbcompile.compile(Big(), ...) compiles."""

    def __init__(self, cls: type[nn.Module], options: CompileOptions):
        functools.update_wrapper(self, cls, updated=())
        self.options = options

    def __call__(self, *args, **kwargs) -> PipelineModule:
        return compile_with(self.__wrapped__(*args, **kwargs), self.options)

    def __instancecheck__(self, obj) -> bool:
        return isinstance(obj, PipelineModule) and isinstance(obj.model, self.__wrapped__)

    def __mro_entries__(self, bases) -> tuple[type, ...]:
        return (self.__wrapped__,)

    def __repr__(self) -> str:
        return f"<model class {self.__wrapped__.__qualname__} under zbcompile.compile>"


def compile_with(model: nn.Module, options: CompileOptions) -> PipelineModule:
    """split -> schedule -> lower for every rank, then this rank's share and runtime, under `options`."""
    call_checks.check_hooks(model, options.loss_fn)
    resolved, dp = _resolve(options)
    compiled = compile_programs(model, options, resolved[2], device=device_for(model, resolved[0]),
                                replicas=dp.size if dp is not None else 1)
    return place(model, compiled, resolved, dp)


def from_staged(model: nn.Module, staged: StagedModel, schedule: Schedule, **options) -> PipelineModule:
    """compile_with for an already split model: `options` as compile's, without loss_fn / example."""
    checked = CompileOptions.from_kwargs((), schedule=schedule, microbatches=schedule.num_microbatches, **options)
    resolved, dp = _resolve(checked)
    compiled = compile_staged(staged, schedule, checked, device=device_for(model, resolved[0]),
                              replicas=dp.size if dp is not None else 1)
    return place(model, compiled, resolved, dp)


def _resolve(options: CompileOptions):
    """((group, rank, size) of the pipeline's process group, the data-parallel Replicas or None), after refusing
    what needs no tracing to refuse: capture where there is no CUDA, a pp (or per-rank offload budgets) the group
    does not have, a bad mesh."""
    if options.capture:
        graphs.capture_api(None)
    pipeline, replicas = split_mesh(options.group)
    resolved = resolve_group(pipeline, options.timeout)
    options.check_ranks(resolved[2])
    return resolved, Replicas.of(options, replicas)
