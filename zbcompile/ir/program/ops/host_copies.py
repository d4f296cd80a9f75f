"""Host-copy ops of activation offload (passes/lower/offload.py): copies between device storages and the host pool,
queued on the rank's copy stream, and the waits that join them back into the compute stream. They never wait for
another rank (Sync.NONE). Each kind's args record, text form, rules and row."""

from __future__ import annotations

import re
from typing import NamedTuple

from zbcompile.errors import LoweringError
from zbcompile.ir.program.ops._spec import SAFE, Op, OpKind, OpSpec, Stream, TensorType, split_values, values_text

__all__ = ["HostArgs", "View", "ViewArgs", "ROWS"]


class HostArgs(NamedTuple):
    """OFFLOAD / RELOAD: the slot of RankProgram.host_buffers the copy writes / reads, and its type: the whole
    device storage the offloaded values live in, as flat bytes (`[3072] uint8`), so that views of one storage
    go out and come back as one copy and slots of equal size serve any dtype."""

    slot: int
    type: TensorType


def _slot_bytes(op: Op) -> int:
    return op.args.type.nbytes   # one copy of the whole storage, either way


# ---- OFFLOAD, WAIT_OFFLOAD: device -> host -----------------------------------------------------------------
def _format_offload(op: Op) -> str:
    return f"{values_text(op)} -> host {op.args.slot} {op.args.type}"


_OFFLOAD_RE = re.compile(r"(.+?) -> host (\d+) (.+)")


def _parse_offload(inner: str, outs) -> tuple[tuple[str, ...], HostArgs]:
    m = _OFFLOAD_RE.fullmatch(inner.strip())
    if not m:
        raise LoweringError(f"cannot read offload({inner}): expected 'VALUE, ... -> host SLOT [NBYTES] uint8' (the "
                            f"values are views of one storage, copied as its bytes)")
    return split_values(m.group(1)), HostArgs(int(m.group(2)), TensorType.parse(m.group(3)))


def _handle_holds_ins(op: Op, graph_aliases) -> list[tuple[str, str]]:
    return [(v, op.outs[0]) for v in op.ins]   # OFFLOAD: every view of the storage, until WAIT_OFFLOAD


_OFFLOAD = OpSpec(OpKind.OFFLOAD, "copy the device storage of its inputs (views of one storage) into a host pool "
                  "slot as bytes; outs = (handle,), which holds them until WAIT_OFFLOAD", text="offload",
                  stream=Stream.COPY, emit="offload", runtime=("offload",), args=HostArgs, format=_format_offload,
                  parse=_parse_offload, aliases=_handle_holds_ins, capture=SAFE, copy_bytes=_slot_bytes)
_WAIT_OFFLOAD = OpSpec(OpKind.WAIT_OFFLOAD, "wait for an offload's copy; the device storage may go",
                       text="wait_offload", stream=Stream.COPY, emit="wait_offload", runtime=("wait_offload",),
                       capture=SAFE)


# ---- RELOAD, WAIT_RELOAD: host -> a fresh device storage, and the values as views of it -------------------
def _format_reload(op: Op) -> str:
    return f"host {op.args.slot} {op.args.type}"


_RELOAD_RE = re.compile(r"host (\d+) (.+)")


def _parse_reload(inner: str, outs) -> tuple[tuple[str, ...], HostArgs]:
    m = _RELOAD_RE.fullmatch(inner.strip())
    if not m:
        raise LoweringError(f"cannot read reload({inner}): expected 'host SLOT [NBYTES] uint8'")
    return (), HostArgs(int(m.group(1)), TensorType.parse(m.group(2)))


def _reload_fresh(op: Op, nbytes, ranks: int) -> tuple[int, ...]:
    return (op.args.type.nbytes,)   # the device storage the host copy comes back into, once per group


_RELOAD = OpSpec(OpKind.RELOAD, "make a device storage of a host slot's size and copy the slot into it; "
                 "outs = (handle,)", text="reload", stream=Stream.COPY, emit="reload", runtime=("reload",),
                 args=HostArgs, format=_format_reload, parse=_parse_reload, fresh=_reload_fresh, capture=SAFE,
                 copy_bytes=_slot_bytes)


class View(NamedTuple):
    """One value WAIT_RELOAD defines on the reloaded storage: its shape, dtype and stride, and its storage
    offset in elements of its dtype (what the backward graph was traced with). Printed
    `[1, 2, 8, 16] float32 stride (768, 16, 96, 1) at 32`."""

    type: TensorType
    offset: int

    def __str__(self) -> str:
        return f"{self.type} at {self.offset}"


class ViewArgs(NamedTuple):
    """WAIT_RELOAD: one View per output, in order."""

    views: tuple[View, ...]


def _format_wait_reload(op: Op) -> str:
    return f"{values_text(op)}; {', '.join(map(str, op.args.views))}"


_VIEW_RE = re.compile(r"(\[[\d,\s]*\] \w+ stride \([\d,\s]*\)) at (\d+)")


def _parse_wait_reload(inner: str, outs) -> tuple[tuple[str, ...], ViewArgs]:
    handle, _, views = inner.partition(";")
    found = _VIEW_RE.findall(views)
    if not found or ", ".join(f"{t} at {o}" for t, o in found) != views.strip() or len(found) != len(outs):
        raise LoweringError(f"cannot read wait_reload({inner}): expected 'HANDLE; [SHAPE] DTYPE stride (STRIDE) at "
                            f"OFFSET, ...', one view per output ({len(outs)} here)")
    return split_values(handle), ViewArgs(tuple(View(TensorType.parse(t), int(o)) for t, o in found))


def _views_of_in(op: Op, graph_aliases) -> list[tuple[str, str]]:
    return [(op.ins[0], v) for v in op.outs]   # WAIT_RELOAD: every value is a view of the reloaded storage


_WAIT_RELOAD = OpSpec(OpKind.WAIT_RELOAD, "wait for a reload's copy; ins = (handle,), outs = one view of the "
                      "reloaded storage per offloaded value", text="wait_reload", stream=Stream.COPY,
                      emit="wait_reload", runtime=("wait_reload",), args=ViewArgs, format=_format_wait_reload,
                      parse=_parse_wait_reload, aliases=_views_of_in, capture=SAFE)

ROWS = (_OFFLOAD, _WAIT_OFFLOAD, _RELOAD, _WAIT_RELOAD)
