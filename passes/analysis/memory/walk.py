"""rank_memory: one finished rank program's memory over the step, walked op by op (each stage graph a RUN op
calls node by node, by its graph_profile); every other op kind by its OpSpec's fresh, aliases and keeps."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import torch

from zbcompile.errors import LoweringError
from zbcompile.ir.names import Role
from zbcompile.ir.program import RankProgram
from zbcompile.ir.program.ops import Op, OpKind, allocated_bytes, padded_shard_bytes
from zbcompile.ir.program.values import parse
from zbcompile.passes.analysis.memory.graphs import graph_profile, tensor_bytes
from zbcompile.passes.analysis.memory.records import (_GRADS, _OTHER, _WORKSPACE, CATEGORIES, RankMemory, Sample,
                                                      _category)

__all__ = ["rank_memory"]


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
    device: torch.device | None = None                               # the program's: allocations round there

    def new(self, nbytes: int) -> int:
        nbytes = allocated_bytes(nbytes, self.device)
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
_HELD = "\0held:"   # pseudo values: bytes held from the step's start to its VALIDATE op


def rank_memory(program: RankProgram, num_ranks: int = 1, held: dict[str, int] | None = None) -> RankMemory:
    """One finished program's RankMemory (see the package docstring). held: bytes by category that exist when
    the step starts and go at its VALIDATE op (post-validation: the last step's gradients and the snapshot of
    its optimistic update)."""
    return _Walk(program, num_ranks, held or {}).run()


class _Walk:
    def __init__(self, program: RankProgram, num_ranks: int, held: dict[str, int]):
        self.p = program
        self.num_ranks = num_ranks
        self.held = held
        self.state = _State(device=_device(program))
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
        self._hold()
        for i, op in enumerate(p.ops):
            if op.kind is OpKind.VALIDATE:
                for name in self.held:
                    st.release(_HELD + name)
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

    def _hold(self) -> None:
        """The held bytes as storages of their categories, each referenced by a pseudo value until VALIDATE."""
        st = self.state
        for name, nbytes in self.held.items():
            sid = st.new(nbytes)
            st.totals[st.cat[sid]] -= nbytes
            st.cat[sid] = CATEGORIES.index(name)
            st.totals[st.cat[sid]] += nbytes
            st.of[_HELD + name] = (sid,)
            st.refs[sid].add(_HELD + name)

    # ---- what exists before the step ----
    def _resident(self) -> dict[str, int]:
        p, st = self.p, self.state
        buffers = sum(allocated_bytes(t.nbytes, st.device) for t in p.buffers)
        out = {"parameters": 0, "buffers": 0, "inputs": 0, "receive buffers": buffers}
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
            # a node's results exist while its operands do (relu(bn_out) holds both): the peak is read
            # after the births and before the deaths of the same node
            workspace += born
            now = st.live + workspace
            if now > peak:
                peak = now
                split = tuple(st.totals[c] + (workspace if c == _WORKSPACE else 0) for c in range(len(CATEGORIES)))
            for r in dead:
                workspace -= prof.fresh[r]
            if g.boxed:
                for k in inputs_done:
                    v = op.ins[k]
                    gone[v] = gone.get(v, 0) + 1
                    if v in handed and gone[v] == positions[v]:
                        st.release(v)
                        handed.discard(v)
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
                                f"{op.kind.value}; give its OpSpec a `fresh` rule (zbcompile/ir/program/ops/)")
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
    for op in program.of_kind(OpKind.DP_GATHER):   # a replica's padded shard of each parameter it gathers
        for v, t in zip(op.ins, op.args.types):
            out.setdefault(v, padded_shard_bytes(t, op.args.replicas))
    return out


def _device(program: RankProgram) -> torch.device | None:
    """The device of the program's stage graphs (their FakeTensors'), None without graphs or tensors."""
    for g in program.graphs.values():
        for node in g.gm.graph.nodes if g.gm is not None else ():
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor):
                return val.device
    return None


def _host_bytes(program: RankProgram) -> int:
    host = getattr(program, "host_buffers", ())
    return sum(t.nbytes for t in host)


def _describe(i: int, op: Op) -> str:
    """`op 84: [3B2] stage3_b`, or `op 12: wait_recv(s0.mb1.act:h)`: where a peak is, short enough for a table."""
    if op.kind is OpKind.RUN:
        return f"op {i}: [{op.args.action}] {op.args.graph}"
    ins = ", ".join(op.ins[:2]) + (", ..." if len(op.ins) > 2 else "")
    return f"op {i}: {op.spec.text}({ins})"
