"""capture_ready: a program whose whole step can be captured as one CUDA graph (the checks: passes/analysis/
capture.py). Runs first among the finishing passes (CAPTURE_FINISHING), before static_recv_buffers and
static_input_buffers read which ops keep their inputs.

    SET_GRAD owned=True  -> owned=False   .grad is never rebound to the step's tensor: the capture protocol keeps
                                          it allocated and zeroed in place, and the runtime adds into it. (Eager,
                                          a .grad of None costs one clone on the first step.) The receives and
                                          the batch that fed an owned gradient no longer outlive the step, so
                                          they get static buffers too.
    wait_timeout True    -> False         plain work.wait(): a stream dependency instead of a host block. A dead
                                          peer then hangs the step; the capture runtime's host watchdog
                                          (runtime/graphs.py) raises RuntimeFailure instead.
    event_timing False   -> True          STAMP records a device event (replayed with the graph) instead of
                                          reading perf_counter, which runs once, at capture.

        set_grad(a.weight, acc3.grad:param:weight; True)  ->  set_grad(a.weight, acc3.grad:param:weight; False)
"""

from __future__ import annotations

from zbcompile.ir.program import RankProgram
from zbcompile.ir.program.ops import OpKind, SetGradArgs

__all__ = ["capture_ready"]


def capture_ready(program: RankProgram) -> RankProgram:
    ops = tuple(op._replace(args=SetGradArgs(False)) if op.kind is OpKind.SET_GRAD and op.args.owned else op
                for op in program.ops)
    return program.replace(ops=ops, wait_timeout=False, event_timing=True)
