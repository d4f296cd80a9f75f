"""The machinery every op family shares: the kinds, the Op record, the OpSpec row and its default rules, the
text helpers, and the SPECS table the package's __init__ fills from the family modules.

The families import from here and nothing else of the package; the package imports the families. So a family
module never sees another one, and there is no import cycle.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Callable, Iterable, NamedTuple

import torch

from zbcompile.errors import LoweringError
from zbcompile.ir.schedule import Action

__all__ = ["OpKind", "Sync", "Stream", "TensorType", "Op", "OpSpec", "SAFE", "SPECS", "spec", "spec_by_text",
           "install", "values_text", "split_values", "with_arg", "no_args", "read_bool", "wait_capture",
           "UNTIMED_WAIT_FIX", "no_aliases", "never_keeps", "no_posts", "no_fresh", "CUDA_BLOCK", "allocated_bytes"]


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
    KEEP_OUTPUTS = "keep_outputs"
    STAMP = "stamp"
    COLLECTIVE = "collective"
    WAIT_COLL = "wait_coll"
    DP_REDUCE = "dp_reduce"
    WAIT_DP = "wait_dp"
    DP_GATHER = "dp_gather"
    WAIT_GATHER = "wait_gather"
    OFFLOAD = "offload"
    WAIT_OFFLOAD = "wait_offload"
    RELOAD = "reload"
    WAIT_RELOAD = "wait_reload"
    PREFIX = "prefix"
    TOTALS = "totals"
    VALIDATE = "validate"


class Sync(str, enum.Enum):
    """How an op synchronises with other ranks."""

    NONE = "none"              # runs on its own
    POST = "post"              # posts P2P messages (returns a handle at once; never blocks)
    WAIT = "wait"              # blocks until the messages of a handle are matched by the peer
    COLLECTIVE = "collective"  # posts a collective on the all-ranks group (returns a handle; never blocks)
    JOIN = "join"              # blocks until every rank of the group has posted the collective of a handle
    REPLICAS = "replicas"      # a collective over the data-parallel group (this rank in every replica), posted
                               # or joined: the replicas run this same program, so it involves no other
                               # pipeline rank and the pipeline's checks treat it as local


class Stream(str, enum.Enum):
    """Where an op's work runs on a device."""

    COMPUTE = "compute"   # the compute stream
    COMM = "comm"         # a communicator's stream (P2P posts and their waits)
    COPY = "copy"         # the rank's copy stream (offload / reload between device and host pool)
    DP = "dp"             # the data-parallel group's stream (gradient reductions, parameter gathers)
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


# torch's CUDA caching allocator hands out blocks in multiples of 512 bytes (kMinBlockSize), and
# max_memory_allocated counts the blocks: a 64-byte LayerNorm statistic takes 512. The memory plan and the
# storage tracker count what the allocator counts, so that a model of many small tensors is not under-counted.
CUDA_BLOCK = 512


