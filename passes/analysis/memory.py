"""memory_plan: every rank's device memory over one step, known before anything runs.

A rank program is a straight line whose values the generated code drops at their last use (fx's code
generator does, and a boxed stage graph drops each input at its own last use inside), so the bytes live
after every op follow from three facts the compiler already has: which values each op defines and reads,
which values may share memory (the alias analysis of aliases.py and each op kind's spec), and every stage
graph's tensor sizes (the FakeTensor in each node's meta["val"], whose storage also says which results are
views of one another). The plan walks each program once, stage graphs node by node:

    storage   one per fresh allocation (a graph's fresh result, a receive buffer, a gradient sum); its bytes
              are the FakeTensor storage's. Views and in-place results add none.
    resident  what exists before the step: parameters, buffers, static receive buffers, the batch.
    dynamic   what the step allocates; live while any value that may alias it is referenced. Split by what
              references it: saved (F's saved tensors, what B leaves for W), boundary (activations sent or
              received, their gradients, vocabulary values, posted handles), grads (gradients and their
              sums), workspace (a stage graph's temporaries while it runs), other.

    # rank 0 of 1f1b: resident 1.2 MiB, peak 3.4 MiB during [0B1] (saved 1.1, boundary 0.2, grads 0.5, ...)

Assumptions (the runtime's, stated where they matter): Parameter.grad is None when the step starts
(`optimizer.zero_grad()`'s default), so the gradients the step hands over are its own allocation and live to
its end; allocator rounding and kernels' internal scratch memory are not counted (the CPU tracker of
zbcompile.runtime.memory sees neither; on CUDA they are the gap to `max_memory_allocated`).
"""

from __future__ import annotations

import operator
import weakref
from dataclasses import dataclass, field
from typing import Iterable, Mapping, NamedTuple, Sequence

import torch
from torch import fx

from zbcompile.errors import LoweringError
from zbcompile.ir.names import Role
from zbcompile.passes.analysis.aliases import node_roots
from zbcompile.ir.program import RankProgram
from zbcompile.ir.program.ops import Op, OpKind
from zbcompile.ir.program.values import parse

__all__ = ["CATEGORIES", "MemoryPlan", "RankMemory", "Sample", "memory_plan", "rank_memory", "graph_profile",
           "tensor_bytes"]

CATEGORIES = ("saved", "boundary", "grads", "workspace", "other")
_SAVED, _BOUNDARY, _GRADS, _WORKSPACE, _OTHER = range(5)
_ACTIVATION = (_SAVED, _BOUNDARY)
_ROLE_CATEGORY = {Role.SAVED: _SAVED, Role.WSAVED: _SAVED, Role.ACT: _BOUNDARY, Role.GRAD_ACT: _BOUNDARY,
                  Role.DATA: _BOUNDARY, Role.VOCAB: _BOUNDARY, Role.GRAD_PARAM: _GRADS}


class Sample(NamedTuple):
    """One op of the program: the most dynamic bytes live while it runs, and the dynamic bytes live after it
    by category (CATEGORIES order; workspace is 0 between ops)."""

    op: int
    peak: int
    after: tuple[int, ...]

    @property
    def total(self) -> int:
        return sum(self.after)


@dataclass(frozen=True)
class RankMemory:
    """One rank's memory over the step (bytes). resident: what exists before the step, by kind; samples: one
    per op; peak_op: the op during which the dynamic bytes peak, peak_split: their categories then; host: the
    host pool's bytes (offload), not device memory."""

    rank: int
    name: str
    resident: Mapping[str, int]
    samples: tuple[Sample, ...]
    peak_op: int
    peak_at: str
    peak_split: tuple[int, ...]
    host: int = 0

    @property
    def resident_bytes(self) -> int:
        return sum(self.resident.values())

    @property
    def peak_dynamic_bytes(self) -> int:
        """The most bytes the step itself holds at once (what a tracker of the step's allocations measures)."""
        return max((s.peak for s in self.samples), default=0)

    @property
    def peak_total_bytes(self) -> int:
        return self.resident_bytes + self.peak_dynamic_bytes

    @property
    def peak_activation_bytes(self) -> int:
        """The most bytes of saved and boundary tensors live at once (between ops)."""
        return max((sum(s.after[c] for c in _ACTIVATION) for s in self.samples), default=0)

    def to_json(self) -> dict:
        return {"rank": self.rank, "peak_activation_bytes": self.peak_activation_bytes,
                "peak_total_bytes": self.peak_total_bytes, "peak_dynamic_bytes": self.peak_dynamic_bytes,
                "resident_bytes": self.resident_bytes, "resident": dict(self.resident),
                "peak_op": self.peak_op, "peak_at": self.peak_at,
                "peak_split": dict(zip(CATEGORIES, self.peak_split)), "host_bytes": self.host,
                "timeline": [[s.op, s.peak, *s.after] for s in self.samples],
                "timeline_columns": ["op", "peak", *CATEGORIES]}


