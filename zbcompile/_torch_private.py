"""Every private PyTorch API zbcompile relies on, in one place (we run on torch 2.11 to 2.13).

Each entry says what it is and why we use it; a torch upgrade that moves one breaks here, not in a pass.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import fx

__all__ = ["BoxedCodeGen", "op_entry_point", "live_process_groups", "process_group_name", "default_group"]

# fx's code generator for the boxed calling convention (inputs in one list the graph clears), which AOTAutograd
# uses for compiled backwards; public since torch 2.0 under a private name
BoxedCodeGen = fx.graph._BoxedCodeGen


def op_entry_point(target):
    """The C++ callable behind an aten OpOverload (`OpOverload._op`), or None for anything else: calling it
    skips OpOverload.__call__'s Python frame."""
    return target._op if isinstance(target, torch._ops.OpOverload) else None


def live_process_groups():
    """The process groups torch.distributed still holds (c10d's `_world.pg_map`)."""
    return dist.distributed_c10d._world.pg_map


def process_group_name(pg) -> str:
    return dist.distributed_c10d._get_process_group_name(pg)


def default_group():
    return dist.distributed_c10d._get_default_group()
