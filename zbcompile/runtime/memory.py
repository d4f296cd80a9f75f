"""Measuring a step's memory, independently of the plan (passes/analysis/memory.py) that predicts it.

On CUDA the caching allocator counts: `torch.cuda.max_memory_allocated` over the step, less what was allocated
before it. On CPU nothing counts, so `StorageTracker` does: a dispatch mode that sees the result of every
aten op the step runs (stage graphs, receive buffers, gradient sums) and counts each storage the op
allocated (one that none of its tensor arguments already had) until Python's weak reference to it reports
it freed. It counts what the dispatcher allocates (on CUDA in the allocator's 512-byte blocks), not kernels'
internal scratch memory.

    tracker = StorageTracker()
    with tracker:
        pipe.step(x, y)
    tracker.peak        # the most bytes the step held at once
"""

from __future__ import annotations

import threading
import weakref
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from zbcompile.ir.program.ops import allocated_bytes

__all__ = ["StorageTracker", "MemoryMeasurement", "measure"]


class StorageTracker(TorchDispatchMode):
    """Live and peak bytes of the storages allocated by aten ops run under it (this thread only: dispatch
    modes are per thread). Storages that existed before it (parameters, static buffers) are never counted,
    even when an op returns a view of one."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self.allocations = 0
        self._refs: dict[int, weakref.ref] = {}   # storage address -> weak reference (the callback uncounts it)
        self._lock = threading.Lock()              # a storage may die on another thread (gloo's)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                key = _key(t)
                if key not in inputs and key not in self._refs:
                    self._count(t.untyped_storage(), key)
        return out

    def _count(self, storage: torch.UntypedStorage, key: int) -> None:
        nbytes = allocated_bytes(storage.nbytes(), storage.device)   # what CUDA's allocator counts, as the plan
        self._refs[key] = weakref.ref(storage, lambda _, k=key, n=nbytes: self._freed(k, n))
        with self._lock:
            self.live += nbytes
            self.allocations += 1
            self.peak = max(self.peak, self.live)

    def _freed(self, key: int, nbytes: int) -> None:
        with self._lock:
            self.live -= nbytes
            self._refs.pop(key, None)


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr() if t.untyped_storage().nbytes() else id(t.untyped_storage())


class MemoryMeasurement(NamedTuple):
    """What one measured step held (bytes). peak: the most the step itself allocated at once; end: what it
    still held when it returned (the gradients it handed over); method: "cuda" or "storage tracker"."""

    peak: int
    end: int
    method: str


def measure(step, device: torch.device, method: str = "auto") -> tuple[object, MemoryMeasurement]:
    """Run `step()` and measure its memory: `max_memory_allocated` on CUDA, a StorageTracker elsewhere.
    method="tracker" uses the tracker on CUDA too (per thread: several ranks as threads of one process share
    the allocator's counters, not the tracker's)."""
    if method not in ("auto", "tracker"):
        raise ValueError(f"measure(method={method!r}): 'auto' or 'tracker'")
    if device.type == "cuda" and method == "auto":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = step()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
        return result, MemoryMeasurement(peak, torch.cuda.memory_allocated(device) - base, "cuda")
    tracker = StorageTracker()
    with tracker:
        result = step()
    return result, MemoryMeasurement(tracker.peak, tracker.live, "storage tracker")
