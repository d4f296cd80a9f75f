"""Op kinds of the rank-program IR, each defined once: one `OpSpec` per kind holds everything a pass, a
check, the emitter or the runtime needs to know about it.

    spec part   what it says                                         who reads it
    meaning     one line                                             printing, docs
    args        the record of the kind's static arguments (typed)    passes, emitter
    text        the call's name in the printed program; format /     RankProgram.to_text / from_text
                parse of the arguments between its parentheses
    aliases     which outputs may share memory with which inputs     buffers.py (static receive buffers)
    keeps       whether the op may hold an input beyond the step     buffers.py
    fresh       per output, the bytes of fresh memory it allocates   passes/analysis/memory.py (memory plan)
    posts       the messages a posting op puts on the wire           validate.py, order_p2p.py, streams.py
    sync        none / posts P2P / waits on P2P / collective          validate.py (deadlock), streams.py
    stream      compute / comm / copy / host                         streams.py (device-stream deadlock)
    emit        the emitter's method for it                          passes/lower/emit.py
    runtime     the runtime ABI functions its code calls             zbcompile/runtime/abi.py
    capture     "safe" for CUDA-graph capture of the whole step, or  passes/analysis/capture.py
                why not (a string, or a function of the op and its
                program where the answer depends on them)

A new kind (a collective, an overlapped F&B run) is one OpKind member, one args record and
one OpSpec row; tests/test_op_specs.py fails while any part is missing, and the checks refuse a kind whose
synchronisation they do not model instead of guessing. docs/design.md walks through adding one.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from zbcompile.errors import LoweringError
from zbcompile.ir.schedule import Action

__all__ = ["OpKind", "Sync", "Stream", "TensorType", "Message", "RunArgs", "RecvArgs", "SendArgs", "Coll",
           "CollArgs", "HostArgs", "View", "ViewArgs", "AccumArgs", "AccumMode", "SetGradArgs", "StampArgs", "Op",
           "OpSpec", "SPECS", "spec"]


class OpKind(str, enum.Enum):
    """One kind of work in a rank program (the meanings are in SPECS). A str enum: kinds are hashed millions
    of times when large pipelines are lowered, and str's hash is C code where Enum's is Python."""

    RUN = "run"
    RECV = "recv"
    WAIT_RECV = "wait_recv"
    SEND = "send"
    WAIT_SEND = "wait_send"
    FREE = "free"
    ACCUM = "accum"
    SUM = "sum"
    SET_GRAD = "set_grad"
    ADD_LOSS = "add_loss"
    COPY_BUFFER = "copy_buffer"
    STAMP = "stamp"
    COLLECTIVE = "collective"
    WAIT_COLL = "wait_coll"
    OFFLOAD = "offload"
    WAIT_OFFLOAD = "wait_offload"
    RELOAD = "reload"
    WAIT_RELOAD = "wait_reload"


class Sync(str, enum.Enum):
    """How an op synchronises with other ranks."""

    NONE = "none"              # runs on its own
    POST = "post"              # posts P2P messages (returns a handle at once; never blocks)
    WAIT = "wait"              # blocks until the messages of a handle are matched by the peer
    COLLECTIVE = "collective"  # posts a collective on the all-ranks group (returns a handle; never blocks)
    JOIN = "join"              # blocks until every rank of the group has posted the collective of a handle


class Stream(str, enum.Enum):
    """Where an op's work runs on a device."""

    COMPUTE = "compute"   # the compute stream
    COMM = "comm"         # a communicator's stream (P2P posts and their waits)
    COPY = "copy"         # the rank's copy stream (offload / reload between device and host pool)
    HOST = "host"         # host only: enqueues nothing on any stream (timing stamps)


