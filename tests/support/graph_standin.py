"""A stand-in for the CUDA graph API (zbcompile.runtime.graphs.CaptureAPI) on a CPU, for the capture runtime's tests.

No CPU backend can capture a graph, so the stand-in emulates what matters to CapturedStep and checks how it
is used, as other projects test their capture managers:

    call order   every call is logged; capture and replay refuse to run inside a capture, synchronize refuses
                 to run during one, replay refuses a graph that was never captured
    capture      runs the step once under a StepFootprint, then puts back every static storage the step wrote
                 (parameters' .grad, buffers, receive slots, the host pool): a capture records device work, it
                 does not do it
    replay       runs the step again and checks it touched exactly the static storages the capture did, at the
                 same addresses and in the same order, and that nothing it allocated outlives it; then copies
                 what it returned into the tensors the capture returned (a replay writes the captured output's
                 memory; the caller reads those)

A real graph replays without running the host code; re-running it here is what lets a CPU check that the
memory a replay would use is the memory the step needs.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._pytree import tree_leaves

from zbcompile.runtime.replay_check import StepFootprint, first_difference


class StandInError(AssertionError):
    """The capture runtime used the graph API wrongly."""


class _Stream:
    def __init__(self, api, name: str):
        self.api, self.name = api, name

    def wait_stream(self, other) -> None:
        self.api.log.append(f"{self.name} waits {other.name}")


class _Done:
    def query(self) -> bool:
        return True


class _Graph:
    def __init__(self, fn, footprint: StepFootprint, out):
        self.fn, self.footprint, self.out = fn, footprint, out


class StandInGraphs:
    """CaptureAPI's calls on a CPU (see the module docstring). `log` lists the calls in order."""

    def __init__(self):
        self.log: list[str] = []
        self.capturing = False
        self.default = _Stream(self, "default")
        self.current = self.default
        self.replays = 0

    # ---- streams and sync -------------------------------------------------------------------------------
    def stream(self):
        return _Stream(self, f"side{sum(e.startswith('stream') for e in self.log)}")

    def current_stream(self):
        return self.current

    @contextlib.contextmanager
    def use_stream(self, stream):
        self.log.append(f"use {stream.name}")
        outer, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = outer

    def pool(self):
        self.log.append("pool")
        return object()

    def synchronize(self) -> None:
        if self.capturing:
            raise StandInError("synchronize() during capture: illegal on a capturing stream")
        self.log.append("synchronize")

    def mark(self):
        if self.capturing:
            raise StandInError("an event query during capture")
        return _Done()

    # ---- capture and replay -----------------------------------------------------------------------------
    def capture(self, fn, *, pool, stream):
        if self.capturing:
            raise StandInError("capture() inside a capture")
        if pool is None or not isinstance(stream, _Stream):
            raise StandInError("capture() needs the private pool and the capture stream")
        self.log.append("capture")
        self.capturing = True
        footprint = StepFootprint(snapshot=True)
        try:
            with footprint:
                out = fn()
        finally:
            self.capturing = False
        footprint.restore()   # the capture recorded the device work; it did not do it
        escaped = footprint.escaped(tree_leaves(out))
        if escaped:
            raise StandInError(f"{len(escaped)} storage(s) allocated in the captured step outlive it")
        return _Graph(fn, footprint, out), out

    def replay(self, graph) -> None:
        if self.capturing:
            raise StandInError("replay() during capture")
        if not isinstance(graph, _Graph):
            raise StandInError("replay() of a graph that was never captured")
        self.log.append("replay")
        self.replays += 1
        footprint = StepFootprint()
        with footprint:
            out = graph.fn()
        if list(footprint.static) != list(graph.footprint.static):   # addresses shown by the op that touched them
            raise StandInError(f"replay {self.replays} touched other static memory than the capture: "
                               + first_difference(list(graph.footprint.static), list(footprint.static),
                                                  graph.footprint.static, footprint.static))
        escaped = footprint.escaped(tree_leaves(out))
        if escaped:
            raise StandInError(f"{len(escaped)} storage(s) allocated in replay {self.replays} outlive it")
        for mine, new in zip(tree_leaves(graph.out), tree_leaves(out)):
            if isinstance(mine, torch.Tensor):
                mine.copy_(new)