@dataclass(frozen=True)
class MemoryPlan:
    """Every rank's RankMemory; `table()` prints one row per rank."""

    name: str
    ranks: tuple[RankMemory, ...]

    def __getitem__(self, rank: int) -> RankMemory:
        return self.ranks[rank]

    def to_json(self) -> dict:
        return {"schedule": self.name, "ranks": [r.to_json() for r in self.ranks]}

    def table(self) -> str:
        from tabulate import tabulate

        rows = [(r.rank, _mib(r.resident_bytes), _mib(r.peak_activation_bytes), _mib(r.peak_dynamic_bytes),
                 _mib(r.peak_total_bytes), r.peak_at) for r in self.ranks]
        return tabulate(rows, headers=("rank", "resident MiB", "peak activations MiB", "peak step MiB",
                                       "peak total MiB", "at op"), floatfmt=".2f")


def _mib(n: int) -> float:
    return n / 2**20


def memory_plan(programs: Sequence[RankProgram]) -> MemoryPlan:
    """The memory plan of every rank's finished program (after `lower_all`)."""
    ranks = tuple(rank_memory(p, num_ranks=len(programs)) for p in programs)
    return MemoryPlan(programs[0].name if programs else "", ranks)


# ---- stage graphs ------------------------------------------------------------------------------------
class GraphProfile(NamedTuple):
    """What running one stage graph allocates and releases, node by node (see graph_profile)."""

    outputs: tuple[frozenset, ...]              # per output, its roots: input positions and fresh root names
    fresh: Mapping[str, int]                    # fresh root -> bytes
    steps: tuple[tuple[int, tuple[str, ...], tuple[int, ...]], ...]
    # per node: (bytes born there, fresh roots dead after it, input positions whose last use it is)


_PROFILES: weakref.WeakKeyDictionary[fx.GraphModule, GraphProfile] = weakref.WeakKeyDictionary()


def graph_profile(gm: fx.GraphModule) -> GraphProfile:
    """The graph's memory profile, from the alias roots of its nodes and their FakeTensor sizes. A fresh
    root dies after the last user of the last node that may alias it; roots an output may alias outlive the
    graph. Memoized per graph (weakly, as aliases.py does)."""
    found = _PROFILES.get(gm)
    if found is None:
        found = _PROFILES[gm] = _profile(gm)
    return found


def _profile(gm: fx.GraphModule) -> GraphProfile:
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    roots = node_roots(gm)
    output = nodes[-1]
    outs = output.args[0]
    outs = tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)
    out_roots = tuple(roots.get(o, frozenset()) if isinstance(o, fx.Node) else frozenset() for o in outs)
    fresh = _fresh_bytes(nodes, roots)
    end: dict = {}           # fresh root -> index of the last node that may still reference it
    born: dict[int, int] = {}
    done: dict[int, list[int]] = {}
    for n in nodes[:-1]:
        last = max((index[u] for u in n.users if u is not output), default=index[n])
        if output in n.users:
            last = len(nodes)
        for r in roots.get(n, ()):
            if isinstance(r, int):
                if n.op == "placeholder":
                    done.setdefault(last, []).append(r)
            elif r in fresh:
                end[r] = max(end.get(r, -1), last)
                if r not in born:
                    born[r] = index[n]
    survivors = set().union(*out_roots) if out_roots else set()
    dies: dict[int, list[str]] = {}
    for r, i in end.items():
        if r not in survivors and i < len(nodes):
            dies.setdefault(i, []).append(r)
    alloc: dict[int, int] = {}
    for r, i in born.items():
        alloc[i] = alloc.get(i, 0) + fresh[r]
    steps = tuple((alloc.get(i, 0), tuple(dies.get(i, ())), tuple(done.get(i, ()))) for i in range(len(nodes) - 1))
    return GraphProfile(out_roots, fresh, steps)