class TensorType(NamedTuple):
    """Shape and dtype of a tensor the program allocates or moves (receive buffers, messages, host slots);
    `stride` where the layout matters too (the views WAIT_RELOAD makes: a reloaded tensor must have the
    strides the backward graph was traced with), else None. Printed `[4, 8] float32` or
    `[4, 8] float32 stride (8, 1)`."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    stride: tuple[int, ...] | None = None

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * _itemsize(self.dtype)

    def __str__(self) -> str:
        text = f"{list(self.shape)} {str(self.dtype).removeprefix('torch.')}"
        return text if self.stride is None else f"{text} stride {tuple(self.stride)}"

    @staticmethod
    def parse(text: str) -> TensorType:
        m = _TYPE_RE.fullmatch(text.strip())
        dtype = getattr(torch, m.group(2), None) if m else None
        if not isinstance(dtype, torch.dtype):
            raise LoweringError(f"cannot read tensor type {text!r}: expected SHAPE DTYPE [stride STRIDE] such as "
                                f"'[2, 8] float32' or '[2, 8] float32 stride (8, 1)'")
        shape = tuple(int(d) for d in m.group(1).split(",") if d.strip())
        stride = None if m.group(3) is None else tuple(int(d) for d in m.group(3).split(",") if d.strip())
        return TensorType(shape, dtype, stride)


_TYPE_RE = re.compile(r"\[([\d,\s]*)\]\s+(\w+)(?:\s+stride\s+\(([\d,\s]*)\))?")
_ITEMSIZE: dict[torch.dtype, int] = {}


def _itemsize(dtype: torch.dtype) -> int:
    size = _ITEMSIZE.get(dtype)
    if size is None:
        size = _ITEMSIZE[dtype] = torch.empty((), dtype=dtype).element_size()
    return size


# ---- the kinds' argument records --------------------------------------------------------------------
class RunArgs(NamedTuple):
    """RUN: the schedule action it computes and the key of the graph it calls in RankProgram.graphs."""

    action: Action
    graph: str


class RecvArgs(NamedTuple):
    """RECV: one tensor from `peer` with `tag`; `slot` of RankProgram.buffers, or None for a fresh buffer."""

    peer: int
    tag: int
    type: TensorType
    slot: int | None = None


class Message(NamedTuple):
    """One tensor of a SEND: to `peer` with `tag`."""

    peer: int
    tag: int
    type: TensorType


class SendArgs(NamedTuple):
    """SEND: one message per input, in order."""

    messages: tuple[Message, ...]


class AccumMode(enum.Enum):
    FIRST = "first"   # the microbatch gradients become the running sums (no computation)
    ADD = "add"       # sums = old sums + gradients, out of place (fresh memory)
    ADD_ = "add_"     # old sums += gradients, in place; the outputs name the updated sums


class AccumArgs(NamedTuple):
    """ACCUM: ins = (old sums..., gradients...) (FIRST: gradients only); outs = the new sums."""

    mode: AccumMode


class SetGradArgs(NamedTuple):
    """SET_GRAD: `owned`: the step owns the tensor, which may become Parameter.grad itself."""

    owned: bool


class StampArgs(NamedTuple):
    """STAMP: the timing slot it writes."""

    slot: int


class Coll(str, enum.Enum):
    """What a COLLECTIVE does (over every rank, on the collective group)."""

    BROADCAST = "broadcast"     # root's tensor to every rank: ins = (tensor,) on the root, () elsewhere
    REDUCE = "reduce"           # sum of every rank's tensor onto the root (in place there): ins = (tensor,)
    ALL_GATHER = "all_gather"   # every rank's tensor stacked on a new first dim, on every rank: ins = (tensor,)


class CollArgs(NamedTuple):
    """COLLECTIVE: what it does, its root (-1 for none), its position `seq` in the group's sequence (every rank
    posts the same collectives in the same order, and the checks match them by seq) and the type of each
    rank's tensor."""

    op: Coll
    root: int
    seq: int
    type: TensorType


class HostArgs(NamedTuple):
    """OFFLOAD / RELOAD: the slot of RankProgram.host_buffers the copy writes / reads, and its type: the whole
    device storage the offloaded values live in, as flat bytes (`[3072] uint8`), so that views of one storage
    go out and come back as one copy and slots of equal size serve any dtype."""

    slot: int
    type: TensorType


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


