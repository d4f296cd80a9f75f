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
(every rank's program, no process group) -> `place` (this rank's share of the model, its runtime).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from zbcompile import call_checks
from zbcompile.agreement import READY_TIMEOUT, check_agreement, wait_until_compiled
from zbcompile.compiler import Compiled, building, compile_programs, compile_staged
from zbcompile.data_parallel import Replicas
from zbcompile.distributed import (collective_group, device_for, is_meta, keep_only, p2p_channels, ready_group,
                                   resolve_group, shard_vocab_params, split_mesh, sync_copies)
from zbcompile.errors import UsageError
from zbcompile.ir.program.values import VOCAB_OFFSET
from zbcompile.ir.schedule import Schedule
from zbcompile.ir.stages import StagedModel
from zbcompile.options import WARMUP_STEPS, CompileOptions
from zbcompile.passes.lower import emit_fx
from zbcompile.pipeline_module import PipelineModule
from zbcompile.runtime import RankRuntime, abi, graphs

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


def _decorate(cls: type[nn.Module], *, options: CompileOptions):
    @functools.wraps(cls, updated=())
    def build(*args, **kwargs) -> PipelineModule:
        return compile_with(cls(*args, **kwargs), options)
    build.__wrapped__ = cls
    return build


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


@building
def place(model: nn.Module, compiled: Compiled, resolved, dp: Replicas | None = None) -> PipelineModule:
    """This rank's PipelineModule: the parameters and buffers its stages use kept (and initialized where the
    model is on the meta device), copies on several ranks made equal, vocabulary rows cut, the runtime built;
    first of all, every rank's fingerprint of what it built compared (zbcompile/agreement.py)."""
    pg, rank, world = resolved
    schedule, staged, options = compiled.schedule, compiled.staged, compiled.options
    if schedule.num_ranks != world:
        raise UsageError(f"schedule {schedule.name!r} has {schedule.num_ranks} ranks but the process group "
                         f"has {world}")
    replicas = dp.size if dp is not None else 1
    if compiled.replicas != replicas:   # else the gradients would go unaveraged, or be divided wrongly
        raise UsageError(f"the programs were compiled for {compiled.replicas} data-parallel replica(s) but the mesh "
                         f"has {replicas}; compile with the mesh you place on (compile_programs(..., replicas=))")
    # before the first message: ranks (and replicas) that built other things refuse
    check_agreement(model, compiled, (pg, rank), *([(dp.group, dp.rank)] if dp is not None else []))
    device = device_for(model, pg)
    mine = compiled.stages_of(rank)
    vocab = staged.vocab.params if staged.vocab is not None else ()
    owned_params = tuple(dict.fromkeys([p for st in mine for p in st.params] + list(vocab)))
    owned_buffers = tuple(dict.fromkeys(b for st in mine for b in st.buffers))
    was_meta = is_meta(model)
    keep_only(model, owned_params, owned_buffers, device, options.init_fn)
    sync_copies(model, staged, schedule, rank, pg, options.timeout)
    constants = {}
    if staged.vocab is not None:
        shard_vocab_params(model, staged.vocab, rank, pg, initialized_here=was_meta, timeout=options.timeout)
        constants[VOCAB_OFFSET] = torch.tensor(rank * staged.vocab.rows, device=device)
    params = {n: model.get_parameter(n) for n in owned_params}
    buffers = {n: model.get_buffer(n) for n in owned_buffers}
    if dp is not None:   # replicas start from replica 0's values, as DDP does (sharded: each keeps its rows)
        params = dp.start(model, params, buffers, device)
    channels = p2p_channels(pg, options.timeout)
    ready = ready_group(pg, max(options.timeout, READY_TIMEOUT))   # made now, while the ranks are together
    collectives = collective_group(pg, options.timeout) if staged.vocab is not None else None

    def runtime_for(programs, **graphs) -> RankRuntime:
        """A runtime of this rank's program of `programs` (the training step, or an evaluation step built later)
        over this rank's parameters, buffers and groups."""
        return RankRuntime(programs[rank], emit_fx(programs[rank], abi), pg=pg, device=device, params=params,
                           buffers=buffers, timeout=options.timeout, channels=channels, peers=programs,
                           constants=constants, collectives=collectives,
                           replicas=dp.group if dp is not None else None,
                           profiled=lambda: emit_fx(programs[rank], abi, profile=True), **graphs)

    runtime = runtime_for(compiled.programs, cuda_graphs=options.capture,
                          warmup=options.cuda_graphs or WARMUP_STEPS,
                          graph_api=graphs.capture_api(device) if options.capture else None)
    pipe = PipelineModule(model, compiled, runtime, rank, owned_params, owned_buffers, pg, runtime_for=runtime_for,
                          dp=dp)
    wait_until_compiled(ready, rank, options.timeout)
    return pipe