def allocated_bytes(nbytes: int, device: torch.device | str | None) -> int:
    """What an allocation of `nbytes` takes on `device`: CUDA rounds up to CUDA_BLOCK, the CPU gives the bytes."""
    if device is None or torch.device(device).type != "cuda":
        return nbytes
    return -(-nbytes // CUDA_BLOCK) * CUDA_BLOCK


def _itemsize(dtype: torch.dtype) -> int:
    size = _ITEMSIZE.get(dtype)
    if size is None:
        size = _ITEMSIZE[dtype] = torch.empty((), dtype=dtype).element_size()
    return size


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


# ---- text forms: the helpers the families' format / parse are made of ---------------------------------------
def values_text(op: Op) -> str:
    """The text of a kind without arguments: its input values, comma-separated."""
    return ", ".join(op.ins)


def split_values(inner: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in inner.split(",") if v.strip())


def no_args(inner: str, outs) -> tuple[tuple[str, ...], None]:
    """Parse of a kind without arguments: the values between the parentheses are its inputs."""
    return split_values(inner), None


def with_arg(name: str, read: Callable[[str], object], make) -> tuple[Callable, Callable]:
    """Format / parse of `kind(v1, v2; ARG)`: the values, then the kind's one argument after a semicolon."""
    def fmt(op: Op) -> str:
        value = getattr(op.args, name)
        text = value.value if isinstance(value, enum.Enum) else value
        return f"{values_text(op)}; {text}" if op.ins else f"{text}"

    def parse(inner: str, outs):
        values, sep, arg = inner.rpartition(";") if ";" in inner else ("", "", inner)
        return split_values(values), make(read(arg.strip()))
    return fmt, parse


def read_bool(text: str) -> bool:
    if text not in ("True", "False"):
        raise LoweringError(f"expected True or False, got {text!r}")
    return text == "True"


# ---- the default rules: what a kind does unless its row says otherwise ------------------------------------
def no_aliases(op: Op, graph_aliases) -> list[tuple[str, str]]:
    return []


def never_keeps(op: Op) -> bool:
    return False


def no_posts(op: Op, rank: int) -> list:
    return []


def no_fresh(op: Op, nbytes, ranks: int) -> tuple[int, ...]:
    return (0,) * len(op.outs)


# ---- CUDA-graph capture: "safe" or why not (passes/analysis/capture.py) -----------------------------------
# Capture records the device work of one step and replays it without running the host code again. So an op
# is safe when its device work is the same every step, on memory that outlives the graph or belongs to the
# step alone, and its host side neither blocks on the device nor keeps anything. A host STAMP captures
# nothing, and on replay its slots would keep the capture step's times: the graph path times with events.
# The stage graphs a RUN calls are checked node by node (capture.py), SAFE here covers the call itself.
SAFE = "safe"
# the fix of every wait: capture_ready (passes/lower/capture.py) lowers untimed waits
UNTIMED_WAIT_FIX = "lower with capture_ready (RankProgram.wait_timeout=False: plain work.wait())"


def wait_capture(op: Op, program) -> str:
    """The capture verdict of every wait on another rank (P2P or collective)."""
    # work.wait(timeout) blocks the host until the work is done, which capture forbids; work.wait() only
    # records a stream dependency
    if program.wait_timeout:
        return ("timed wait: the runtime calls work.wait(timeout), which blocks the host (illegal while "
                "capturing); the graph path needs a plain work.wait()")
    return SAFE


# ---- the row ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OpSpec:
    """Everything about one op kind (see the package docstring). A row names what its kind decides; every
    other part has the default of a kind that reads its inputs, defines no memory of its own, aliases and
    keeps nothing, posts nothing and waits for no other rank."""

    kind: OpKind
    meaning: str
    text: str
    stream: Stream
    emit: str                                 # method of passes.lower.emit.Emitter
    runtime: tuple[str, ...]                  # functions of zbcompile.runtime.abi the code calls
    args: type | None = None
    format: Callable[[Op], str] = values_text
    parse: Callable[[str, tuple], tuple] = no_args   # (text between the parentheses, outs) -> (ins, args)
    aliases: Callable[[Op, Callable], list] = no_aliases   # (op, graph key -> output aliases) -> [(input, output)]
    keeps: Callable[[Op], bool] = never_keeps
    posts: Callable[[Op, int], list] = no_posts   # (op, rank) -> [(source, destination, tag, type)] it posts
    sync: Sync = Sync.NONE
    # (op, value -> bytes, ranks) -> per output, bytes of fresh device memory (0: none, or what `aliases` says);
    # None: the memory plan does not model the kind and refuses it. RUN ops are read off their graphs instead.
    fresh: Callable[[Op, Callable[[str], int], int], tuple[int, ...]] | None = no_fresh
    # CUDA-graph capture of the whole step: SAFE, a reason it is not, or (op, program) -> SAFE or a reason;
    # None: undecided, which the capture check reports (a new kind must decide)
    capture: str | Callable[[Op, object], str] | None = None
    # how to make the op safe where `capture` can say it is not (passes/analysis/capture.py prints it)
    fix: str | None = None
    # ops on the copy stream: op -> the bytes it queues on that stream (an offload, a reload); None for one that
    # waits for the copies whose handles it reads (the offload planner's time model, passes/analysis/offload_plan)
    copy_bytes: Callable[[Op], int] | None = None

    def capture_problem(self, op: Op, program) -> str | None:
        """Why `op` of `program` blocks CUDA-graph capture, or None where it does not."""
        verdict = self.capture(op, program) if callable(self.capture) else self.capture
        if verdict is None:
            return f"op kind {self.kind.value} has not been checked for CUDA-graph capture (OpSpec.capture is unset)"
        return None if verdict == SAFE else verdict


# ---- the table --------------------------------------------------------------------------------------------
# filled once, by the package's __init__, from the family modules' ROWS (in OpKind order)
SPECS: dict[OpKind, OpSpec] = {}
_BY_TEXT: dict[str, OpSpec] = {}


def install(rows: Iterable[OpSpec]) -> None:
    """Fill SPECS with `rows`, in OpKind order. A kind with two rows is an error: each kind is declared once."""
    by_kind: dict[OpKind, OpSpec] = {}
    for row in rows:
        if row.kind in by_kind:
            raise LoweringError(f"op kind {row.kind} has two OpSpec rows; declare it in one family module")
        by_kind[row.kind] = row
    SPECS.update((k, by_kind[k]) for k in OpKind if k in by_kind)
    _BY_TEXT.update((s.text, s) for s in SPECS.values())


def spec(kind: OpKind) -> OpSpec:
    """The spec of `kind`; a LoweringError naming the kind when it has none (a kind added without one)."""
    found = SPECS.get(kind)
    if found is None:
        raise LoweringError(f"op kind {kind} has no OpSpec in zbcompile.ir.program.ops.SPECS; every kind needs one "
                            f"(see docs/design.md, 'Adding an op kind')")
    return found


def spec_by_text(name: str) -> OpSpec | None:
    return _BY_TEXT.get(name)