# ---- ops --------------------------------------------------------------------------------------------
class Op(NamedTuple):
    """One op: `kind`, the values it reads (`ins`) and defines (`outs`), its kind's `args` record (None
    for kinds without arguments), and `note`: why it is here, shown in the printed program. Immutable; a
    pass makes a changed copy with `op._replace(...)`. (A NamedTuple, not a frozen dataclass: a lowering at
    pp=64 makes millions of ops, and a frozen dataclass's __init__ costs a Python call per field.)"""

    kind: OpKind
    ins: tuple[str, ...] = ()
    outs: tuple[str, ...] = ()
    args: object = None
    note: str = ""

    @property
    def spec(self) -> OpSpec:
        return SPECS.get(self.kind) or spec(self.kind)

    @property
    def action(self) -> Action | None:
        """The schedule action of a RUN op (None for other kinds)."""
        return self.args.action if self.kind is OpKind.RUN else None

    def messages(self, rank: int) -> list[tuple[int, int, int]]:
        """(source, destination, tag) of each message this op posts when `rank` runs it."""
        return [(src, dst, tag) for src, dst, tag, _ in self.spec.posts(self, rank)]

    def __str__(self) -> str:
        s = spec(self.kind)
        lhs = f"{', '.join(self.outs)} = " if self.outs else ""
        head = f"[{self.args.action}] " if self.kind is OpKind.RUN else ""
        name = self.args.graph if self.kind is OpKind.RUN else s.text
        tail = f"    # {self.note}" if self.note else ""
        return f"{head}{lhs}{name}({s.format(self)}){tail}"


# ---- text forms of each kind's arguments --------------------------------------------------------------
def _values(op: Op) -> str:
    return ", ".join(op.ins)


def _split(inner: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in inner.split(",") if v.strip())


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


def _format_send(op: Op) -> str:
    return ", ".join(f"{v} -> {m.peer} tag {m.tag} {m.type}" for v, m in zip(op.ins, op.args.messages))


_SEND_RE = re.compile(r"(\S+) -> (\d+) tag (\d+) (\[[\d,\s]*\] \w+)")


def _parse_send(inner: str, outs) -> tuple[tuple[str, ...], SendArgs]:
    found = _SEND_RE.findall(inner)
    if not found or ", ".join(f"{v} -> {p} tag {t} {ty}" for v, p, t, ty in found) != inner:
        raise LoweringError(f"cannot read isend({inner}): expected 'VALUE -> PEER tag TAG [SHAPE] DTYPE, ...'")
    return (tuple(v for v, *_ in found),
            SendArgs(tuple(Message(int(p), int(t), TensorType.parse(ty)) for _, p, t, ty in found)))


def _with_arg(name: str, read: Callable[[str], object], make) -> tuple[Callable, Callable]:
    """Format / parse of `kind(v1, v2; ARG)`: the values, then the kind's one argument after a semicolon."""
    def fmt(op: Op) -> str:
        value = getattr(op.args, name)
        text = value.value if isinstance(value, enum.Enum) else value
        return f"{_values(op)}; {text}" if op.ins else f"{text}"

    def parse(inner: str, outs):
        values, sep, arg = inner.rpartition(";") if ";" in inner else ("", "", inner)
        return _split(values), make(read(arg.strip()))
    return fmt, parse


def _no_args(inner: str, outs):
    return _split(inner), None


def _bool(text: str) -> bool:
    if text not in ("True", "False"):
        raise LoweringError(f"expected True or False, got {text!r}")
    return text == "True"


# ---- aliasing: which outputs may share memory with which inputs ---------------------------------------
def _no_aliases(op: Op, graph_aliases) -> list[tuple[str, str]]:
    return []


