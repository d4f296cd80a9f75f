"""static_recv_buffers: give receives buffers that live across steps instead of a fresh allocation each.

Every receive used to allocate its buffer when posted. On a small model that allocation is a real share of
the host time per action (a few microseconds each once gloo's threads have disturbed the caches), and for
CUDA-graph capture every buffer must be static anyway. This pass assigns each receive a slot of a table of
buffers the runtime makes once (`RankProgram.buffers`); receives whose busy times do not overlap share one.

A buffer is busy from the post of its receive (the peer may write into it from then on) until the last use
of every value that may alias it: the received tensor itself, and whatever a stage graph returns that may
be a view of it. An F graph that saves its received input (or `view(x)`) for B and W keeps the buffer busy
until W; a send of it keeps it busy until the send is waited; a W graph whose parameter gradient *is* the
received gradient (`x + b`, b of x's whole shape) keeps it busy until the first microbatch's gradient is
summed out of place. Aliasing inside a stage graph is read off the aten schemas of its nodes (aliases.py).

A receive whose buffer may outlive the step keeps a fresh allocation per step: one that may become a
Parameter's .grad (SET_GRAD takes ownership of the tensor) or the program's output. Which op keeps its
inputs and which outputs may share memory with which inputs, each op kind's spec says (ir/program/ops/).

    h:s1.mb0.act:h = irecv(from 0 tag 0 [4, 8] float32 -> buf 0)

static_input_buffers applies the same test to the batch: when nothing that may alias a data input outlives
the step, the runtime copies each batch into input buffers it makes once and hands the program views of
them fixed at build time, instead of cutting the batch into fresh microbatch views every step (tens of
microseconds of host time per step; CUDA-graph capture needs static inputs too).
"""

from __future__ import annotations

from typing import Callable

from zbcompile.passes.analysis.aliases import graph_output_aliases
from zbcompile.ir.program import RankProgram
from zbcompile.ir.program.ops import OpKind, TensorType
from zbcompile.ir.program.values import parse

__all__ = ["static_recv_buffers", "static_input_buffers", "buffer_intervals"]


def static_recv_buffers(program: RankProgram) -> RankProgram:
    intervals = buffer_intervals(program)
    slots: list[TensorType] = []
    busy_until: list[int] = []
    ops = list(program.ops)
    for i, op in enumerate(program.ops):
        if op.kind is not OpKind.RECV or i not in intervals:
            continue
        t = op.args.type
        slot = _free_slot(slots, busy_until, t, i)
        if slot is None:
            slot = len(slots)
            slots.append(t)
            busy_until.append(0)
        busy_until[slot] = intervals[i]
        ops[i] = op._replace(args=op.args._replace(slot=slot))
    return program.replace(ops=tuple(ops), buffers=tuple(slots))


def static_input_buffers(program: RankProgram) -> RankProgram:
    """staged_inputs=True when no value that may alias a microbatch of the batch can outlive the step (the
    next step's batch overwrites the input buffers)."""
    aliases = _alias_edges(program)
    readers = program.readers()
    data = [v for v in program.inputs if parse(v).scope == "data"]
    staged = all(_last_use(program, v, aliases, readers) is not None for v in data)
    return program.replace(staged_inputs=staged)


def _free_slot(slots: list[TensorType], busy_until: list[int], t: TensorType, at: int) -> int | None:
    """A slot of the same shape and dtype whose last busy op is before `at` (receives come in post order,
    so first-fit is an optimal interval colouring)."""
    for k, s in enumerate(slots):
        if s == t and busy_until[k] < at:
            return k
    return None


def buffer_intervals(program: RankProgram) -> dict[int, int]:
    """For each RECV op (by index) whose buffer cannot outlive the step: the index of the last op that uses
    a value which may alias the buffer."""
    aliases = _alias_edges(program)
    readers = program.readers()
    out: dict[int, int] = {}
    for i, op in enumerate(program.ops):
        if op.kind is not OpKind.RECV:
            continue
        last = _last_use(program, op.outs[0], aliases, readers)
        if last is not None:
            out[i] = max(last, i)
    return out


def _last_use(program: RankProgram, root: str, aliases: dict[str, set[str]],
              readers: dict[str, list[int]]) -> int | None:
    """The last op reading any value that may alias `root`; None when one of them may escape the step."""
    seen, todo, last = {root}, [root], 0
    while todo:
        v = todo.pop()
        if v == program.output:
            return None
        for i in readers.get(v, ()):
            op = program.ops[i]
            if op.spec.keeps(op):
                return None
            last = max(last, i)
        for w in aliases.get(v, ()):
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return last


def _alias_edges(program: RankProgram) -> dict[str, set[str]]:
    """value -> the values that may alias it, one op at a time (outputs that may be views of inputs)."""
    graph_aliases = _graph_aliases(program)
    edges: dict[str, set[str]] = {}
    for op in program.ops:
        for src, dst in op.spec.aliases(op, graph_aliases):
            edges.setdefault(src, set()).add(dst)
    return edges


def _graph_aliases(program: RankProgram) -> Callable[[str], tuple]:
    """graph key -> for each output, the input positions it may share memory with (once per graph)."""
    memo: dict[str, tuple] = {}

    def lookup(key: str) -> tuple:
        if key not in memo:
            memo[key] = graph_output_aliases(program.graphs[key].gm)
        return memo[key]
    return lookup
