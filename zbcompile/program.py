"""The rank-program IR: what one rank executes in one training step, as a straight line of ops.

The lowering (`zbcompile.passes.lower`) builds one `RankProgram` per rank from a Schedule and a StagedModel,
then emits it as an fx GraphModule whose generated Python code is the program the runtime calls once per
step. The IR sits between the two so that passes stay small and pure: each pass takes a RankProgram and
returns a new one, and a pass that needs a new kind of work (offload / reload, vocab-parallel reductions,
static buffers for CUDA graphs) adds an OpKind and an emitter rather than rewriting fx graphs.

Values are named by strings that are *global* across ranks, so a value keeps its name when it crosses a
rank boundary (the receiver's recv defines the same name the sender's compute defined):

    s{stage}.mb{mb}.{name}      a value of one (stage, microbatch): `s1.mb0.act:h`, `s1.mb0.saved:3`,
                                `s2.mb0.grad:act:h` (stage names as in zbcompile.stages)
    mb{mb}.data:{i}             the microbatch slice of the i-th flat user argument (a program input)
    param:{fqn} / buffer:{fqn}  the live Parameter / buffer (program inputs; canonical names)
    grad_loss                   the seed gradient 1 / num_microbatches (a program input)
    acc{k}.grad:param:{fqn}     the k-th partial sum of a parameter's gradient on this rank
    loss                        the sum of this rank's microbatch losses (the program's output)
    h:...                       a P2P handle (posted receive or batch of sends)

A program prints one op per line (`RankProgram.to_text`); `emit_fx` prints it as Python.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Iterable

from zbcompile.errors import LoweringError
from zbcompile.schedule import Action, Schedule
from zbcompile.stages import StagedModel, TensorSpec

__all__ = ["OpKind", "Op", "RankProgram", "value_id", "data_id", "split_data_id", "split_value_id",
           "python_name"]


class OpKind(enum.Enum):
    """One kind of work in a rank program."""

    RUN = "run"                # run one stage graph (F, B, W or BW) for one action
    RECV = "recv"              # post an irecv (into a static buffer if arg is a slot); outs = (handle,)
    WAIT_RECV = "wait_recv"    # wait for a posted irecv; ins = (handle,), outs = (tensor,)
    SEND = "send"              # post a batch of isends; outs = (handle,)
    WAIT_SEND = "wait_send"    # wait for a batch of isends (the peer has the data; buffers may go)
    FREE = "free"              # last use of tensors: the program drops its references here
    ACCUM = "accum"            # add a microbatch's parameter gradient into a running sum
    SUM = "sum"                # sum copies of one gradient from several ranks, in rank order
    SET_GRAD = "set_grad"      # accumulate a finished gradient into Parameter.grad
    ADD_LOSS = "add_loss"      # sum the microbatch losses; outs = ("loss",)
    COPY_BUFFER = "copy_buffer"  # copy a buffer's new value (F output) into the live buffer
    STAMP = "stamp"            # record perf_counter() into slot `arg` (action start / end)


@dataclass(frozen=True)
class Op:
    """One op. `ins` / `outs` are value names; the other fields are static arguments of its kind.

    peers / tags / specs: for RECV and SEND, one entry per tensor (the other rank, the tag, the shape).
    arg: kind-specific constant (ACCUM: "first" / "add" / "add_"; STAMP: slot; SET_GRAD: owned flag;
    RUN: None, or "accumulate" for the stage graph's variant that adds its parameter gradients into sums;
    RECV: the slot of RankProgram.buffers it receives into, None for a fresh buffer).
    note: why the op is here, shown in the printed program.
    """

    kind: OpKind
    ins: tuple[str, ...] = ()
    outs: tuple[str, ...] = ()
    action: Action | None = None
    graph: str = ""
    peers: tuple[int, ...] = ()
    tags: tuple[int, ...] = ()
    specs: tuple[TensorSpec, ...] = ()
    arg: object = None
    note: str = ""

    def messages(self, rank: int) -> list[tuple[int, int, int]]:
        """(source, destination, tag) of each tensor this SEND / RECV op posts when `rank` runs it."""
        if self.kind is OpKind.SEND:
            return [(rank, q, t) for q, t in zip(self.peers, self.tags)]
        if self.kind is OpKind.RECV:
            return [(q, rank, t) for q, t in zip(self.peers, self.tags)]
        return []

    def __str__(self) -> str:
        outs = ", ".join(self.outs)
        lhs = f"{outs} = " if outs else ""
        k = self.kind
        if k is OpKind.RUN:
            variant = f".{self.arg}" if self.arg else ""
            body = f"{self.graph}{variant}({', '.join(self.ins)})"
        elif k is OpKind.RECV:
            body = "irecv(" + ", ".join(
                f"from {p} tag {t} {list(s.shape)} {str(s.dtype).replace('torch.', '')}"
                for p, t, s in zip(self.peers, self.tags, self.specs))
            body += f" -> buf {self.arg})" if self.arg is not None else ")"
        elif k is OpKind.SEND:
            body = "isend(" + ", ".join(
                f"{v} -> {p} tag {t}" for v, p, t in zip(self.ins, self.peers, self.tags)) + ")"
        elif k is OpKind.STAMP:
            body = f"stamp({self.arg})"
        else:
            extra = f"; {self.arg}" if self.arg is not None else ""
            body = f"{k.value}({', '.join(self.ins)}{extra})"
        tail = f"    # {self.note}" if self.note else ""
        head = f"[{self.action}] " if self.action is not None and k is OpKind.RUN else ""
        return f"{head}{lhs}{body}{tail}"


def value_id(stage: int, microbatch: int, name: str) -> str:
    """The global name of value `name` of (stage, microbatch)."""
    return f"s{stage}.mb{microbatch}.{name}"


def data_id(microbatch: int, index: int) -> str:
    return f"mb{microbatch}.data:{index}"


def split_data_id(vid: str) -> tuple[int, int] | None:
    """Inverse of data_id: (microbatch, index), or None for other values."""
    mb, sep, index = vid.partition(".data:")
    if not (sep and mb.startswith("mb") and mb[2:].isdigit() and index.isdigit()):
        return None
    return int(mb[2:]), int(index)


def python_name(vid: str) -> str:
    """A Python identifier for value id `vid` in generated code (every non-alphanumeric character becomes _)."""
    return "".join(c if c.isalnum() else "_" for c in vid)


def split_value_id(vid: str) -> tuple[int, int, str] | None:
    """Inverse of value_id: (stage, microbatch, name), or None for other values."""
    if not vid.startswith("s"):
        return None
    head, _, rest = vid.partition(".mb")
    mb, _, name = rest.partition(".")
    if not (head[1:].isdigit() and mb.isdigit() and name):
        return None
    return int(head[1:]), int(mb), name


@dataclass(frozen=True)
class RankProgram:
    """One rank's step: program inputs, a straight line of ops, and the returned value.

    inputs: names the runtime passes, in order (after the step context): grad_loss, params, buffers,
    data. output: the value returned (this rank's sum of microbatch losses), or None.
    buffers: the static receive buffers the runtime makes once (RECV ops with a slot in `arg` use them).
    staged_inputs: the runtime copies each step's batch into input buffers it makes once and passes fixed
    microbatch views of them (nothing that may alias a data input outlives the step); False: fresh slices.
    """

    schedule: Schedule
    staged: StagedModel
    rank: int
    inputs: tuple[str, ...]
    ops: tuple[Op, ...]
    output: str | None = None
    recv_lookahead: int = 4          # see passes.lower.RECV_LOOKAHEAD
    buffers: tuple[TensorSpec, ...] = ()
    staged_inputs: bool = False
    passes: tuple[str, ...] = ()     # names of the passes applied so far

    def replace(self, **changes) -> RankProgram:
        return replace(self, **changes)

    # ---- queries ----------------------------------------------------------------------------
    def of_kind(self, *kinds: OpKind) -> list[Op]:
        return [op for op in self.ops if op.kind in kinds]

    def run_ops(self) -> list[Op]:
        return self.of_kind(OpKind.RUN)

    def defined(self) -> set[str]:
        return set(self.inputs) | {v for op in self.ops for v in op.outs}

    def used(self) -> set[str]:
        used = {v for op in self.ops for v in op.ins}
        return used | ({self.output} if self.output else set())

    # ---- checks -----------------------------------------------------------------------------
    def check(self, stage: str = "") -> RankProgram:
        """Every value is defined once, before its uses, and not used after it is freed."""
        live: set[str] = set(self.inputs)
        freed: dict[str, int] = {}
        remote_ok = "insert_p2p" not in self.passes
        for i, op in enumerate(self.ops):
            for v in op.ins:
                if v in freed:
                    raise LoweringError(self._where(i, f"uses {v!r}, freed at op {freed[v]}", stage))
                if v not in live and not (remote_ok and self._is_remote(v)):
                    raise LoweringError(self._where(i, f"uses {v!r} before it is defined", stage))
            if op.kind is OpKind.FREE:
                freed.update((v, i) for v in op.ins)
            for v in op.outs:
                if v in live:
                    raise LoweringError(self._where(i, f"defines {v!r} a second time", stage))
                live.add(v)
        if self.output and self.output not in live:
            raise LoweringError(f"rank {self.rank}: the program returns {self.output!r}, which is never defined")
        return self

    def _is_remote(self, vid: str) -> bool:
        parts = split_value_id(vid)
        return parts is not None and self.schedule.placement[parts[0]] != self.rank

    def _where(self, index: int, what: str, stage: str) -> str:
        after = f" after pass {stage}" if stage else ""
        return f"rank {self.rank}{after}, op {index} ({self.ops[index]}): {what}\n{self.to_text(mark=index)}"

    # ---- text -------------------------------------------------------------------------------
    def to_text(self, mark: int | None = None, window: int = 12, width: int | None = None) -> str:
        """One op per line; `mark` shows a window around op `mark` with lines cut to 160 characters."""
        lo, hi = 0, len(self.ops)
        if mark is not None:
            lo, hi = max(0, mark - window), min(len(self.ops), mark + window + 1)
            width = width or 160
        head = f"# rank {self.rank} of {self.schedule.name}: inputs {len(self.inputs)}, ops {len(self.ops)}"
        if self.buffers:
            head += f", static receive buffers {len(self.buffers)} ({_mib(self.buffers):.2f} MiB)"
        if self.staged_inputs:
            head += ", batch staged in static input buffers"
        lines = [head] + [_cut(f"{'>>' if i == mark else '  '} {i:4d}  {self.ops[i]}", width) for i in range(lo, hi)]
        lines.append(f"     return {self.output}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_text()


def _cut(line: str, width: int | None) -> str:
    return line if width is None or len(line) <= width else line[:width - 3] + "..."


def first_use(ops: Iterable[Op], value: str) -> int | None:
    for i, op in enumerate(ops):
        if value in op.ins:
            return i
    return None


def _mib(specs: Iterable[TensorSpec]) -> float:
    return sum(s.nbytes for s in specs) / 2**20
