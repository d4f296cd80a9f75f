"""The runtime ABI's offload and reload copies (passes/lower/offload.py), re-exported by zbcompile.runtime.abi.

On CUDA the copies run on ctx.copy_stream, joined to the compute stream by events in both directions; no
record_stream: a tensor the copy stream reads or writes is only dropped, or read, after the compute stream waited
for the copy (wait_offload / wait_reload), so the caching allocator never hands its memory out early (and CUDA-graph
capture, which record_stream breaks, stays possible).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import fx

from zbcompile.errors import RuntimeFailure

if TYPE_CHECKING:
    from zbcompile.runtime.abi import StepContext

__all__ = ["offload", "wait_offload", "reload", "wait_reload"]


@fx.node.has_side_effect
def offload(ctx: StepContext, slot: int, *tensors: torch.Tensor):
    """Copy the device storage under `tensors` (views of one storage) into host slot `slot` as bytes, after
    the compute stream's work so far; a handle for wait_offload, which keeps the tensors alive until then."""
    host = ctx.host[slot]
    return tensors, _copy(ctx, host, _storage_bytes(ctx, tensors[0], host.nbytes))


def _copy(ctx: StepContext, dst: torch.Tensor, src: torch.Tensor):
    """dst.copy_(src): at once on CPU (None); on CUDA on the copy stream after the compute stream's work so
    far, returning the event a wait joins on."""
    stream = ctx.copy_stream
    if stream is None:
        dst.copy_(src)
        return None
    stream.wait_stream(torch.cuda.current_stream(ctx.device))
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    return done


def _storage_bytes(ctx: StepContext, tensor: torch.Tensor, nbytes: int) -> torch.Tensor:
    """A flat uint8 tensor over all of `tensor`'s storage, which must be the `nbytes` the F graph was traced
    with (the views wait_reload makes sit at the traced offsets in it)."""
    storage = tensor.untyped_storage()
    if storage.nbytes() != nbytes:
        raise RuntimeFailure(f"rank {ctx.rank}: offload: the storage under a saved tensor {tuple(tensor.shape)} "
                             f"has {storage.nbytes()} bytes, but the F graph's trace said {nbytes}; a kernel "
                             f"allocated other memory than its meta function says. Lower without offload, or "
                             f"with min_bytes above {nbytes} so that this storage stays on the device")
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)


@fx.node.has_side_effect
def wait_offload(ctx: StepContext, handle) -> None:
    """The compute stream waits for the copy; the handle, the storage's last reference, goes after this call."""
    done = handle[1]
    if done is not None:
        torch.cuda.current_stream(ctx.device).wait_event(done)


@fx.node.has_side_effect
def reload(ctx: StepContext, slot: int):
    """A fresh device storage of host slot `slot`'s size, filled from the slot after the compute stream's work
    so far; a handle for wait_reload."""
    host = ctx.host[slot]
    # allocated on the compute stream: its memory belongs to that stream's pool, where the compute stream
    # frees it after waiting for the copy
    flat = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=ctx.device)
    return flat, _copy(ctx, flat, host)


@fx.node.has_side_effect
def wait_reload(ctx: StepContext, handle, views: tuple) -> tuple[torch.Tensor, ...]:
    """The compute stream waits for the copy; returns one view of the reloaded storage per (shape, stride,
    storage offset, dtype) in `views`: the layouts the offloaded values had on their original storage."""
    flat, done = handle
    if done is not None:
        torch.cuda.current_stream(ctx.device).wait_event(done)
    return tuple(flat.view(dtype).as_strided(shape, stride, offset) for shape, stride, offset, dtype in views)