def _run_aliases(op: Op, graph_aliases) -> list[tuple[str, str]]:
    """Read off the graph's aten schemas (graph_aliases: graph key -> per output, the input positions)."""
    return [(op.ins[i], out) for out, ins in zip(op.outs, graph_aliases(op.args.graph)) for i in ins]


def _first_in_is_out(op: Op, graph_aliases) -> list[tuple[str, str]]:
    return [(op.ins[0], op.outs[0])]


def _send_aliases(op: Op, graph_aliases) -> list[tuple[str, str]]:
    return [(v, op.outs[0]) for v in op.ins]   # the handle holds the tensors until WAIT_SEND


def _accum_aliases(op: Op, graph_aliases) -> list[tuple[str, str]]:
    n = len(op.outs)
    if op.args.mode is AccumMode.FIRST:
        return list(zip(op.ins, op.outs))
    return list(zip(op.ins[:n], op.outs)) if op.args.mode is AccumMode.ADD_ else []


def _loss_aliases(op: Op, graph_aliases) -> list[tuple[str, str]]:
    return [(op.ins[0], op.outs[0])] if len(op.ins) == 1 else []   # one microbatch: returned as is


# ---- messages: what a posting op puts on the wire --------------------------------------------------------
def _no_posts(op: Op, rank: int) -> list:
    return []


def _recv_posts(op: Op, rank: int) -> list[tuple[int, int, int, TensorType]]:
    return [(op.args.peer, rank, op.args.tag, op.args.type)]


def _send_posts(op: Op, rank: int) -> list[tuple[int, int, int, TensorType]]:
    return [(rank, m.peer, m.tag, m.type) for m in op.args.messages]


def _format_coll(op: Op) -> str:
    a = op.args
    head = f"{_values(op)}; " if op.ins else ""
    return f"{head}{a.op.value} root {a.root} seq {a.seq} {a.type}"


_COLL_RE = re.compile(r"(?:(.*);\s*)?(\w+) root (-?\d+) seq (\d+) (\[[\d,\s]*\] \w+)")


def _parse_coll(inner: str, outs) -> tuple[tuple[str, ...], CollArgs]:
    m = _COLL_RE.fullmatch(inner.strip())
    if not m or m.group(2) not in {c.value for c in Coll}:
        raise LoweringError(f"cannot read collective({inner}): expected '[VALUES; ]OP root ROOT seq SEQ [SHAPE] "
                            f"DTYPE' with OP one of {[c.value for c in Coll]}")
    return _split(m.group(1) or ""), CollArgs(Coll(m.group(2)), int(m.group(3)), int(m.group(4)),
                                              TensorType.parse(m.group(5)))


def _coll_aliases(op: Op, graph_aliases) -> list[tuple[str, str]]:
    return [(v, op.outs[0]) for v in op.ins]   # the handle holds the tensor until WAIT_COLL (the result, on a root)


def _joined_aliases(op: Op, graph_aliases) -> list[tuple[str, str]]:
    return [(op.ins[0], op.outs[0])] if op.outs else []


# ---- fresh memory: what each output allocates (the memory plan) -------------------------------------------
def _no_fresh(op: Op, nbytes, ranks: int) -> tuple[int, ...]:
    return (0,) * len(op.outs)


def _recv_fresh(op: Op, nbytes, ranks: int) -> tuple[int, ...]:
    return (0 if op.args.slot is not None else op.args.type.nbytes,)   # a slot is made once, before the step


def _accum_fresh(op: Op, nbytes, ranks: int) -> tuple[int, ...]:
    n = len(op.outs)
    return tuple(nbytes(g) for g in op.ins[-n:]) if op.args.mode is AccumMode.ADD else (0,) * n


def _first_in_fresh(op: Op, nbytes, ranks: int) -> tuple[int, ...]:
    return (nbytes(op.ins[0]),)


def _loss_fresh(op: Op, nbytes, ranks: int) -> tuple[int, ...]:
    return (nbytes(op.ins[0]) if len(op.ins) > 1 else 0,)


