"""insert_offload: move what F saves for the backward to a host pool after F, and back before the B / W that
reads it (PipeOffload's mechanics, as ops of the rank program).

One offloaded saved tensor of 0F0, read first by 0B0 (prefetch=1: the reload is issued one RUN op earlier):

    [0F0] s0.mb0.act:h, s0.mb0.saved:3 = stage0_f(...)
    stamp(1)
    h:off.s0.mb0.saved:3 = offload(s0.mb0.saved:3 -> host 0 [4, 8] float32 stride (8, 1))
    free(s0.mb0.saved:3)    # the handle holds the tensor until wait_offload
    ...
    wait_offload(h:off.s0.mb0.saved:3)        # before the next RUN op: the device tensor goes here
    stamp(2)
    [0F1] ...
    h:re.s0.mb0.saved:3 = reload(host 0 [4, 8] float32 stride (8, 1))
    stamp(4)
    [1F0] ...
    re.s0.mb0.saved:3 = wait_reload(h:re.s0.mb0.saved:3)
    stamp(6)
    [0B0] ... = stage0_b(re.s0.mb0.saved:3, ...)
    free(re.s0.mb0.saved:3)    # the FREE that freed the original now frees the reloaded tensor

What may go (`offload_candidates`): a saved output of an F that is fresh memory of its own (no view of a graph
input or a parameter, no memory shared with another output: copying it back would split what the backward
expects to be one storage), laid out densely, at least `min_bytes` large, and read afterwards only by RUN ops
of the same stage and microbatch (its B, W or BW). A tensor the next RUN op already reads stays: it would be
reloaded before it ever left. The reloaded value gets a new name (`re.` + the original's, values.py); every
later reader reads that name.

Host slots (`RankProgram.host_buffers`) are coloured like the static receive buffers (buffers.py): a slot is
busy from its OFFLOAD to the WAIT_RELOAD of its reload, and a free slot of the identical type (shape, dtype,
stride) is reused, first fit in offload order, which is an optimal colouring of intervals.

The pass runs after FINISHING (lower_all's `offload=`): it only inserts ops and renames readers of the values
it offloads, none of which is a received tensor or may alias one (they alias no graph input), so the static
receive buffers' intervals keep their order and their colouring stays valid.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import fx

from zbcompile.errors import LoweringError, UsageError
from zbcompile.passes.analysis.aliases import graph_output_owned, view_base
from zbcompile.program import RankProgram
from zbcompile.program.ops import HostArgs, Op, OpKind, TensorType
from zbcompile.program.values import Role, handle, reloaded_value, role_of
from zbcompile.schedule import Action, Kind

__all__ = ["Candidate", "OffloadChoice", "offload_candidates", "insert_offload", "assign_host_slots",
           "DEFAULT_MIN_BYTES"]

# Below this a copy's fixed cost (a launch, an event) outweighs the memory it frees.
DEFAULT_MIN_BYTES = 4096

_BACKWARD = frozenset({Kind.B, Kind.W, Kind.BW})


class Candidate(NamedTuple):
    """A saved output of one F that may be offloaded: its global name, type (with stride), size, and the op
    indices of its F and of the first op that reads it afterwards."""

    value: str
    type: TensorType
    nbytes: int
    f_index: int
    reader_index: int


@dataclass(frozen=True)
class OffloadChoice:
    """What to offload on one rank. units: the (stage, microbatch) pairs whose F's saved tensors go, None for
    every F. prefetch: how many RUN ops before the first reader the reload is issued (0: right before it).
    min_bytes: smaller tensors stay on the device."""

    units: frozenset[tuple[int, int]] | None = None
    prefetch: int = 1
    min_bytes: int = DEFAULT_MIN_BYTES

    def __post_init__(self) -> None:
        if self.prefetch < 0 or self.min_bytes < 0:
            raise UsageError(f"OffloadChoice(prefetch={self.prefetch}, min_bytes={self.min_bytes}): both must be "
                             f">= 0 (prefetch counts RUN ops before the reader; 0 reloads right before it)")


def offload_candidates(program: RankProgram, min_bytes: int = DEFAULT_MIN_BYTES
                       ) -> dict[tuple[int, int], tuple[Candidate, ...]]:
    """(stage, microbatch) of every F on this rank -> the saved outputs of that F that may be offloaded (see the
    module docstring), in output order; empty where none may."""
    readers = _readers(program)
    layouts: dict[str, tuple[TensorType | None, ...]] = {}
    out: dict[tuple[int, int], tuple[Candidate, ...]] = {}
    for i, op in enumerate(program.ops):
        f = op.action
        if f is None or f.kind is not Kind.F:
            continue
        key = op.args.graph
        if key not in layouts:
            layouts[key] = _offloadable_outputs(program, key)
        found = []
        for value, local, t in zip(op.outs, program.graph(op).outputs, layouts[key]):
            if t is None or role_of(local) is not Role.SAVED or t.nbytes < min_bytes:
                continue
            later = [j for j in readers.get(value, ()) if program.ops[j].kind is not OpKind.FREE]
            if later and all(_is_backward_of(program.ops[j], f) for j in later):
                found.append(Candidate(value, t, t.nbytes, i, later[0]))
        out[(f.stage, f.microbatch)] = tuple(found)
    return out


def insert_offload(program: RankProgram, choice: OffloadChoice = OffloadChoice()) -> RankProgram:
    """`program` with the chosen F's candidates offloaded after F and reloaded before their first reader (see the
    module docstring); host slots assigned by assign_host_slots. Pure: returns a new program."""
    runs = [i for i, op in enumerate(program.ops) if op.kind is OpKind.RUN]
    position = {i: k for k, i in enumerate(runs)}
    plans = []
    for unit, candidates in offload_candidates(program, choice.min_bytes).items():
        if choice.units is None or unit in choice.units:
            plans += [p for c in candidates if (p := _plan(program, runs, position, c, choice.prefetch)) is not None]
    if not plans:
        return program
    return assign_host_slots(program.replace(ops=_rewrite(program, plans)))


def assign_host_slots(program: RankProgram) -> RankProgram:
    """Colour the host slots of every OFFLOAD / RELOAD pair: a slot is busy from the OFFLOAD to the WAIT_RELOAD
    that takes its reload back; a free slot of the identical type is reused (first fit in offload order, optimal
    for intervals). Pairs are read off the slot numbers the ops carry (each OFFLOAD with the next RELOAD of its
    slot), so any consistent numbering, such as one slot per offload, is a valid input."""
    ops = list(program.ops)
    intervals = _host_intervals(program)
    slots: list[TensorType] = []
    busy_until: list[int] = []
    for start, reload, end in sorted(intervals):
        t = ops[start].args.type
        k = next((k for k, s in enumerate(slots) if s == t and busy_until[k] < start), None)
        if k is None:
            k = len(slots)
            slots.append(t)
            busy_until.append(0)
        busy_until[k] = end
        for i in (start, reload):
            ops[i] = ops[i]._replace(args=HostArgs(k, t))
    return program.replace(ops=tuple(ops), host_buffers=tuple(slots))


# ---- candidates --------------------------------------------------------------------------------------
def _offloadable_outputs(program: RankProgram, key: str) -> tuple[TensorType | None, ...]:
    """Per output of F graph `key`, its type (shape, dtype, stride) if it may be offloaded, else None: fresh
    memory no input or other output shares, not a constant of the graph, dense, with static sizes."""
    graph = program.graphs[key]
    if graph.gm is None:
        raise LoweringError(f"rank {program.rank}: offload needs the F graphs' GraphModules (their outputs' sizes "
                            f"and aliasing), but graph {key!r} has none; read the program with "
                            f"RankProgram.from_text(text, graphs=...)")
    output = next(iter(graph.gm.graph.find_nodes(op="output")))
    nodes = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    owned = graph_output_owned(graph.gm)
    return tuple(_layout(node) if own else None for node, own in zip(nodes, owned))


def _layout(node) -> TensorType | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if not isinstance(val, torch.Tensor) or view_base(node).op == "get_attr":
        return None
    shape, stride = tuple(val.shape), tuple(val.stride())
    if not all(isinstance(d, int) for d in shape + stride) or not _dense(shape, stride):
        return None   # a symbolic size has no slot size; a gap or an overlap would not copy back as it was
    return TensorType(shape, val.dtype, stride)


def _dense(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """The elements fill a block of memory exactly once (some permutation of a contiguous layout)."""
    expected = 1
    for step, size in sorted((s, d) for d, s in zip(shape, stride) if d != 1):   # innermost first
        if step != expected:
            return False
        expected *= size
    return True


def _is_backward_of(op: Op, f: Action) -> bool:
    a = op.action
    return a is not None and a.kind in _BACKWARD and (a.stage, a.microbatch) == (f.stage, f.microbatch)


def _readers(program: RankProgram) -> dict[str, list[int]]:
    readers: dict[str, list[int]] = {}
    for i, op in enumerate(program.ops):
        for v in op.ins:
            readers.setdefault(v, []).append(i)
    return readers


# ---- placing the ops ------------------------------------------------------------------------------------
class _Plan(NamedTuple):
    """Where one candidate's four ops go: after op `offload_after`, and before the RUN ops at `wait_before`
    (the next RUN after F), `reload_before` and `reader` (indices into program.ops)."""

    candidate: Candidate
    offload_after: int
    wait_before: int
    reload_before: int
    reader: int


def _plan(program: RankProgram, runs: list[int], position: dict[int, int], c: Candidate,
          prefetch: int) -> _Plan | None:
    """None when the first reader is the next RUN op after F: the reload would be issued before the device
    tensor was ever gone (no memory gained). The reload is issued `prefetch` RUN ops before the reader, but no
    earlier than the second RUN after F, so that the tensor is off the device during at least one RUN."""
    a, b = position[c.f_index], position[c.reader_index]
    if b < a + 2:
        return None
    return _Plan(c, _after_run(program.ops, c.f_index), runs[a + 1], runs[max(b - prefetch, a + 2)], c.reader_index)


def _after_run(ops: tuple[Op, ...], i: int) -> int:
    """The last op of RUN op i's own tail: its end stamp, then the frees of what it read last."""
    if i + 1 < len(ops) and ops[i + 1].kind is OpKind.STAMP:
        i += 1
    while i + 1 < len(ops) and ops[i + 1].kind is OpKind.FREE:
        i += 1
    return i


