"""CUDA-graph execution of a rank's whole step: `zb.compile(..., cuda_graphs=True)`.

The rank program (lowered with CAPTURE_FINISHING, checked by passes/analysis/capture.py) is captured once,
P2P, collectives, offload copies, gradient sums and all, as ONE graph, and replayed every step after: the host
then launches one graph instead of thousands of kernels and Python calls. The protocol (Megatron's
full-iteration graphs and torchtitan's whole-schedule capture do the same, one stage per rank; we capture any
schedule's straight line):

    steps 1..warmup   eager, on the capture stream: every P2P edge connects (NCCL must not connect a
                      communicator during capture), lazy library state initialises, .grad gets allocated
    capture step      .grad bound to persistent buffers; synchronize; capture on the capture stream into a
                      private pool ("thread_local" mode); synchronize; barrier; then the first replay. Before
                      each warm-up step and the capture, the ranks all-gather how many eager steps they have
                      left (also the barrier before capture): ranks that would capture different steps, which
                      would deadlock at replay, are refused at step 1 instead
    every replay      the batch is already in the static input buffers (RankRuntime copies it there);
                      parameters and buffers must not have moved since capture (CaptureError otherwise);
                      .grad is re-bound to its persistent buffer where the caller changed it (zeroed in place
                      if the optimizer set it to None, copied if they assigned another tensor); replay; a host
                      watchdog polls an event for the step's timeout, since the waits inside the graph have none

What replay needs of the program is what capture_ready and the buffer passes made true: receives into static
slots, untimed waits, accumulation into .grad, the batch staged, timing stamps as device events. The default
CUDA generator is registered with every graph by torch, so dropout draws fresh numbers each replay.

`CaptureAPI` is every call the protocol makes into torch.cuda, so that tests can stand a recorder in its
place and check the call order and buffer identity on a CPU (tests/support/graph_standin.py).
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from zbcompile.errors import CaptureError, RuntimeFailure
from zbcompile.ir.program.ops import OpKind

__all__ = ["CaptureAPI", "CapturedStep", "GradBuffers", "capture_api", "accumulated_params"]


class CaptureAPI:
    """torch.cuda's graph API, as CapturedStep uses it, for one device."""

    def __init__(self, device: torch.device):
        self.device = device

    def stream(self):
        return torch.cuda.Stream(self.device)

    def current_stream(self):
        return torch.cuda.current_stream(self.device)

    def use_stream(self, stream):
        return torch.cuda.stream(stream)

    def pool(self):
        return torch.cuda.graph_pool_handle()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def capture(self, fn: Callable[[], object], *, pool, stream):
        """Capture fn() into a new graph; returns (graph, what fn returned: tensors the replays write)."""
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads (gloo's, the allocator's) may make CUDA calls meanwhile
        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            out = fn()
        return graph, out

    def replay(self, graph) -> None:
        graph.replay()

    def mark(self):
        """An event recorded on the current stream, for the watchdog to query."""
        event = torch.cuda.Event()
        event.record(self.current_stream())
        return event


def capture_api(device: torch.device | None) -> CaptureAPI:
    """The capture API for `device` (None: only check that there is CUDA). Raises CaptureError where capture
    cannot run: no CUDA device, or a rank device that is not a CUDA one."""
    if not torch.cuda.is_available():
        raise CaptureError("cuda_graphs=True: CUDA graphs need a CUDA device, and torch sees none here "
                           f"(torch {torch.__version__}, torch.cuda.is_available() is False). Run on a CUDA "
                           "machine, or compile without cuda_graphs to run the step eagerly "
                           "(`zbcompile inspect ... --capture-check` checks a program for capture anywhere)")
    if device is not None and device.type != "cuda":
        raise CaptureError(f"cuda_graphs=True: this rank runs on {device}, not a CUDA device; move the model to "
                           "the rank's GPU (or build it on the meta device), or compile without cuda_graphs")
    return CaptureAPI(device if device is not None else torch.device("cuda"))