def _fresh_bytes(nodes: list[fx.Node], roots: Mapping[fx.Node, frozenset]) -> dict[str, int]:
    """Bytes of each fresh root: a node's own result (its FakeTensor's storage) or the i-th result of a
    multi-result op (`name[i]`); a multi-result op's own root counts the results no getitem takes out.
    get_attr constants live in the module, not in the step."""
    by_name = {n.name: n for n in nodes}
    out: dict[str, int] = {}
    for n in nodes:
        for r in roots.get(n, ()):
            if isinstance(r, int) or r in out:
                continue
            base, bracket, idx = r.partition("[")
            owner = by_name.get(base)
            if owner is None or owner.op == "get_attr":
                out[r] = 0
                continue
            val = owner.meta.get("val")
            if bracket:
                k = int(idx.rstrip("]"))
                out[r] = tensor_bytes(val[k]) if isinstance(val, (tuple, list)) and k < len(val) else 0
            elif isinstance(val, (tuple, list)):
                taken = {u.args[1] for u in owner.users if u.target is operator.getitem}
                out[r] = sum(tensor_bytes(v) for k, v in enumerate(val) if k not in taken)
            else:
                out[r] = tensor_bytes(val)
    return out


def tensor_bytes(val) -> int:
    """Bytes of the storage under a (fake) tensor; 0 for anything else."""
    if not isinstance(val, torch.Tensor):
        return 0
    try:
        return int(val.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):   # sparse or other storage-less layouts
        return val.numel() * val.element_size()


# ---- rank programs --------------------------------------------------------------------------------------
@dataclass
class _State:
    """The walk's state: storages, which values reference them, and running totals per category."""

    size: dict[int, int] = field(default_factory=dict)             # storage -> bytes (dynamic storages only)
    refs: dict[int, set[str]] = field(default_factory=dict)         # storage -> values referencing it
    cat: dict[int, int] = field(default_factory=dict)               # storage -> its category now
    pinned: set[int] = field(default_factory=set)                   # outlive the step (Parameter.grad, output)
    of: dict[str, tuple[int, ...]] = field(default_factory=dict)    # value -> its storages
    totals: list[int] = field(default_factory=lambda: [0] * len(CATEGORIES))
    next_id: int = 0

    def new(self, nbytes: int) -> int:
        sid = self.next_id
        self.next_id += 1
        self.size[sid] = nbytes
        self.refs[sid] = set()
        self.cat[sid] = _OTHER
        self.totals[_OTHER] += nbytes
        return sid

    def bind(self, value: str, sids: Iterable[int]) -> None:
        sids = tuple(dict.fromkeys(sids))
        self.of[value] = sids
        for s in sids:
            if s in self.size:
                self.refs[s].add(value)
                self._recategorize(s)

    def release(self, value: str) -> None:
        for s in self.of.pop(value, ()):
            refs = self.refs.get(s)
            if refs is None:
                continue
            refs.discard(value)
            if not refs and s not in self.pinned:
                self.totals[self.cat.pop(s)] -= self.size.pop(s)
                del self.refs[s]
            else:
                self._recategorize(s)

    def _recategorize(self, sid: int) -> None:
        new = min((_category(v) for v in self.refs[sid]), default=_OTHER)
        if sid in self.pinned:
            new = min(new, _GRADS)
        old = self.cat[sid]
        if new != old:
            self.totals[old] -= self.size[sid]
            self.totals[new] += self.size[sid]
            self.cat[sid] = new

    @property
    def live(self) -> int:
        return sum(self.totals)


_IN_GRAPH = "\0in-graph"   # a pseudo value: a running graph's hold on the inputs its outputs may alias


def _category(value: str) -> int:
    v = parse(value)
    if v.role is Role.HANDLE:
        inner = value[2:]
        return _category(inner) if inner and parse(inner).role is not Role.OTHER else _BOUNDARY
    return _ROLE_CATEGORY.get(v.role, _OTHER)