def _coll_fresh(op: Op, nbytes, ranks: int) -> tuple[int, ...]:
    a = op.args
    if a.op is Coll.ALL_GATHER:
        return (ranks * a.type.nbytes,)
    return (0 if op.ins else a.type.nbytes,)   # a broadcast's receivers get a fresh buffer


def _reload_fresh(op: Op, nbytes, ranks: int) -> tuple[int, ...]:
    return (op.args.type.nbytes,)   # the device storage the host copy comes back into, once per group


def _handle_holds_ins(op: Op, graph_aliases) -> list[tuple[str, str]]:
    return [(v, op.outs[0]) for v in op.ins]   # OFFLOAD: every view of the storage, until WAIT_OFFLOAD


def _views_of_in(op: Op, graph_aliases) -> list[tuple[str, str]]:
    return [(op.ins[0], v) for v in op.outs]   # WAIT_RELOAD: every value is a view of the reloaded storage


def _format_offload(op: Op) -> str:
    return f"{_values(op)} -> host {op.args.slot} {op.args.type}"


_OFFLOAD_RE = re.compile(r"(.+?) -> host (\d+) (.+)")
_RELOAD_RE = re.compile(r"host (\d+) (.+)")
_VIEW_RE = re.compile(r"(\[[\d,\s]*\] \w+ stride \([\d,\s]*\)) at (\d+)")


def _parse_offload(inner: str, outs) -> tuple[tuple[str, ...], HostArgs]:
    m = _OFFLOAD_RE.fullmatch(inner.strip())
    if not m:
        raise LoweringError(f"cannot read offload({inner}): expected 'VALUE, ... -> host SLOT [NBYTES] uint8' (the "
                            f"values are views of one storage, copied as its bytes)")
    return _split(m.group(1)), HostArgs(int(m.group(2)), TensorType.parse(m.group(3)))


def _format_reload(op: Op) -> str:
    return f"host {op.args.slot} {op.args.type}"


def _parse_reload(inner: str, outs) -> tuple[tuple[str, ...], HostArgs]:
    m = _RELOAD_RE.fullmatch(inner.strip())
    if not m:
        raise LoweringError(f"cannot read reload({inner}): expected 'host SLOT [NBYTES] uint8'")
    return (), HostArgs(int(m.group(1)), TensorType.parse(m.group(2)))


def _format_wait_reload(op: Op) -> str:
    return f"{_values(op)}; {', '.join(map(str, op.args.views))}"


def _parse_wait_reload(inner: str, outs) -> tuple[tuple[str, ...], ViewArgs]:
    handle, _, views = inner.partition(";")
    found = _VIEW_RE.findall(views)
    if not found or ", ".join(f"{t} at {o}" for t, o in found) != views.strip() or len(found) != len(outs):
        raise LoweringError(f"cannot read wait_reload({inner}): expected 'HANDLE; [SHAPE] DTYPE stride (STRIDE) at "
                            f"OFFSET, ...', one view per output ({len(outs)} here)")
    return _split(handle), ViewArgs(tuple(View(TensorType.parse(t), int(o)) for t, o in found))


def _never_keeps(op: Op) -> bool:
    return False


def _set_grad_keeps(op: Op) -> bool:
    return op.args.owned   # the tensor itself becomes Parameter.grad


# ---- CUDA-graph capture: "safe" or why not (passes/analysis/capture.py) -----------------------------------
# Capture records the device work of one step and replays it without running the host code again. So an op
# is safe when its device work is the same every step, on memory that outlives the graph or belongs to the
# step alone, and its host side neither blocks on the device nor keeps anything. A host STAMP captures
# nothing, and on replay its slots would keep the capture step's times: the graph path times with events.
# The stage graphs a RUN calls are checked node by node (capture.py), SAFE here covers the call itself.
SAFE = "safe"


def _recv_capture(op: Op, program) -> str:
    # static_recv_buffers leaves a receive unslotted exactly when its buffer may outlive the step (it becomes a
    # .grad or the output): memory of the graph's pool that the next replay overwrites
    if op.args.slot is None:
        return ("receives into a fresh buffer (no static slot): its memory would belong to the graph's pool and "
                "be overwritten by the next replay while still in use")
    return SAFE


