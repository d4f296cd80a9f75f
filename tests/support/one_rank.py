"""One rank holding every stage, on one device (pg=None): the GPU tests' way to run a real captured step,
since a pipeline across ranks needs a GPU per rank (NCCL refuses two ranks on one device)."""

from __future__ import annotations

import copy

import torch

from zbcompile.ir.schedule import Schedule
from zbcompile.passes.lower import Lowering, emit_fx, lower_all
from zbcompile.runtime import RankRuntime
from zbcompile.split import split_model

from support.models import Case, train_sgd

__all__ = ["one_rank_schedule", "one_rank_runtime", "train_one_rank"]


def one_rank_schedule(stages: int, m: int) -> Schedule:
    """F of every stage, then B from the last stage back, per microbatch; the W's after all B's."""
    row = []
    for mb in range(m):
        row += [f"{s}F{mb}" for s in range(stages)] + [f"{s}B{mb}" for s in reversed(range(stages))]
    row += [f"{s}W{mb}" for mb in range(m) for s in reversed(range(stages))]
    return Schedule.from_text(f"# zbcompile schedule one-rank: microbatches={m} placement={','.join('0' * stages)} "
                              f"pipelines=1\nrank 0: {' '.join(row)}\n").validate()


def one_rank_runtime(case: Case, stages: int, m: int, lowering: Lowering, *, graphs: bool, graph_api=None,
                     device: torch.device | None = None):
    """(runtime, its own copy of case.model, x, y) on `device` (default: the current CUDA device);
    `lowering.capture` must be set where `graphs` is."""
    device = device or torch.device("cuda", torch.cuda.current_device())
    model = copy.deepcopy(case.model).to(device)
    x, y = (t.to(device) for t in case.example)
    mb = x.shape[0] // m
    staged = split_model(model, case.loss_fn, ((x[:mb],), (y[:mb],)), num_stages=stages)
    programs = lower_all(one_rank_schedule(stages, m), staged, lowering)
    rt = RankRuntime(programs[0], emit_fx(programs[0]), pg=None, device=device, params=dict(model.named_parameters()),
                     buffers=dict(model.named_buffers()), peers=programs, cuda_graphs=graphs,
                     graph_api=graph_api(device) if graph_api else None)
    return rt, model, x, y


def train_one_rank(rt, model, x, y, steps: int, seed: int = 1):
    """`steps` SGD steps on rolled copies of (x, y) from a fixed RNG state: train_sgd's losses and gradients."""
    torch.manual_seed(seed)
    batches = [(torch.roll(x, k, dims=1).contiguous(), y) for k in range(steps)]
    return train_sgd(model, lambda xb, yb: rt.step_batch((xb, yb)), batches)
