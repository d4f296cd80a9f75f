"""Compute ops: work of one rank alone on its compute stream (a stage graph's run, gradient sums, Parameter.grad,
the loss, buffers, frees) and the host's timing stamps. Each kind's args record, text form, rules and row."""

from __future__ import annotations

import enum
from typing import NamedTuple

from zbcompile.ir.program.ops._spec import (SAFE, Op, OpKind, OpSpec, Stream, read_bool, split_values,
                                            with_arg)
from zbcompile.ir.schedule import Action

__all__ = ["RunArgs", "AccumMode", "AccumArgs", "SetGradArgs", "StampArgs", "ROWS"]


# ---- RUN: one stage graph for one action ---------------------------------------------------------------
class RunArgs(NamedTuple):
    """RUN: the schedule action it computes and the key of the graph it calls in RankProgram.graphs."""

    action: Action
    graph: str


def _run_parse(inner: str, outs):
    return split_values(inner), None   # the graph and action are read from the line's head (RankProgram.from_text)


def _run_aliases(op: Op, graph_aliases) -> list[tuple[str, str]]:
    """Read off the graph's aten schemas (graph_aliases: graph key -> per output, the input positions)."""
    return [(op.ins[i], out) for out, ins in zip(op.outs, graph_aliases(op.args.graph)) for i in ins]


_RUN = OpSpec(OpKind.RUN, "run one stage graph (F, B, W, BW or a variant) for one action", text="run",
              stream=Stream.COMPUTE, emit="run", runtime=(), args=RunArgs, parse=_run_parse, aliases=_run_aliases,
              capture=SAFE)

# ---- FREE ------------------------------------------------------------------------------------------------
_FREE = OpSpec(OpKind.FREE, "last use of tensors: the program drops its references here", text="free",
               stream=Stream.COMPUTE, emit="free", runtime=("free",), capture=SAFE)


# ---- ACCUM: running sums of the microbatch parameter gradients -----------------------------------------
class AccumMode(enum.Enum):
    FIRST = "first"   # the microbatch gradients become the running sums (no computation)
    ADD = "add"       # sums = old sums + gradients, out of place (fresh memory)
    ADD_ = "add_"     # old sums += gradients, in place; the outputs name the updated sums


class AccumArgs(NamedTuple):
    """ACCUM: ins = (old sums..., gradients...) (FIRST: gradients only); outs = the new sums."""

    mode: AccumMode


def _accum_aliases(op: Op, graph_aliases) -> list[tuple[str, str]]:
    n = len(op.outs)
    if op.args.mode is AccumMode.FIRST:
        return list(zip(op.ins, op.outs))
    return list(zip(op.ins[:n], op.outs)) if op.args.mode is AccumMode.ADD_ else []


def _accum_fresh(op: Op, nbytes, ranks: int) -> tuple[int, ...]:
    n = len(op.outs)
    return tuple(nbytes(g) for g in op.ins[-n:]) if op.args.mode is AccumMode.ADD else (0,) * n


_accum_fmt, _accum_parse = with_arg("mode", AccumMode, AccumArgs)
_ACCUM = OpSpec(OpKind.ACCUM, "add microbatch parameter gradients into running sums", text="accum",
                stream=Stream.COMPUTE, emit="accum", runtime=("accumulate_",), args=AccumArgs, format=_accum_fmt,
                parse=_accum_parse, aliases=_accum_aliases, fresh=_accum_fresh, capture=SAFE)


# ---- SUM: one gradient's copies from several ranks -------------------------------------------------------
def _first_in_fresh(op: Op, nbytes, ranks: int) -> tuple[int, ...]:
    return (nbytes(op.ins[0]),)


_SUM = OpSpec(OpKind.SUM, "sum copies of one gradient from several ranks, in rank order", text="sum",
              stream=Stream.COMPUTE, emit="call_op", runtime=("sum_in_order",), fresh=_first_in_fresh,
              capture=SAFE)


# ---- SET_GRAD: the finished gradient into Parameter.grad -------------------------------------------------
class SetGradArgs(NamedTuple):
    """SET_GRAD: `owned`: the step owns the tensor, which may become Parameter.grad itself."""

    owned: bool