def _wait_capture(op: Op, program) -> str:
    # work.wait(timeout) blocks the host until the work is done, which capture forbids; work.wait() only
    # records a stream dependency
    if program.wait_timeout:
        return ("timed wait: the runtime calls work.wait(timeout), which blocks the host (illegal while "
                "capturing); the graph path needs a plain work.wait()")
    return SAFE


def _stamp_capture(op: Op, program) -> str:
    if not program.event_timing:
        return ("host clock stamp: perf_counter runs once, at capture, so every replay would report the capture "
                "step's times; the graph path records device events (RankProgram.event_timing)")
    return SAFE


def _set_grad_capture(op: Op, program) -> str:
    # owned=False with an existing .grad is `.grad.add_(g)`: an in-place add into a buffer that outlives the
    # graph. owned=True may make the step's own memory (the graph's pool) Parameter.grad, which the next
    # replay overwrites; the capture protocol keeps .grad allocated (zeroed in place, never set to None)
    if op.args.owned:
        return ("takes ownership: may rebind Parameter.grad to the step's own tensor (graph-pool memory the next "
                "replay overwrites) instead of accumulating into the persistent .grad")
    return SAFE


# ---- the table --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OpSpec:
    """Everything about one op kind (see the module docstring)."""

    kind: OpKind
    meaning: str
    args: type | None
    text: str
    format: Callable[[Op], str]
    parse: Callable[[str, tuple], tuple]      # (text between the parentheses, outs) -> (ins, args)
    aliases: Callable[[Op, Callable], list]   # (op, graph key -> output aliases) -> [(input, output)]
    keeps: Callable[[Op], bool]
    posts: Callable[[Op, int], list]          # (op, rank) -> [(source, destination, tag, type)] it posts
    sync: Sync
    stream: Stream
    emit: str                                 # method of passes.lower.emit.Emitter
    runtime: tuple[str, ...]                  # functions of zbcompile.runtime.abi the code calls
    # (op, value -> bytes, ranks) -> per output, bytes of fresh device memory (0: none, or what `aliases` says);
    # None: the memory plan does not model the kind and refuses it. RUN ops are read off their graphs instead.
    fresh: Callable[[Op, Callable[[str], int], int], tuple[int, ...]] | None = None
    # CUDA-graph capture of the whole step: SAFE, a reason it is not, or (op, program) -> SAFE or a reason;
    # None: undecided, which the capture check reports (a new kind must decide)
    capture: str | Callable[[Op, object], str] | None = None

    def capture_problem(self, op: Op, program) -> str | None:
        """Why `op` of `program` blocks CUDA-graph capture, or None where it does not."""
        verdict = self.capture(op, program) if callable(self.capture) else self.capture
        if verdict is None:
            return f"op kind {self.kind.value} has not been checked for CUDA-graph capture (OpSpec.capture is unset)"
        return None if verdict == SAFE else verdict


def _run_parse(inner: str, outs):
    return _split(inner), None   # the graph and action are read from the line's head (RankProgram.from_text)


_accum_fmt, _accum_parse = _with_arg("mode", AccumMode, AccumArgs)
_grad_fmt, _grad_parse = _with_arg("owned", _bool, SetGradArgs)
_stamp_fmt, _stamp_parse = _with_arg("slot", int, StampArgs)