def _before_run(ops: tuple[Op, ...], i: int) -> int:
    """Where ops that must come before RUN op i go: before its start stamp, so that waits are not timed as
    part of its action."""
    return i - 1 if i > 0 and ops[i - 1].kind is OpKind.STAMP else i


def _rewrite(program: RankProgram, plans: list[_Plan]) -> tuple[Op, ...]:
    ops = program.ops
    after: dict[int, list[Op]] = {}
    offloaded: dict[int, list[str]] = {}
    # before an op: waits for offloads first (memory back), then reloads, then waits for reloads (a reload
    # with prefetch=0 comes right before its own wait)
    before: dict[int, tuple[list[Op], list[Op], list[Op]]] = {}
    renamed: dict[str, str] = {}
    # one provisional slot per new offload, above the slots earlier offloads use; assign_host_slots colours all
    for k, p in enumerate(plans, start=len(program.host_buffers)):
        v, t = p.candidate.value, p.candidate.type
        new, off, re = reloaded_value(v), handle(f"off.{v}"), handle(f"re.{v}")
        renamed[v] = new
        after.setdefault(p.offload_after, []).append(
            Op(OpKind.OFFLOAD, (v,), (off,), HostArgs(k, t), note=f"for {ops[p.reader].action}"))
        offloaded.setdefault(p.offload_after, []).append(v)
        _at(before, _before_run(ops, p.wait_before))[0].append(Op(OpKind.WAIT_OFFLOAD, (off,)))
        _at(before, _before_run(ops, p.reload_before))[1].append(
            Op(OpKind.RELOAD, (), (re,), HostArgs(k, t), note=f"for {ops[p.reader].action}"))
        _at(before, _before_run(ops, p.reader))[2].append(Op(OpKind.WAIT_RELOAD, (re,), (new,)))
    out: list[Op] = []
    for i, op in enumerate(ops):
        for group in before.get(i, ()):
            out += group
        out.append(_rename(op, renamed))   # only the backward and its FREE read them
        if i in after:
            out += after[i]
            out.append(Op(OpKind.FREE, tuple(offloaded[i]), note="offloaded: each handle holds its tensor until "
                                                                  "wait_offload"))
    return tuple(out)