class CapturedStep:
    """Runs `runtime`'s program (a RankRuntime) eagerly for `warmup` steps, then captures a step and replays.

    agree(value, what): the runtime's all-gather that every rank reached this point with the same value.
    grads: (name, Parameter) for every parameter a SET_GRAD of the program accumulates into.
    static: (name, tensor) for every tensor the graph reads across steps (parameters, buffers, constants).
    """

    def __init__(self, *, program, ctx, args: Sequence[torch.Tensor], grads, static, agree, api: CaptureAPI,
                 warmup: int = 2, timeout: float = 60.0, rank: int = 0):
        if warmup < 1:
            raise CaptureError(f"cuda_graphs warm-up of {warmup} steps: at least 1 eager step must run before "
                               "capture (it connects every P2P edge and allocates .grad)")
        self.program, self.ctx, self.args = program, ctx, args
        self.grads = GradBuffers(grads)
        self.static = [(name, t, None) for name, t in static]
        self.agree, self.api = agree, api
        self.warmup, self.timeout, self.rank = warmup, timeout, rank
        self.steps = 0
        self.graph = None
        self.out = None
        self.failed: str | None = None
        self.stream = api.stream()
        self.pool = None

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def run(self, args) -> object:
        """One step on the fixed `args` (the runtime's staged inputs); returns the program's output."""
        if self.failed is not None:
            raise RuntimeFailure(f"rank {self.rank}: {self.failed}; the captured graph's buffers are in an unknown "
                                 "state: compile again (zb.compile) to train on")
        if args is not self.args:
            raise CaptureError("cuda_graphs: the step's arguments must be the runtime's static input buffers "
                               "(RankRuntime.step_batch copies the batch into them)")
        try:
            if self.graph is None:   # every rank counts down to the same capture step (one all-gather each)
                self.agree(float(self.warmup - self.steps), "capture the step as a CUDA graph (eager steps left)")
            if self.steps < self.warmup:
                out = self._eager()
            else:
                if self.graph is None:
                    self._capture()
                self._replay()
                out = self.out
            self._watch()
        except CaptureError:   # refused before any device work was launched (a moved parameter): still usable
            raise
        except BaseException as e:
            self.failed = f"step {self.steps + 1} failed ({type(e).__name__})"
            raise
        self.steps += 1
        return out

    # ---- the three phases ------------------------------------------------------------------------------
    def _eager(self):
        api, side = self.api, self.stream
        side.wait_stream(api.current_stream())   # the batch copied in on the current stream
        with api.use_stream(side):
            out = self.program.forward(self.ctx, *self.args)
        api.current_stream().wait_stream(side)
        return out

    def _capture(self) -> None:
        api = self.api
        self.grads.own()
        self.static = [(name, t, t.data_ptr()) for name, t, _ in self.static]
        api.synchronize()
        self.pool = api.pool()
        self.graph, self.out = api.capture(lambda: self.program.forward(self.ctx, *self.args),
                                           pool=self.pool, stream=self.stream)
        api.synchronize()
        self.agree(float(self.steps), "finish capturing")

    def _replay(self) -> None:
        self._check_static()
        self.grads.bind()
        self.api.replay(self.graph)

    # ---- persistent state --------------------------------------------------------------------------------
    def _check_static(self) -> None:
        for name, t, ptr in self.static:
            if t.data_ptr() != ptr:
                raise CaptureError(
                    f"cuda_graphs: {name} moved since the step was captured (its storage changed, as `p.data = "
                    "...`, load_state_dict(assign=True) or .to() do); the graph still reads the old memory. Update "
                    "parameters and buffers in place (optimizer.step, copy_, load_state_dict) or compile again")

    def _watch(self) -> None:
        """Wait for the step's device work with the step's timeout: the waits inside the program are untimed
        (a timed wait would block the host during capture), so a dead or stalled peer is caught here."""
        done = self.api.mark()
        deadline = time.perf_counter() + self.timeout
        pause = 2e-5
        while not done.query():
            if time.perf_counter() > deadline:
                raise RuntimeFailure(
                    f"rank {self.rank}: the step did not finish within {self.timeout} s on the device: a peer is "
                    "dead or stalled, or a P2P order deadlocks (the waits inside a CUDA graph have no timeout; "
                    "this watchdog stands in for them). The stream cannot be recovered: restart the job")
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)


class GradBuffers:
    """One persistent .grad per accumulated parameter: a captured step adds into fixed memory, so .grad must
    be that memory at every replay, whatever the caller did to it between steps."""

    def __init__(self, grads):
        self.grads = [(name, p, None) for name, p in grads]

    def own(self) -> None:
        """Before capture: each parameter's current .grad where that is a dense tensor of its shape (the
        warm-up's sum, which the user may not have zeroed), else zeros."""
        owned = []
        for name, p, _ in self.grads:
            g = p.grad
            if g is not None and g.shape == p.shape and g.dtype == p.dtype and g.device == p.device and \
                    g.is_contiguous():
                buf = g
            else:
                buf = torch.zeros_like(p, memory_format=torch.contiguous_format)
                if g is not None:
                    buf.copy_(g)
            p.grad = buf
            owned.append((name, p, buf))
        self.grads = owned

    def bind(self) -> None:
        """Before a replay: put each buffer back under .grad where the caller changed .grad, keeping eager
        semantics (None: start from zero, as optimizer.zero_grad() means; another tensor: from its values)."""
        for name, p, buf in self.grads:
            g = p.grad
            if g is buf:
                continue
            if g is None:
                buf.zero_()
            elif g.shape != buf.shape:
                raise CaptureError(f"cuda_graphs: {name}.grad was set to a tensor of shape {tuple(g.shape)}, not "
                                   f"{tuple(buf.shape)}; zero it in place or set it to None between steps")
            else:
                buf.copy_(g)
            p.grad = buf


def accumulated_params(ir, fixed) -> list[tuple[str, torch.Tensor]]:
    """(name, Parameter) for every parameter the program's SET_GRAD ops accumulate into, in program order."""
    seen = dict.fromkeys(op.ins[0] for op in ir.of_kind(OpKind.SET_GRAD))
    return [(name.partition(":")[2], fixed[name]) for name in seen]
