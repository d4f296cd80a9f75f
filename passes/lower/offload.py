"""insert_offload: move the device storages F saves for the backward to a host pool after F, and back before
the B / W that reads them (PipeOffload's mechanics, as ops of the rank program).

Offload works by storage, not by tensor: what F saves is mostly views (q, k and v of one qkv matmul, a
`view` or `transpose` of a result, the same tensor also sent as the activation), and a view cannot leave the
device unless its whole storage does. One offloaded storage of 0F0 holding three saved views, read first by
0B0 (prefetch=1: the reload is issued one RUN op earlier):

    [0F0] s0.mb0.act:h, s0.mb0.saved:q, s0.mb0.saved:k, s0.mb0.saved:v = stage0_f(...)
    stamp(1)
    h:off.s0.mb0.saved:q = offload(s0.mb0.saved:q, s0.mb0.saved:k, s0.mb0.saved:v -> host 0 [3072] uint8)
    free(s0.mb0.saved:q, s0.mb0.saved:k, s0.mb0.saved:v)    # the handle holds the storage until wait_offload
    ...
    wait_offload(h:off.s0.mb0.saved:q)        # before the next RUN op: the device storage may go here
    stamp(2)
    [0F1] ...
    h:re.s0.mb0.saved:q = reload(host 0 [3072] uint8)        # a fresh device storage of 3072 bytes
    stamp(4)
    [1F0] ...
    re.s0.mb0.saved:q, re.s0.mb0.saved:k, re.s0.mb0.saved:v = wait_reload(h:re.s0.mb0.saved:q;
        [1, 2, 8, 16] float32 stride (768, 16, 96, 1) at 0, ... at 32, ... at 64)   # the views, as traced
    stamp(6)
    [0B0] ... = stage0_b(re.s0.mb0.saved:q, ...)
    free(re.s0.mb0.saved:q, ...)    # the FREE that freed the originals now frees the reloaded views

What may go (`offload_candidates`): per F, its saved outputs grouped by the storage they view (the FakeTensor
storages of the F graph's outputs). A group may go when the storage is fresh memory of the F graph (no graph
input, parameter or constant, by the alias roots of aliases.py too), at least `min_bytes` large, every saved
view in it is read afterwards only by RUN ops of the same stage and microbatch (its B, W or BW), and any other
output of F on the storage (the `act:` output sent to the next rank) is read by no RUN op at all: it keeps the
original device storage, which then lives until both its send and the offload are waited for (the memory plan
sees it through the aliases of OFFLOAD's handle). A storage the next RUN op already reads stays: it would be
reloaded before it ever left. The reloaded views get new names (`re.` + the original's, values.py); every
later reader reads those.

Host slots (`RankProgram.host_buffers`) are flat bytes, one storage each, coloured like the static receive
buffers (buffers.py): a slot is busy from its OFFLOAD to the WAIT_RELOAD of its reload, and a free slot of the
identical type (byte count) is reused, first fit in offload order, which is an optimal colouring of intervals.

The pass runs after FINISHING (lower_all's `offload=`): it only inserts ops and renames readers of the values
it offloads, none of which is a received tensor or may alias one (they alias no graph input), so the static
receive buffers' intervals keep their order and their colouring stays valid.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import fx

from zbcompile._torch_private import StorageWeakRef
from zbcompile.errors import LoweringError, UsageError
from zbcompile.passes.analysis.aliases import node_roots
from zbcompile.program import RankProgram
from zbcompile.program.ops import HostArgs, Op, OpKind, TensorType, View, ViewArgs
from zbcompile.program.values import Role, handle, reloaded_value, role_of
from zbcompile.schedule import Action, Kind

__all__ = ["Candidate", "OffloadChoice", "offload_candidates", "insert_offload", "assign_host_slots",
           "DEFAULT_MIN_BYTES"]

# Below this a copy's fixed cost (a launch, an event) outweighs the memory it frees.
DEFAULT_MIN_BYTES = 4096

_BACKWARD = frozenset({Kind.B, Kind.W, Kind.BW})


class Candidate(NamedTuple):
    """One storage of one F that may be offloaded: `value`, the first of its saved views (global names, in
    output order, `values`), the host slot's `type` (the storage as flat bytes), its size, the op indices of
    its F and of the first op that reads any of its views afterwards, and each view's layout on the storage."""

    value: str
    type: TensorType
    nbytes: int
    f_index: int
    reader_index: int
    values: tuple[str, ...]
    views: tuple[View, ...]