def _at(before: dict, i: int) -> tuple[list[Op], list[Op], list[Op]]:
    return before.setdefault(i, ([], [], []))


def _rename(op: Op, renamed: dict[str, str]) -> Op:
    """Later readers (the backward and the FREE after it) read the reloaded value."""
    if renamed.keys().isdisjoint(op.ins):
        return op
    return op._replace(ins=tuple(renamed.get(v, v) for v in op.ins))


def _host_intervals(program: RankProgram) -> list[tuple[int, int, int]]:
    """(OFFLOAD index, its RELOAD's index, that reload's WAIT_RELOAD index) for every offloaded tensor."""
    waits = {op.ins[0]: i for i, op in enumerate(program.ops) if op.kind is OpKind.WAIT_RELOAD}
    pending: dict[int, int] = {}
    out = []
    for i, op in enumerate(program.ops):
        if op.kind is OpKind.OFFLOAD:
            if op.args.slot in pending:
                raise LoweringError(_slot_error(program, i, "is offloaded into again before it was reloaded"))
            pending[op.args.slot] = i
        elif op.kind is OpKind.RELOAD:
            start = pending.pop(op.args.slot, None)
            if start is None:
                raise LoweringError(_slot_error(program, i, "is reloaded but nothing was offloaded into it"))
            if op.outs[0] not in waits or program.ops[start].args.type != op.args.type:
                raise LoweringError(_slot_error(program, i, "is reloaded with another type than it was offloaded "
                                                            "with, or the reload is never waited for"))
            out.append((start, i, waits[op.outs[0]]))
    if pending:
        raise LoweringError(_slot_error(program, min(pending.values()), "is offloaded and never reloaded"))
    return out


def _slot_error(program: RankProgram, i: int, what: str) -> str:
    return (f"rank {program.rank}, op {i} ({program.ops[i]}): host slot {program.ops[i].args.slot} {what}; every "
            f"OFFLOAD needs one RELOAD of its slot and a WAIT_RELOAD of that, in this order (insert_offload makes "
            f"them)\n{program.to_text(mark=i, window=4)}")