SPECS: dict[OpKind, OpSpec] = {s.kind: s for s in (
    OpSpec(OpKind.RUN, "run one stage graph (F, B, W, BW or a variant) for one action", RunArgs, "run",
           _values, _run_parse, aliases=_run_aliases, keeps=_never_keeps, posts=_no_posts,
           sync=Sync.NONE, stream=Stream.COMPUTE, emit="run", runtime=(), fresh=_no_fresh,
           capture=SAFE),
    OpSpec(OpKind.RECV, "post a receive of one tensor (into a static buffer if slotted); outs = (handle,)",
           RecvArgs, "irecv", _format_recv, _parse_recv, aliases=_no_aliases, keeps=_never_keeps,
           posts=_recv_posts, sync=Sync.POST, stream=Stream.COMM, emit="recv", runtime=("recv", "recv_into"),
           fresh=_recv_fresh, capture=_recv_capture),
    OpSpec(OpKind.WAIT_RECV, "wait for a posted receive; ins = (handle,), outs = (tensor,)", None, "wait_recv",
           _values, _no_args, aliases=_first_in_is_out, keeps=_never_keeps, posts=_no_posts,
           sync=Sync.WAIT, stream=Stream.COMM, emit="wait_recv", runtime=("wait_recv",), fresh=_no_fresh,
           capture=_wait_capture),
    OpSpec(OpKind.SEND, "post a batch of sends, one message per input; outs = (handle,)", SendArgs, "isend",
           _format_send, _parse_send, aliases=_send_aliases, keeps=_never_keeps, posts=_send_posts,
           sync=Sync.POST, stream=Stream.COMM, emit="send", runtime=("send",), fresh=_no_fresh,
           capture=SAFE),
    OpSpec(OpKind.WAIT_SEND, "wait for a batch of sends (the peer has the data; the tensors may go)", None,
           "wait_send", _values, _no_args, aliases=_no_aliases, keeps=_never_keeps, posts=_no_posts,
           sync=Sync.WAIT, stream=Stream.COMM, emit="wait_send", runtime=("wait_send",), fresh=_no_fresh,
           capture=_wait_capture),
    OpSpec(OpKind.FREE, "last use of tensors: the program drops its references here", None, "free",
           _values, _no_args, aliases=_no_aliases, keeps=_never_keeps, posts=_no_posts,
           sync=Sync.NONE, stream=Stream.COMPUTE, emit="free", runtime=("free",), fresh=_no_fresh, capture=SAFE),
    OpSpec(OpKind.ACCUM, "add microbatch parameter gradients into running sums", AccumArgs, "accum",
           _accum_fmt, _accum_parse, aliases=_accum_aliases, keeps=_never_keeps, posts=_no_posts,
           sync=Sync.NONE, stream=Stream.COMPUTE, emit="accum", runtime=("accumulate_",), fresh=_accum_fresh,
           capture=SAFE),
    OpSpec(OpKind.SUM, "sum copies of one gradient from several ranks, in rank order", None, "sum",
           _values, _no_args, aliases=_no_aliases, keeps=_never_keeps, posts=_no_posts,
           sync=Sync.NONE, stream=Stream.COMPUTE, emit="call_op", runtime=("sum_in_order",), fresh=_first_in_fresh,
           capture=SAFE),
    OpSpec(OpKind.SET_GRAD, "accumulate a finished gradient into Parameter.grad", SetGradArgs, "set_grad",
           _grad_fmt, _grad_parse, aliases=_no_aliases, keeps=_set_grad_keeps, posts=_no_posts,
           sync=Sync.NONE, stream=Stream.COMPUTE, emit="set_grad", runtime=("set_grad",), fresh=_no_fresh,
           capture=_set_grad_capture),
    OpSpec(OpKind.ADD_LOSS, "sum the microbatch losses; outs = (loss,)", None, "add_loss",
           _values, _no_args, aliases=_loss_aliases, keeps=_never_keeps, posts=_no_posts,
           sync=Sync.NONE, stream=Stream.COMPUTE, emit="call_op", runtime=("sum_losses",), fresh=_loss_fresh,
           capture=SAFE),
    OpSpec(OpKind.COPY_BUFFER, "copy a buffer's new value (an F output) into the live buffer", None, "copy_buffer",
           _values, _no_args, aliases=_no_aliases, keeps=_never_keeps, posts=_no_posts,
           sync=Sync.NONE, stream=Stream.COMPUTE, emit="call_op", runtime=("copy_buffer",), fresh=_no_fresh,
           capture=SAFE),
    OpSpec(OpKind.STAMP, "record the time into a timing slot (action start / end)", StampArgs, "stamp",
           _stamp_fmt, _stamp_parse, aliases=_no_aliases, keeps=_never_keeps, posts=_no_posts,
           sync=Sync.NONE, stream=Stream.HOST, emit="stamp", runtime=("stamp_event",), fresh=_no_fresh,
           capture=_stamp_capture),
    OpSpec(OpKind.COLLECTIVE, "post a collective over every rank (broadcast, reduce, all-gather); outs = (handle,)",
           CollArgs, "collective", _format_coll, _parse_coll, aliases=_coll_aliases, keeps=_never_keeps,
           posts=_no_posts, sync=Sync.COLLECTIVE, stream=Stream.COMM, emit="collective", runtime=("collective",),
           fresh=_coll_fresh, capture=SAFE),
    OpSpec(OpKind.WAIT_COLL, "wait for a posted collective; ins = (handle,), outs = (its result,) or () where "
           "this rank gets none (a reduce off its root)", None, "wait_coll", _values, _no_args,
           aliases=_joined_aliases, keeps=_never_keeps, posts=_no_posts, sync=Sync.JOIN, stream=Stream.COMM,
           emit="wait_coll", runtime=("wait_collective",), fresh=_no_fresh, capture=_wait_capture),
    # activation offload (passes/lower/offload.py): copies run on the rank's copy stream, never wait for another
    # rank; a WAIT_* joins the copy back into the compute stream
    OpSpec(OpKind.OFFLOAD, "copy the device storage of its inputs (views of one storage) into a host pool slot as "
           "bytes; outs = (handle,), which holds them until WAIT_OFFLOAD", HostArgs, "offload", _format_offload,
           _parse_offload, aliases=_handle_holds_ins, keeps=_never_keeps, posts=_no_posts, sync=Sync.NONE,
           stream=Stream.COPY, emit="offload", runtime=("offload",), fresh=_no_fresh, capture=SAFE),
    OpSpec(OpKind.WAIT_OFFLOAD, "wait for an offload's copy; the device storage may go", None, "wait_offload",
           _values, _no_args, aliases=_no_aliases, keeps=_never_keeps, posts=_no_posts, sync=Sync.NONE,
           stream=Stream.COPY, emit="wait_offload", runtime=("wait_offload",), fresh=_no_fresh, capture=SAFE),
    OpSpec(OpKind.RELOAD, "make a device storage of a host slot's size and copy the slot into it; outs = (handle,)",
           HostArgs, "reload", _format_reload, _parse_reload, aliases=_no_aliases, keeps=_never_keeps,
           posts=_no_posts, sync=Sync.NONE, stream=Stream.COPY, emit="reload", runtime=("reload",),
           fresh=_reload_fresh, capture=SAFE),
    OpSpec(OpKind.WAIT_RELOAD, "wait for a reload's copy; ins = (handle,), outs = one view of the reloaded storage "
           "per offloaded value", ViewArgs, "wait_reload", _format_wait_reload, _parse_wait_reload,
           aliases=_views_of_in, keeps=_never_keeps, posts=_no_posts, sync=Sync.NONE, stream=Stream.COPY,
           emit="wait_reload", runtime=("wait_reload",), fresh=_no_fresh, capture=SAFE),
)}

_BY_TEXT = {s.text: s for s in SPECS.values()}


def spec(kind: OpKind) -> OpSpec:
    """The spec of `kind`; a LoweringError naming the kind when it has none (a kind added without one)."""
    found = SPECS.get(kind)
    if found is None:
        raise LoweringError(f"op kind {kind} has no OpSpec in zbcompile.ir.program.ops.SPECS; every kind needs one "
                            f"(see docs/design.md, 'Adding an op kind')")
    return found


def spec_by_text(name: str) -> OpSpec | None:
    return _BY_TEXT.get(name)