def _set_grad_keeps(op: Op) -> bool:
    return op.args.owned   # the tensor itself becomes Parameter.grad


def _set_grad_capture(op: Op, program) -> str:
    # owned=False with an existing .grad is `.grad.add_(g)`: an in-place add into a buffer that outlives the
    # graph. owned=True may make the step's own memory (the graph's pool) Parameter.grad, which the next
    # replay overwrites; the capture protocol keeps .grad allocated (zeroed in place, never set to None)
    if op.args.owned:
        return ("takes ownership: may rebind Parameter.grad to the step's own tensor (graph-pool memory the next "
                "replay overwrites) instead of accumulating into the persistent .grad")
    return SAFE


_grad_fmt, _grad_parse = with_arg("owned", read_bool, SetGradArgs)
_SET_GRAD = OpSpec(OpKind.SET_GRAD, "accumulate a finished gradient into Parameter.grad", text="set_grad",
                   stream=Stream.COMPUTE, emit="set_grad", runtime=("set_grad",), args=SetGradArgs,
                   format=_grad_fmt, parse=_grad_parse, keeps=_set_grad_keeps, capture=_set_grad_capture,
                   fix="lower with capture_ready (owned=False: accumulate into .grad, which the capture protocol "
                       "keeps allocated and zeroes in place)")


# ---- ADD_LOSS, KEEP_OUTPUTS, COPY_BUFFER -----------------------------------------------------------------------------
def _loss_aliases(op: Op, graph_aliases) -> list[tuple[str, str]]:
    return [(op.ins[0], op.outs[0])] if len(op.ins) == 1 else []   # one microbatch: returned as is


def _loss_fresh(op: Op, nbytes, ranks: int) -> tuple[int, ...]:
    return (max(nbytes(op.ins[0]), 4) if len(op.ins) > 1 else 0,)   # the sum is float32 at least (abi)


_ADD_LOSS = OpSpec(OpKind.ADD_LOSS, "sum the microbatch losses; outs = (loss,)", text="add_loss",
                   stream=Stream.COMPUTE, emit="call_op", runtime=("sum_losses",), aliases=_loss_aliases,
                   fresh=_loss_fresh, capture=SAFE)
_KEEP_OUTPUTS = OpSpec(OpKind.KEEP_OUTPUTS, "hand the model's outputs back (every microbatch's out:<k>, microbatch "
                       "by microbatch); outs = (outputs,)", text="keep_outputs", stream=Stream.COMPUTE,
                       emit="call_op", runtime=("keep_outputs",), capture=SAFE,
                       aliases=lambda op, graph_aliases: [(v, op.outs[0]) for v in op.ins])
_COPY_BUFFER = OpSpec(OpKind.COPY_BUFFER, "copy a buffer's new value (an F output) into the live buffer",
                      text="copy_buffer", stream=Stream.COMPUTE, emit="call_op", runtime=("copy_buffer",),
                      capture=SAFE)


# ---- STAMP: the time into a timing slot, on the host ------------------------------------------------------
class StampArgs(NamedTuple):
    """STAMP: the timing slot it writes."""

    slot: int


def _stamp_capture(op: Op, program) -> str:
    if not program.event_timing:
        return ("host clock stamp: perf_counter runs once, at capture, so every replay would report the capture "
                "step's times; the graph path records device events (RankProgram.event_timing)")
    return SAFE


_stamp_fmt, _stamp_parse = with_arg("slot", int, StampArgs)
_STAMP = OpSpec(OpKind.STAMP, "record the time into a timing slot (action start / end)", text="stamp",
                stream=Stream.HOST, emit="stamp", runtime=("stamp_event",), args=StampArgs, format=_stamp_fmt,
                parse=_stamp_parse, capture=_stamp_capture,
                fix="lower with capture_ready (RankProgram.event_timing=True: stamp_event records a device event, "
                    "replayed with the graph)")

ROWS = (_RUN, _FREE, _ACCUM, _SUM, _SET_GRAD, _ADD_LOSS, _KEEP_OUTPUTS, _COPY_BUFFER, _STAMP)