def rank_memory(program: RankProgram, num_ranks: int = 1) -> RankMemory:
    """One finished program's RankMemory (see the module docstring)."""
    return _Walk(program, num_ranks).run()


class _Walk:
    def __init__(self, program: RankProgram, num_ranks: int):
        self.p = program
        self.num_ranks = num_ranks
        self.state = _State()
        self.input_bytes = _input_bytes(program)
        self.last, self.handed = _last_uses(program)
        self.released_at: dict[int, list[str]] = {}
        for v, i in self.last.items():
            if v not in self.handed:
                self.released_at.setdefault(i, []).append(v)

    def run(self) -> RankMemory:
        p, st = self.p, self.state
        resident = self._resident()
        samples: list[Sample] = []
        best, best_op, best_split = -1, -1, (0,) * len(CATEGORIES)
        for i, op in enumerate(p.ops):
            if op.kind is OpKind.RUN:
                peak, split = self._run(i, op)
            else:
                self._other(i, op)
                peak, split = st.live, tuple(st.totals)
            for v in op.outs:
                if v not in self.last and v != p.output:   # defined and never read: gone at once
                    st.release(v)
            for v in self.released_at.get(i, ()):
                st.release(v)
            after = tuple(st.totals)
            peak = max(peak, sum(after))
            samples.append(Sample(i, peak, after))
            if peak > best:
                best, best_op, best_split = peak, i, split
        at = _describe(best_op, p.ops[best_op]) if best_op >= 0 else ""
        return RankMemory(p.rank, p.name, resident, tuple(samples), best_op, at, best_split,
                          host=_host_bytes(p))

    # ---- what exists before the step ----
    def _resident(self) -> dict[str, int]:
        p, st = self.p, self.state
        out = {"parameters": 0, "buffers": 0, "inputs": 0, "receive buffers": sum(t.nbytes for t in p.buffers)}
        for k in range(len(p.buffers)):
            st.of[f"buf{k}"] = (-1 - k,)     # negative ids: resident storages, never counted as dynamic
        for n, v in enumerate(p.inputs):
            role = parse(v).role
            kind = {Role.PARAM: "parameters", Role.BUFFER: "buffers", Role.DATA: "inputs"}.get(role)
            if kind is not None:
                out[kind] += self.input_bytes.get(v, 0)
            st.of[v] = (-1000 - n,)
        return out

    # ---- a stage graph ----
    def _run(self, i: int, op: Op) -> tuple[int, tuple[int, ...]]:
        st, g = self.state, self.p.graph(op)
        if g.gm is None:
            raise LoweringError(f"rank {self.p.rank}: the memory plan needs graph {op.args.graph!r}'s "
                                "GraphModule (a program read from text without graphs has none)")
        prof = graph_profile(g.gm)
        handed = {v for v in op.ins if v in self.handed and self.handed[v] == i}
        # inputs the graph releases at their last use inside it (boxed: the program keeps no reference)
        positions: dict[str, int] = {}
        for k, v in enumerate(op.ins):
            positions[v] = positions.get(v, 0) + 1
        in_sids = [st.of.get(v, ()) for v in op.ins]   # before the graph releases any of them
        # an output may alias an input (the in-place sums of an accumulating W): that input's memory stays
        # until the output is bound, however early the graph drops the input itself
        aliased = {r for roots in prof.outputs for r in roots if isinstance(r, int)}
        st.bind(_IN_GRAPH, (s for k in aliased for s in in_sids[k]))
        peak, split, workspace = st.live, tuple(st.totals), 0
        gone: dict[str, int] = {}
        for born, dead, inputs_done in prof.steps:
            workspace += born
            for r in dead:
                workspace -= prof.fresh[r]
            if g.boxed:
                for k in inputs_done:
                    v = op.ins[k]
                    gone[v] = gone.get(v, 0) + 1
                    if v in handed and gone[v] == positions[v]:
                        st.release(v)
                        handed.discard(v)
            now = st.live + workspace
            if now > peak:
                peak = now
                split = tuple(st.totals[c] + (workspace if c == _WORKSPACE else 0) for c in range(len(CATEGORIES)))
        for v in handed:   # positional graphs: the caller's reference goes when the call returns
            st.release(v)
        fresh_sids: dict[str, int] = {}
        for v, out_roots in zip(op.outs, prof.outputs):
            sids = []
            for r in out_roots:
                if isinstance(r, int):
                    sids += in_sids[r]
                elif prof.fresh.get(r):
                    if r not in fresh_sids:
                        fresh_sids[r] = st.new(prof.fresh[r])
                    sids.append(fresh_sids[r])
            st.bind(v, sids)
        st.release(_IN_GRAPH)
        return peak, split

    # ---- every other op kind, by its spec ----
    def _other(self, i: int, op: Op) -> None:
        st = self.state
        if op.kind is OpKind.SET_GRAD:
            # the finished gradient becomes (or is added into) Parameter.grad and outlives the step
            grad = op.ins[1] if len(op.ins) > 1 else op.ins[0]
            if op.args.owned:
                for s in st.of.get(grad, ()):
                    if s in st.size:
                        st.pinned.add(s)
                        st._recategorize(s)
            else:
                s = st.new(self._nbytes(grad))
                st.pinned.add(s)
                st._recategorize(s)
            return
        fresh = op.spec.fresh
        if fresh is None:
            raise LoweringError(f"rank {self.p.rank} op {i} ({op}): the memory plan does not model op kind "
                                f"{op.kind.value}; give its OpSpec a `fresh` rule (zbcompile/ir/program/ops.py)")
        sizes = fresh(op, self._nbytes, self.num_ranks)
        aliases: dict[str, list[int]] = {}
        for src, dst in op.spec.aliases(op, self._graph_aliases):
            aliases.setdefault(dst, []).extend(st.of.get(src, ()))
        for v, nbytes in zip(op.outs, sizes):
            sids = list(aliases.get(v, ()))
            if nbytes:
                sids.append(st.new(nbytes))
            st.bind(v, sids)
        if op.spec.keeps(op):
            for v in op.ins:
                st.pinned.update(s for s in st.of.get(v, ()) if s in st.size)

    def _graph_aliases(self, key: str):
        from zbcompile.passes.analysis.aliases import graph_output_aliases

        return graph_output_aliases(self.p.graphs[key].gm)

    def _nbytes(self, value: str) -> int:
        st = self.state
        if value in self.input_bytes:
            return self.input_bytes[value]
        return sum(st.size.get(s, 0) for s in st.of.get(value, ()))