@dataclass(frozen=True)
class OffloadChoice:
    """What to offload on one rank. units: the (stage, microbatch) pairs whose F's saved storages go, None for
    every F. prefetch: how many RUN ops before the first reader the reload is issued (0: right before it).
    min_bytes: smaller storages stay on the device. wait_after: how many RUN ops after F the offload is waited
    for (0: before the next RUN op; 1: after it, so that on a GPU the copy overlaps that action, and the device
    storage goes one action later)."""

    units: frozenset[tuple[int, int]] | None = None
    prefetch: int = 1
    min_bytes: int = DEFAULT_MIN_BYTES
    wait_after: int = 0

    def __post_init__(self) -> None:
        if self.prefetch < 0 or self.min_bytes < 0 or self.wait_after < 0:
            raise UsageError(f"OffloadChoice(prefetch={self.prefetch}, min_bytes={self.min_bytes}, wait_after="
                             f"{self.wait_after}): each must be >= 0 (prefetch and wait_after count RUN ops: "
                             f"0 reloads right before the reader, and waits for the offload before the next RUN)")


def offload_candidates(program: RankProgram, min_bytes: int = DEFAULT_MIN_BYTES
                       ) -> dict[tuple[int, int], tuple[Candidate, ...]]:
    """(stage, microbatch) of every F on this rank -> the storages of that F that may be offloaded (see the
    module docstring), in output order of their first saved view; empty where none may."""
    readers = _readers(program)
    groups: dict[str, tuple[_Group, ...]] = {}
    out: dict[tuple[int, int], tuple[Candidate, ...]] = {}
    for i, op in enumerate(program.ops):
        f = op.action
        if f is None or f.kind is not Kind.F:
            continue
        key = op.args.graph
        if key not in groups:
            groups[key] = _storage_groups(program, key)
        found = []
        for g in groups[key]:
            first = _first_reader(program, readers, op, g) if g.type.nbytes >= min_bytes else None
            if first is not None:
                values = tuple(op.outs[k] for k in g.saved)
                found.append(Candidate(values[0], g.type, g.type.nbytes, i, first, values, g.views))
        out[(f.stage, f.microbatch)] = tuple(found)
    return out


def insert_offload(program: RankProgram, choice: OffloadChoice = OffloadChoice()) -> RankProgram:
    """`program` with the chosen F's candidate storages offloaded after F and reloaded before their first reader
    (see the module docstring); host slots assigned by assign_host_slots. Pure: returns a new program."""
    runs = [i for i, op in enumerate(program.ops) if op.kind is OpKind.RUN]
    position = {i: k for k, i in enumerate(runs)}
    plans = []
    for unit, candidates in offload_candidates(program, choice.min_bytes).items():
        if choice.units is None or unit in choice.units:
            plans += [p for c in candidates if (p := _plan(program, runs, position, c, choice)) is not None]
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
class _Group(NamedTuple):
    """One storage an F graph returns views of: the positions of its saved outputs and their layouts, the
    positions of its other outputs (`act:` and the like), and the host slot type (the storage's bytes)."""

    saved: tuple[int, ...]
    views: tuple[View, ...]
    others: tuple[int, ...]
    type: TensorType


def _storage_groups(program: RankProgram, key: str) -> tuple[_Group, ...]:
    """The storages of F graph `key`'s outputs that hold a saved output and may be copied out and back whole
    (fresh memory of the graph with static sizes), in output order of their first saved output."""
    graph = program.graphs[key]
    if graph.gm is None:
        raise LoweringError(f"rank {program.rank}: offload needs the F graphs' GraphModules (their outputs' "
                            f"storages and aliasing), but graph {key!r} has none; read the program with "
                            f"RankProgram.from_text(text, graphs=...)")
    gm = graph.gm
    output = next(iter(gm.graph.find_nodes(op="output")))
    nodes = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    by_storage: dict[StorageWeakRef, list[int]] = {}
    for k, node in enumerate(nodes):
        val = node.meta.get("val") if isinstance(node, fx.Node) else None
        if isinstance(val, torch.Tensor):
            by_storage.setdefault(StorageWeakRef(val.untyped_storage()), []).append(k)
    roots = _output_roots(gm, nodes)
    shared = _roots_in_several(roots, by_storage.values())
    groups = []
    for positions in by_storage.values():
        saved = tuple(k for k in positions if role_of(graph.outputs[k]) is Role.SAVED)
        if saved and all(roots[k] and roots[k].isdisjoint(shared) for k in positions):
            group = _group(nodes, saved, tuple(k for k in positions if k not in saved))
            if group is not None:
                groups.append(group)
    return tuple(sorted(groups, key=lambda g: g.saved[0]))


def _output_roots(gm: fx.GraphModule, nodes) -> list[frozenset]:
    """Per output, its fresh alias roots (aliases.node_roots), or an empty set where it may alias memory the
    graph did not allocate: a graph input (a parameter, the batch) or a constant (get_attr)."""
    roots = node_roots(gm)
    constants = {n.name for n in gm.graph.find_nodes(op="get_attr")}
    out = []
    for node in nodes:
        mine = roots.get(node, frozenset()) if isinstance(node, fx.Node) else frozenset()
        own = not any(isinstance(r, int) or r in constants for r in mine)
        out.append(mine if own else frozenset())
    return out


