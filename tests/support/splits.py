"""zb.compile for the cases of one launched worker, with each split made once per process.

Tracing and splitting are most of a compile (about 4 of 4.5 s for the tests' GPT, with 4 ranks on 2 cores), and
the cases of one launch compile the same model for the same schedules again and again. `compile_once` keeps
each split (`split_for`) under everything it depends on and builds the pipe with PipelineModule.from_staged,
the API for "split once, try several schedules"; the programs, the placement and the runtime are made anew each
time, as zb.compile makes them. The cases that test compile's own path call zb.compile.
"""

from __future__ import annotations

import torch

from zbcompile.api import PipelineModule
from zbcompile.compiler import schedule_for, split_for
from zbcompile.distributed import split_mesh
from zbcompile.options import CompileOptions
from zbcompile.split import autocast_state

_SPLITS: dict = {}


def compile_once(model: torch.nn.Module, *, schedule: str, microbatches: int, loss_fn, example, group=None,
                 chunks=None, split_points=None, vocab_parallel: bool = False, **options) -> PipelineModule:
    """zb.compile(model, ...) with the split taken from this process's cache where an earlier case made it."""
    pipeline, _ = split_mesh(group)
    pp = pipeline.size() if hasattr(pipeline, "size") else torch.distributed.get_world_size()
    checked = CompileOptions.from_kwargs(schedule=schedule, microbatches=microbatches, loss_fn=loss_fn,
                                         example=example, chunks=chunks, split_points=split_points,
                                         vocab_parallel=vocab_parallel)
    sched = schedule_for(checked, pp)
    leaves = torch.utils._pytree.tree_leaves(example)
    key = (sched.name, pp, chunks, tuple(split_points or ()), vocab_parallel, id(loss_fn), autocast_state(),
           tuple((n, tuple(p.shape), p.dtype) for n, p in model.named_parameters()),
           tuple((tuple(t.shape), t.dtype) for t in leaves if isinstance(t, torch.Tensor)))
    if key not in _SPLITS:
        _SPLITS[key] = split_for(model, loss_fn, example, sched, split_points=split_points)
    return PipelineModule.from_staged(model, _SPLITS[key], sched, group=group, **options)
