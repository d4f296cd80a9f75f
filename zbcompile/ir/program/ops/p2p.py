"""Point-to-point ops: receives and sends between two ranks, posted on a communicator's stream, and their waits.
Each kind's args record, text form, rules and row."""

from __future__ import annotations

import re
from typing import NamedTuple

from zbcompile.errors import LoweringError
from zbcompile.ir.program.ops._spec import (SAFE, UNTIMED_WAIT_FIX, Op, OpKind, OpSpec, Stream, Sync, TensorType,
                                            wait_capture)

__all__ = ["RecvArgs", "Message", "SendArgs", "ROWS"]


# ---- RECV: one tensor from a peer ---------------------------------------------------------------------
class RecvArgs(NamedTuple):
    """RECV: one tensor from `peer` with `tag`; `slot` of RankProgram.buffers, or None for a fresh buffer."""

    peer: int
    tag: int
    type: TensorType
    slot: int | None = None


def _format_recv(op: Op) -> str:
    a = op.args
    return f"from {a.peer} tag {a.tag} {a.type}" + (f" -> buf {a.slot}" if a.slot is not None else "")


_RECV_RE = re.compile(r"from (\d+) tag (\d+) (\[[\d,\s]*\] \w+)(?: -> buf (\d+))?")


def _parse_recv(inner: str, outs) -> tuple[tuple[str, ...], RecvArgs]:
    m = _RECV_RE.fullmatch(inner)
    if not m:
        raise LoweringError(f"cannot read irecv({inner}): expected 'from PEER tag TAG [SHAPE] DTYPE [-> buf SLOT]'")
    slot = int(m.group(4)) if m.group(4) is not None else None
    return (), RecvArgs(int(m.group(1)), int(m.group(2)), TensorType.parse(m.group(3)), slot)


def _recv_posts(op: Op, rank: int) -> list[tuple[int, int, int, TensorType]]:
    return [(op.args.peer, rank, op.args.tag, op.args.type)]


def _recv_fresh(op: Op, nbytes, ranks: int) -> tuple[int, ...]:
    return (0 if op.args.slot is not None else op.args.type.nbytes,)   # a slot is made once, before the step


def _recv_capture(op: Op, program) -> str:
    # static_recv_buffers leaves a receive unslotted exactly when its buffer may outlive the step (it becomes a
    # .grad or the output): memory of the graph's pool that the next replay overwrites
    if op.args.slot is None:
        return ("receives into a fresh buffer (no static slot): its memory would belong to the graph's pool and "
                "be overwritten by the next replay while still in use")
    return SAFE


_RECV = OpSpec(OpKind.RECV, "post a receive of one tensor (into a static buffer if slotted); outs = (handle,)",
               text="irecv", stream=Stream.COMM, emit="recv", runtime=("recv", "recv_into"), args=RecvArgs,
               format=_format_recv, parse=_parse_recv, posts=_recv_posts, sync=Sync.POST, fresh=_recv_fresh,
               capture=_recv_capture,
               fix="lower with capture_ready before the finishing passes, so that static_recv_buffers can give "
                   "every receive a slot (nothing that aliases it may outlive the step)")


def _first_in_is_out(op: Op, graph_aliases) -> list[tuple[str, str]]:
    return [(op.ins[0], op.outs[0])]


_WAIT_RECV = OpSpec(OpKind.WAIT_RECV, "wait for a posted receive; ins = (handle,), outs = (tensor,)",
                    text="wait_recv", stream=Stream.COMM, emit="wait_recv", runtime=("wait_recv",),
                    aliases=_first_in_is_out, sync=Sync.WAIT, capture=wait_capture, fix=UNTIMED_WAIT_FIX)


# ---- SEND: a batch of messages, one per input -----------------------------------------------------------
class Message(NamedTuple):
    """One tensor of a SEND: to `peer` with `tag`."""

    peer: int
    tag: int
    type: TensorType


class SendArgs(NamedTuple):
    """SEND: one message per input, in order."""

    messages: tuple[Message, ...]


def _format_send(op: Op) -> str:
    return ", ".join(f"{v} -> {m.peer} tag {m.tag} {m.type}" for v, m in zip(op.ins, op.args.messages))


_SEND_RE = re.compile(r"(\S+) -> (\d+) tag (\d+) (\[[\d,\s]*\] \w+)")


def _parse_send(inner: str, outs) -> tuple[tuple[str, ...], SendArgs]:
    found = _SEND_RE.findall(inner)
    if not found or ", ".join(f"{v} -> {p} tag {t} {ty}" for v, p, t, ty in found) != inner:
        raise LoweringError(f"cannot read isend({inner}): expected 'VALUE -> PEER tag TAG [SHAPE] DTYPE, ...'")
    return (tuple(v for v, *_ in found),
            SendArgs(tuple(Message(int(p), int(t), TensorType.parse(ty)) for _, p, t, ty in found)))


def _send_aliases(op: Op, graph_aliases) -> list[tuple[str, str]]:
    return [(v, op.outs[0]) for v in op.ins]   # the handle holds the tensors until WAIT_SEND


def _send_posts(op: Op, rank: int) -> list[tuple[int, int, int, TensorType]]:
    return [(rank, m.peer, m.tag, m.type) for m in op.args.messages]


_SEND = OpSpec(OpKind.SEND, "post a batch of sends, one message per input; outs = (handle,)", text="isend",
               stream=Stream.COMM, emit="send", runtime=("send",), args=SendArgs, format=_format_send,
               parse=_parse_send, aliases=_send_aliases, posts=_send_posts, sync=Sync.POST, capture=SAFE)
_WAIT_SEND = OpSpec(OpKind.WAIT_SEND, "wait for a batch of sends (the peer has the data; the tensors may go)",
                    text="wait_send", stream=Stream.COMM, emit="wait_send", runtime=("wait_send",), sync=Sync.WAIT,
                    capture=wait_capture, fix=UNTIMED_WAIT_FIX)

ROWS = (_RECV, _WAIT_RECV, _SEND, _WAIT_SEND)