def _roots_in_several(roots: list[frozenset], storages) -> frozenset:
    """Alias roots that outputs on different traced storages share: the op schemas say they may be one memory
    where the trace made two (an op the schemas cannot see through), so neither storage is copied alone."""
    seen: dict = {}
    for n, positions in enumerate(storages):
        for k in positions:
            for r in roots[k]:
                seen.setdefault(r, set()).add(n)
    return frozenset(r for r, where in seen.items() if len(where) > 1)


def _group(nodes, saved: tuple[int, ...], others: tuple[int, ...]) -> _Group | None:
    """The group of storage views `saved`, or None where a size is symbolic (a slot needs a static size) or a
    view's dtype does not tile the storage's bytes (the runtime reads the bytes back as that dtype)."""
    vals = [nodes[k].meta["val"] for k in saved]
    nbytes = vals[0].untyped_storage().nbytes()
    views = tuple(View(TensorType(tuple(v.shape), v.dtype, tuple(v.stride())), v.storage_offset()) for v in vals)
    static = [nbytes] + [v.offset for v in views] + [d for v in views for d in v.type.shape + v.type.stride]
    if not all(isinstance(d, int) for d in static) or nbytes == 0:
        return None
    if any(nbytes % v.type.dtype.itemsize for v in views):
        return None
    return _Group(saved, views, others, TensorType((nbytes,), torch.uint8))


def _first_reader(program: RankProgram, readers: dict[str, list[int]], f_op: Op, g: _Group) -> int | None:
    """The first op reading any saved view of `g` after its F, if the group may go: the saved views are read
    (FREE aside) only by the backward of F's unit, and F's other outputs on the storage by no RUN op."""
    f = f_op.action
    later = [j for k in g.saved for j in readers.get(f_op.outs[k], ()) if program.ops[j].kind is not OpKind.FREE]
    if not later or not all(_is_backward_of(program.ops[j], f) for j in later):
        return None
    if any(program.ops[j].kind is OpKind.RUN for k in g.others for j in readers.get(f_op.outs[k], ())):
        return None
    return min(later)


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
    """Where one candidate's four ops go: after op `offload_after`, and before the RUN ops at `wait_before`,
    `reload_before` and `reader` (indices into program.ops)."""

    candidate: Candidate
    offload_after: int
    wait_before: int
    reload_before: int
    reader: int


def _plan(program: RankProgram, runs: list[int], position: dict[int, int], c: Candidate,
          choice: OffloadChoice) -> _Plan | None:
    """None when the first reader is the next RUN op after F: the reload would be issued before the device
    storage was ever gone (no memory gained). The offload is waited for before the RUN op `wait_after` places
    after F's next one, but before the RUN op ahead of the reader at the latest; the reload is issued
    `prefetch` RUN ops before the reader, but no earlier than the RUN op after that wait, so that the storage
    is off the device during at least one RUN."""
    a, b = position[c.f_index], position[c.reader_index]
    if b < a + 2:
        return None
    wait = min(a + 1 + choice.wait_after, b - 1)
    return _Plan(c, _after_run(program.ops, c.f_index), runs[wait], runs[max(b - choice.prefetch, wait + 1)],
                 c.reader_index)


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
        c, why = p.candidate, f"for {ops[p.reader].action}"
        off, re = handle(f"off.{c.value}"), handle(f"re.{c.value}")
        new = tuple(reloaded_value(v) for v in c.values)
        renamed.update(zip(c.values, new))
        after.setdefault(p.offload_after, []).append(Op(OpKind.OFFLOAD, c.values, (off,), HostArgs(k, c.type), why))
        offloaded.setdefault(p.offload_after, []).extend(c.values)
        _at(before, _before_run(ops, p.wait_before))[0].append(Op(OpKind.WAIT_OFFLOAD, (off,)))
        _at(before, _before_run(ops, p.reload_before))[1].append(Op(OpKind.RELOAD, (), (re,), HostArgs(k, c.type), why))
        _at(before, _before_run(ops, p.reader))[2].append(Op(OpKind.WAIT_RELOAD, (re,), new, ViewArgs(c.views)))
    out: list[Op] = []
    for i, op in enumerate(ops):
        for group in before.get(i, ()):
            out += group
        out.append(_rename(op, renamed))   # only the backward and its FREE read them
        if i in after:
            out += after[i]
            out.append(Op(OpKind.FREE, tuple(offloaded[i]), note="offloaded: each handle holds its storage "
                                                                  "until wait_offload"))
    return tuple(out)


def _at(before: dict, i: int) -> tuple[list[Op], list[Op], list[Op]]:
    return before.setdefault(i, ([], [], []))


def _rename(op: Op, renamed: dict[str, str]) -> Op:
    """Later readers (the backward and the FREE after it) read the reloaded value."""
    if renamed.keys().isdisjoint(op.ins):
        return op
    return op._replace(ins=tuple(renamed.get(v, v) for v in op.ins))


def _host_intervals(program: RankProgram) -> list[tuple[int, int, int]]:
    """(OFFLOAD index, its RELOAD's index, that reload's WAIT_RELOAD index) for every offloaded storage."""
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
