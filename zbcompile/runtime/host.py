"""Host tuning for the runtime: glibc's malloc thresholds, and the scheduling of gloo's I/O threads.

Both are process-wide settings measured on this project's CPU machine (2 vCPUs, loopback gloo); the README's
"Known limits" says how to turn the thread scheduling off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import NamedTuple

import torch

from zbcompile.errors import ZBCompileError

__all__ = ["retain_freed_cpu_memory", "process_threads", "tune_io_threads", "io_settings", "IOSettings"]


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3   # glibc mallopt parameters (malloc.h)
_cpu_memory_retained = False


def retain_freed_cpu_memory() -> bool:
    """Keep freed CPU tensor memory in the process for reuse instead of handing it back to the OS.

    A training step allocates and frees the same large tensors every microbatch (logits and their grads,
    dense embedding grads: megabytes each). glibc serves such sizes with mmap and unmaps them on free, so
    the next microbatch page-faults its way through fresh zeroed pages: about 8% of a CPU step on the
    benchmark GPT. Raising the mmap and trim thresholds makes malloc reuse the memory, which is what a
    caching allocator does on GPU. Process-wide and idempotent; returns False where malloc is not glibc's.
    """
    global _cpu_memory_retained
    if _cpu_memory_retained:
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    # 32 MiB is glibc's largest mmap threshold; 1 GiB of free heap top is kept rather than trimmed
    _cpu_memory_retained = bool(mallopt(_M_MMAP_THRESHOLD, 32 << 20)) and bool(mallopt(_M_TRIM_THRESHOLD, 1 << 30))
    return _cpu_memory_retained


# ---- gloo's I/O threads ------------------------------------------------------------------------------
# gloo's TCP event-loop thread reads incoming messages and answers the peer's rendezvous notes. On each
# readiness event it only try-locks the socket pair's mutex and, failing that, goes straight back to
# epoll_wait, where the unread socket is still readable: it spins while the main thread holds the pair to
# post a send or receive. Worse, the loop thread a loopback write wakes is often placed on the writer's core
# and preempts it at once, lock held or not. With 2 vCPUs, on the null model (pp=2), a rank's loop threads
# made 40-120k epoll_wait calls per second each (5 ms CPU per 13 ms step) and each main thread waited 3-4 ms
# per step for a core. So the threads zbcompile's P2P groups start get
#   * a lower priority (nice GLOO_IO_NICE): the spin yields to the threads doing the work, while real I/O
#     still gets its share (nice 10: ~10% of a core against one busy thread); steps 8-23% shorter;
#   * SCHED_BATCH where the rank computes on one thread (torchrun's default): a woken loop thread no longer
#     preempts the running main thread; it runs when a core frees up, which a one-thread rank's core does as
#     soon as its main thread waits. Steps another 39-53% shorter. With an intra-op thread pool, whose
#     threads keep the cores busy, it measured up to 11% slower (2 threads per rank on 2 cores), so not there.
# The benchmark GPT's steps (compute-bound, one thread per rank) are unchanged within 1% by either.
def _io_setting(name: str, default: str, valid) -> str:
    value = os.environ.get(name, default).strip()
    if not valid(value):
        raise ZBCompileError(f"{name}={value!r} is not a valid setting; {_IO_SETTINGS_HELP[name]}")
    return value


_IO_SETTINGS_HELP = {
    "ZBCOMPILE_GLOO_IO_NICE": "give a nice value from 0 (leave the priority alone) to 19, e.g. 10",
    "ZBCOMPILE_GLOO_IO_BATCH": "give auto (SCHED_BATCH in one-thread ranks), 1 (always) or 0 (never)",
}


class IOSettings(NamedTuple):
    """The gloo I/O thread scheduling in force: nice value (0: leave alone) and SCHED_BATCH (auto, 1 or 0)."""

    nice: int
    batch: str


def io_settings() -> IOSettings:
    """Read ZBCOMPILE_GLOO_IO_NICE / ZBCOMPILE_GLOO_IO_BATCH when they are needed (a bad value raises
    ZBCompileError saying what is valid), not at import: `zbcompile plan` must start whatever they hold."""
    nice = _io_setting("ZBCOMPILE_GLOO_IO_NICE", "10", lambda v: v.isdigit() and int(v) <= 19)
    return IOSettings(int(nice), _io_setting("ZBCOMPILE_GLOO_IO_BATCH", "auto", lambda v: v in ("auto", "1", "0")))


def process_threads() -> set[int]:
    """Ids of this process's threads (Linux /proc; empty where there is none). gloo's loop threads are named
    gloo_tcp_loop only from torch 2.13 on, so callers find a group's threads as the ones its creation added."""
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def tune_io_threads(tids) -> int:
    """Apply the scheduling above to threads `tids` (distributed.p2p_channels passes the threads its P2P groups
    started: each group's loop thread and its collective workers, idle since P2P runs on the calling thread).
    Never raises a thread's priority (that would need privileges); returns how many threads it changed.
    A scheduling hint, not a requirement: threads gone meanwhile, or a system refusing, are left as they are."""
    nice, mode = io_settings()
    batch = mode == "1" or (mode == "auto" and torch.get_num_threads() == 1)
    batch = batch and hasattr(os, "SCHED_BATCH")
    changed = 0
    for tid in tids:
        try:
            done = False
            if nice > 0 and os.getpriority(os.PRIO_PROCESS, tid) < nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
                done = True
            if batch and os.sched_getscheduler(tid) == os.SCHED_OTHER:
                os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
                done = True
            changed += done
        except OSError:
            continue
    return changed
