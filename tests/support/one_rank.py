"""One rank holding every stage, on one device (pg=None): the GPU tests' way to run a real captured step,
since a pipeline across ranks needs a GPU per rank (NCCL refuses two ranks on one device)."""

from __future__ import annotations

import copy

import torch

from zbcompile.compiler import compile_staged, split_for
from zbcompile.options import CompileOptions
from zbcompile.passes.lower import OffloadChoice, emit_fx
from zbcompile.passes.schedules import one_rank
from zbcompile.runtime import RankRuntime

from support.models import Case, train_sgd

__all__ = ["one_rank_runtime", "train_one_rank"]


def one_rank_runtime(case: Case, stages: int, m: int, *, graphs: bool, backend: str | None = None,
                     offload: OffloadChoice | None = None, graph_api=None, device: torch.device | None = None):
    """(runtime, its own copy of case.model, x, y) on `device` (default: the current CUDA device): `stages`
    stages on one rank (passes.schedules.one_rank), compiled as the cuda_graphs option lowers them whether or
    not `graphs` captures the step, with the stage graphs compiled by `backend` and `offload`'s choice."""
    device = device or torch.device("cuda", torch.cuda.current_device())
    model = copy.deepcopy(case.model).to(device)
    x, y = (t.to(device) for t in case.example)
    mb = x.shape[0] // m
    schedule = one_rank(stages, m)
    options = CompileOptions(schedule=schedule, microbatches=m, loss_fn=case.loss_fn, example=((x[:mb],), (y[:mb],)),
                             cuda_graphs=True, backend=backend)
    staged = split_for(model, case.loss_fn, options.example, schedule)
    programs = compile_staged(staged, schedule, options, offload_choices=[offload] if offload else None).programs
    rt = RankRuntime(programs[0], emit_fx(programs[0]), pg=None, device=device, params=dict(model.named_parameters()),
                     buffers=dict(model.named_buffers()), peers=programs, cuda_graphs=graphs,
                     graph_api=graph_api(device) if graph_api else None)
    return rt, model, x, y


def train_one_rank(rt, model, x, y, steps: int, seed: int = 1):
    """`steps` SGD steps on rolled copies of (x, y) from a fixed RNG state: train_sgd's losses and gradients."""
    torch.manual_seed(seed)
    batches = [(torch.roll(x, k, dims=1).contiguous(), y) for k in range(steps)]
    return train_sgd(model, lambda xb, yb: rt.step_batch((xb, yb)), batches)
