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

B -> W (`OffloadChoice.after_b`, on by default): in the zero-bubble schedules W runs long after B, and between
them the device holds what only W still reads: B's `wsaved:` outputs (the output gradients of the linears),
grouped by storage as F's saved outputs are, and F's saved storages W reads (reloaded for B, or never
offloaded). A second round, on the program the first one made, moves those after B and back before W, by
the same rules and placement (wait_after, prefetch counted from B and W); a storage reloaded for B goes
under its reloaded name and comes back as `re.re.` + the original's:

    [0B0] s0.mb0.wsaved:g = stage0_b(re.s0.mb0.saved:q, ...)     # B still reads the first reload
    free(re.s0.mb0.saved:k)                                      # read by B only: it is not copied out
    h:off.s0.mb0.wsaved:g = offload(s0.mb0.wsaved:g -> host 1 [2048] uint8)    # for 0W0
    h:off.re.s0.mb0.saved:q = offload(re.s0.mb0.saved:q -> host 0 [3072] uint8)    # for 0W0
    ...
    re.re.s0.mb0.saved:q = wait_reload(h:re.re.s0.mb0.saved:q; [1, 2, 8, 16] float32 stride ... at 0)
    [0W0] ... = stage0_w(re.re.s0.mb0.saved:q, re.s0.mb0.wsaved:g, ...)