def _last_uses(program: RankProgram) -> tuple[dict[str, int], dict[str, int]]:
    """value -> index of the op after which the program drops it; and the values handed to a RUN op (the
    emitter's rule: the last reader other than FREE is a RUN) -> that op. The output is never dropped."""
    last: dict[str, int] = {}
    last_real: dict[str, int] = {}
    for i, op in enumerate(program.ops):
        for v in op.ins:
            last[v] = i
            if op.kind is not OpKind.FREE:
                last_real[v] = i
    handed = {v: i for v, i in last_real.items()
              if program.ops[i].kind is OpKind.RUN and v != program.output}
    for v in handed:
        last[v] = handed[v]
    for v in program.inputs:
        last.pop(v, None)   # program inputs are resident: the caller holds them
    if program.output:
        last.pop(program.output, None)
    return last, handed


def _input_bytes(program: RankProgram) -> dict[str, int]:
    """Bytes of each program input and each value a stage graph reads, from the graphs' placeholders."""
    out: dict[str, int] = {}
    for op in program.ops:
        if op.kind is not OpKind.RUN:
            continue
        gm = program.graph(op).gm
        if gm is None:
            continue
        for v, node in zip(op.ins, gm.graph.find_nodes(op="placeholder")):
            if v in program.inputs and v not in out:
                out[v] = tensor_bytes(node.meta.get("val"))
    return out


def _host_bytes(program: RankProgram) -> int:
    host = getattr(program, "host_buffers", ())
    return sum(t.nbytes for t in host)


def _describe(i: int, op: Op) -> str:
    """`op 84: [3B2] stage3_b`, or `op 12: wait_recv(s0.mb1.act:h)`: where a peak is, short enough for a table."""
    if op.kind is OpKind.RUN:
        return f"op {i}: [{op.args.action}] {op.args.graph}"
    ins = ", ".join(op.ins[:2]) + (", ..." if len(op.ins) > 2 else "")
    return f"op {i}: {op.spec.text}({ins})"
