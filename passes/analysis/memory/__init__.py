"""memory_plan: every rank's device memory over one step, known before anything runs.

A rank program is a straight line whose values the generated code drops at their last use (fx's code
generator does, and a boxed stage graph drops each input at its own last use inside), so the bytes live
after every op follow from three facts the compiler already has: which values each op defines and reads,
which values may share memory (the alias analysis of aliases.py and each op kind's spec), and every stage
graph's tensor sizes (the FakeTensor in each node's meta["val"], whose storage also says which results are
views of one another). The plan walks each program once, stage graphs node by node:

    storage   one per fresh allocation (a graph's fresh result, a receive buffer, a gradient sum); its bytes
              are the FakeTensor storage's. Views and in-place results add none.
    resident  what exists before the step: parameters, buffers, static receive buffers, the batch.
    dynamic   what the step allocates; live while any value that may alias it is referenced. Split by what
              references it: saved (F's saved tensors, what B leaves for W), boundary (activations sent or
              received, their gradients, vocabulary values, posted handles), grads (gradients and their
              sums), workspace (a stage graph's temporaries while it runs), other.

    # rank 0 of 1f1b: resident 1.2 MiB, peak 3.4 MiB during [0B1] (saved 1.1, boundary 0.2, grads 0.5, ...)

Assumptions (the runtime's, stated where they matter): Parameter.grad is None when the step starts
(`optimizer.zero_grad()`'s default), so the gradients the step hands over are its own allocation and live to
its end. On CUDA every storage counts as the caching allocator's blocks (multiples of 512 bytes, which
`max_memory_allocated` counts); kernels' internal scratch memory (cuBLAS workspaces, attention's) is not
counted: on CUDA that is the gap to `max_memory_allocated`.

    records.py   what a plan says: the categories, Sample, RankMemory, MemoryPlan
    graphs.py    what running one stage graph allocates and releases, node by node (graph_profile)
    walk.py      one rank program, op by op (rank_memory)
"""

from __future__ import annotations

from typing import Sequence

from zbcompile.ir.program import RankProgram
from zbcompile.passes.analysis.memory.graphs import GraphProfile, graph_profile, tensor_bytes
from zbcompile.passes.analysis.memory.records import CATEGORIES, MemoryPlan, RankMemory, Sample
from zbcompile.passes.analysis.memory.walk import rank_memory

__all__ = ["CATEGORIES", "MemoryPlan", "RankMemory", "Sample", "memory_plan", "rank_memory", "graph_profile",
           "tensor_bytes", "GraphProfile"]


def memory_plan(programs: Sequence[RankProgram], held: Sequence[dict[str, int]] | None = None) -> MemoryPlan:
    """The memory plan of every rank's finished program (after `lower_all`). held: per rank, bytes by category
    live from the step's start to its VALIDATE op (a post-validated step: passes/lower/step_boundary.py)."""
    held = held or [{}] * len(programs)
    ranks = tuple(rank_memory(p, num_ranks=len(programs), held=h) for p, h in zip(programs, held))
    return MemoryPlan(programs[0].name if programs else "", ranks)