Only the views W reads go (the rest of the storage's views are dead by then), and anything else on the
storage must be dead once B's FREE ops ran: a pending send of B's `grad:act` would keep the original beside
the reloaded copy. So every storage is off the device for a while inside the span it lived in anyway, and the
planned peak never grows.

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
from zbcompile.ir.program import RankProgram
from zbcompile.ir.program.ops import HostArgs, Op, OpKind, TensorType, View, ViewArgs
from zbcompile.ir.program.values import Role, handle, reloaded_value, role_of
from zbcompile.ir.schedule import Action, Kind

__all__ = ["Candidate", "OffloadChoice", "offload_candidates", "b_candidates", "insert_offload",
           "assign_host_slots", "DEFAULT_MIN_BYTES"]

# Below this a copy's fixed cost (a launch, an event) outweighs the memory it frees.
DEFAULT_MIN_BYTES = 4096

_BACKWARD = frozenset({Kind.B, Kind.W, Kind.BW})


class Candidate(NamedTuple):
    """One storage that may be offloaded after the action at `f_index` (its F, or with `after` Kind.B its B):
    `value`, the first of its views that go (global names, in output order, `values`), the host slot's `type`
    (the storage as flat bytes), its size, the op indices of that action and of the first op that reads any
    of the views afterwards (the backward; for `after` Kind.B the unit's W), and each view's layout on the
    storage."""

    value: str
    type: TensorType
    nbytes: int
    f_index: int
    reader_index: int
    values: tuple[str, ...]
    views: tuple[View, ...]
    after: Kind = Kind.F


@dataclass(frozen=True)
class OffloadChoice:
    """What to offload on one rank. units: the (stage, microbatch) pairs whose F's saved storages go, None for
    every F. prefetch: how many RUN ops before the first reader the reload is issued (0: right before it).
    min_bytes: smaller storages stay on the device. wait_after: how many RUN ops after F the offload is waited
    for (0: before the next RUN op; 1: after it, so that on a GPU the copy overlaps that action, and the device
    storage goes one action later). after_b: the chosen units also offload, after their B, what their W alone
    still reads (B's `wsaved:` storages and F's saved storages W reads), reloaded before W; never worse for the
    planned peak, since each storage is only absent for a while from where it lived anyway."""

    units: frozenset[tuple[int, int]] | None = None
    prefetch: int = 1
    min_bytes: int = DEFAULT_MIN_BYTES
    wait_after: int = 0
    after_b: bool = True

    def __post_init__(self) -> None:
        if self.prefetch < 0 or self.min_bytes < 0 or self.wait_after < 0:
            raise UsageError(f"OffloadChoice(prefetch={self.prefetch}, min_bytes={self.min_bytes}, wait_after="
                             f"{self.wait_after}): each must be >= 0 (prefetch and wait_after count RUN ops: "
                             f"0 reloads right before the reader, and waits for the offload before the next RUN)")


def offload_candidates(program: RankProgram, min_bytes: int = DEFAULT_MIN_BYTES, after_b: bool = False
                       ) -> dict[tuple[int, int], tuple[Candidate, ...]]:
    """(stage, microbatch) of every F on this rank -> the storages of that F that may be offloaded (see the
    module docstring), in output order of their first saved view; empty where none may. after_b: each unit's
    tuple goes on with the storages that may go after its B (`after` Kind.B, `b_candidates`)."""
    out = _f_candidates(program, min_bytes)
    if after_b:
        for unit, found in b_candidates(program, min_bytes).items():
            out[unit] = out.get(unit, ()) + found
    return out


def _f_candidates(program: RankProgram, min_bytes: int) -> dict[tuple[int, int], tuple[Candidate, ...]]:
    readers = program.readers()
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


def insert_offload(program: RankProgram, choice: OffloadChoice = OffloadChoice(),
                   candidates: dict[tuple[int, int], tuple[Candidate, ...]] | None = None) -> RankProgram:
    """`program` with the chosen F's candidate storages offloaded after F and reloaded before their first reader
    and, with choice.after_b, then the chosen units' B -> W candidates (b_candidates, found on the program
    with the first phase in place, so a storage reloaded for B goes again) offloaded after B and reloaded
    before W (see the module docstring); host slots assigned by assign_host_slots. `candidates`:
    `offload_candidates(program, choice.min_bytes)` where the caller holds them already (the offload planner
    tries many choices on one program; finding them is most of the cost of a try). Pure: returns a new
    program."""
    found = _f_candidates(program, choice.min_bytes) if candidates is None else candidates
    out = _insert(program, found, choice)
    if choice.after_b:
        out = _insert(out, b_candidates(out, choice.min_bytes), choice)
    return out


def _insert(program: RankProgram, candidates: dict[tuple[int, int], tuple[Candidate, ...]],
            choice: OffloadChoice) -> RankProgram:
    runs = [i for i, op in enumerate(program.ops) if op.kind is OpKind.RUN]
    position = {i: k for k, i in enumerate(runs)}
    plans = []
    for unit, found in candidates.items():
        if choice.units is None or unit in choice.units:
            plans += [p for c in found if (p := _plan(program, runs, position, c, choice)) is not None]
    if not plans:
        return program
    return assign_host_slots(program.replace(ops=_rewrite(program, plans)))


def b_candidates(program: RankProgram, min_bytes: int = DEFAULT_MIN_BYTES
                 ) -> dict[tuple[int, int], tuple[Candidate, ...]]:
    """(stage, microbatch) of every B on this rank with a W -> the storages that may go after B and come back
    before W (`after` Kind.B, reader_index W's): B's `wsaved:` outputs by storage (the rules F's saved
    storages follow), then F's saved storages W still reads, under their current names (`re.V` where the
    program already reloads them for B), with only the views still read after B. Such a storage may go when
    it is defined by B or before it and at least `min_bytes`, its views are read after B (FREE aside) only by
    W, and whatever else is on it is dead when B's FREE ops are done (a live send would keep the original
    beside the reloaded copy)."""
    readers = program.readers()
    ops = program.ops
    index = {(op.action.kind, op.action.stage, op.action.microbatch): i
             for i, op in enumerate(ops) if op.action is not None}
    defined = {v: i for i, op in enumerate(ops) for v in op.outs}
    groups: dict[tuple[str, Role], tuple[_Group, ...]] = {}
    out: dict[tuple[int, int], tuple[Candidate, ...]] = {}
    for b, op in enumerate(ops):
        a = op.action
        w = index.get((Kind.W, a.stage, a.microbatch)) if a is not None and a.kind is Kind.B else None
        f = index.get((Kind.F, a.stage, a.microbatch)) if w is not None else None
        if f is None:
            continue
        found = []
        for at, role in ((b, Role.WSAVED), (f, Role.SAVED)):
            key = (ops[at].args.graph, role)
            if key not in groups:
                groups[key] = _storage_groups(program, key[0], role)
            for g in groups[key]:
                c = _b_candidate(program, readers, defined, ops[at], g, b, w) if g.type.nbytes >= min_bytes else None
                if c is not None:
                    found.append(c)
        out[(a.stage, a.microbatch)] = tuple(found)
    return out


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


def _storage_groups(program: RankProgram, key: str, role: Role = Role.SAVED) -> tuple[_Group, ...]:
    """The storages of graph `key`'s outputs (an F's, or a B's with `role` WSAVED) that hold an output of
    `role` and may be copied out and back whole (fresh memory of the graph with static sizes), in output
    order of their first such output (the group's `saved`)."""
    graph = program.graphs[key]
    if graph.gm is None:
        raise LoweringError(f"rank {program.rank}: offload needs the F and B graphs' GraphModules (their outputs' "
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
        saved = tuple(k for k in positions if role_of(graph.outputs[k]) is role)
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


def _b_candidate(program: RankProgram, readers: dict[str, list[int]], defined: dict[str, int], at: Op,
                 g: _Group, b: int, w: int) -> Candidate | None:
    """Group `g` of the outputs of op `at` (the unit's B, or its F) as a candidate to go after B (op b) and
    come back before W (op w), or None. A view goes under its current name (`re.` once per reload so far)
    if it is read after B; those must be defined by B or before it and read after it (FREE aside) only by W;
    the group's other views and outputs must have no reader left after B's own tail (its stamp and FREE)."""
    names = [_current(defined, at.outs[k]) for k in g.saved]
    after = [[j for j in readers.get(v, ()) if j > b and program.ops[j].kind is not OpKind.FREE] for v in names]
    live = [k for k, later in enumerate(after) if later]
    if not live or any(defined.get(names[k], b + 1) > b or set(after[k]) != {w} for k in live):
        return None
    # the rest must be gone when the offload is issued: a send of B's grad:act on the storage would keep the
    # original beside its reloaded copy, and a peak could then grow
    rest = [names[k] for k in range(len(names)) if k not in live] + [at.outs[k] for k in g.others]
    tail = _after_run(program.ops, b)
    if any(j > tail for v in rest for j in readers.get(v, ())):
        return None
    values = tuple(names[k] for k in live)
    return Candidate(values[0], g.type, g.type.nbytes, b, w, values, tuple(g.views[k] for k in live), Kind.B)


def _current(defined: dict[str, int], vid: str) -> str:
    """The name value `vid` has now: each reload so far wrapped it in one more `re.`."""
    while reloaded_value(vid) in defined:
        vid = reloaded_value(vid)
    return vid


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
    renamed: dict[str, tuple[str, int]] = {}   # value -> its reloaded name, read by ops after this index
    # one provisional slot per new offload, above the slots earlier offloads use; assign_host_slots colours all
    for k, p in enumerate(plans, start=len(program.host_buffers)):
        c, why = p.candidate, f"for {ops[p.reader].action}"
        off, re = handle(f"off.{c.value}"), handle(f"re.{c.value}")
        new = tuple(reloaded_value(v) for v in c.values)
        renamed.update((v, (n, p.offload_after)) for v, n in zip(c.values, new))
        after.setdefault(p.offload_after, []).append(Op(OpKind.OFFLOAD, c.values, (off,), HostArgs(k, c.type), why))
        offloaded.setdefault(p.offload_after, []).extend(c.values)
        _at(before, _before_run(ops, p.wait_before))[0].append(Op(OpKind.WAIT_OFFLOAD, (off,)))
        _at(before, _before_run(ops, p.reload_before))[1].append(Op(OpKind.RELOAD, (), (re,), HostArgs(k, c.type), why))
        _at(before, _before_run(ops, p.reader))[2].append(Op(OpKind.WAIT_RELOAD, (re,), new, ViewArgs(c.views)))
    out: list[Op] = []
    for i, op in enumerate(ops):
        for group in before.get(i, ()):
            out += group
        out.append(_rename(op, i, renamed))   # after the offload only the backward and its FREE read them
        if i in after:
            out += after[i]
            out.append(Op(OpKind.FREE, tuple(offloaded[i]), note="offloaded: each handle holds its storage "
                                                                  "until wait_offload"))
    return tuple(out)


def _at(before: dict, i: int) -> tuple[list[Op], list[Op], list[Op]]:
    return before.setdefault(i, ([], [], []))


def _rename(op: Op, i: int, renamed: dict[str, tuple[str, int]]) -> Op:
    """Readers after the offload (the backward and the FREE after it) read the reloaded value; B, which reads
    a value offloaded after it, keeps the original name."""
    if renamed.keys().isdisjoint(op.ins):
        return op
    return op._replace(ins=tuple(n[0] if (n := renamed.get(v)) and i > n[1] else v for v in op.ins))


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
