"""The rank-program IR: what one rank executes in one training step, as a straight line of ops.

The lowering (`zbcompile.passes.lower`) builds one `RankProgram` per rank from a Schedule and a StagedModel,
then emits it as an fx GraphModule whose generated Python code is the program the runtime calls once per
step. A RankProgram is self-contained: besides its ops it holds the table of graphs its RUN ops call, so a
pass sees everything it may change and nothing else, and a graph variant (the accumulating W, the boxed
form) is a pass that adds or replaces an entry of that table.

    # rank 1 of 1f1b: 4 microbatches, inputs 2, ops 24
    graph stage1_f = (param:l1.weight, act:h) -> (loss, saved:0)
    graph stage1_bw = (saved:0, grad:loss) -> (grad:act:h: [1, 16] float32, grad:param:l1.weight: [16, 16] float32)
    inputs grad_loss, param:l1.weight
       0  h:s0.mb0.act:h = irecv(from 0 tag 0 [1, 16] float32 -> buf 0)
       1  s0.mb0.act:h = wait_recv(h:s0.mb0.act:h)
       2  [1F0] s1.mb0.loss, s1.mb0.saved:0 = stage1_f(param:l1.weight, s0.mb0.act:h)
       ...
          return loss

Value names are described in `values.py`, op kinds in `ops/` (one spec per kind, in its family's module). The
printed program parses back: `RankProgram.from_text(p.to_text(), graphs=p.graphs)` equals `p` (without `graphs`,
each entry keeps its signature and types but no GraphModule, enough for passes that only move ops).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from zbcompile.errors import LoweringError
from zbcompile.ir.program.ops import (SPECS, Op, OpKind, RunArgs, TensorType, spec_by_text)
from zbcompile.ir.program.values import parse as parse_value
from zbcompile.ir.schedule import Action
from zbcompile.ir.stages import Graph

__all__ = ["ProgramGraph", "RankProgram"]


@dataclass(frozen=True)
class ProgramGraph(Graph):
    """One graph a program's RUN ops call: the stage IR's named graph (zbcompile.ir.stages.Graph), plus what the
    lowering needs to know of it without running it. types: per output, the type of the boundary tensors
    and parameter gradients (None elsewhere). boxed: the program calls it with its inputs in one list that
    it empties (fx's boxed calling convention; the emitter builds that form of `gm`); else positionally.
    backend: the compiler the emitter runs `gm` through (passes/lower/compiled.py: "inductor"), or None for
    the aten graph itself; `gm` stays the aten graph either way, which is what every analysis reads.
    gm is None in a program read from text without graphs."""

    types: tuple[TensorType | None, ...] = field(default=(), kw_only=True)
    boxed: bool = field(default=False, kw_only=True)
    backend: str | None = field(default=None, kw_only=True)

    def signature(self) -> str:
        outs = [f"{n}: {t}" if t is not None else n for n, t in zip(self.outputs, self.types or
                                                                       (None,) * len(self.outputs))]
        boxed = " boxed" if self.boxed else ""
        backend = f" {self.backend}" if self.backend else ""
        return f"({', '.join(self.inputs)}) -> ({', '.join(outs)}){boxed}{backend}"


@dataclass(frozen=True)
class RankProgram:
    """One rank's step: program inputs, a straight line of ops, the returned value and the graphs it runs.

    name: the schedule's name (for the printed header); microbatches: how many the step runs.
    inputs: names the runtime passes, in order (after the step context): grad_loss, params, buffers, data.
    output: the value returned (this rank's sum of microbatch losses), or None.
    graphs: graph key -> ProgramGraph, for every key a RUN op names.
    buffers: the static receive buffers the runtime makes once (RECV ops with a slot use them).
    host_buffers: the host pool of offloaded activations, by slot (OFFLOAD / RELOAD ops name one): the runtime
    makes it once (pinned on CUDA) and reuses it across microbatches and steps (passes/lower/offload.py).
    staged_inputs: the runtime copies each step's batch into input buffers it makes once and passes fixed
    microbatch views of them (nothing that may alias a data input outlives the step); False: fresh slices.
    wait_timeout: every wait of the step is bounded by the step's timeout (work.wait(timeout): a dead or stalled
    peer raises RuntimeFailure instead of hanging); False: plain work.wait(), which records a stream dependency
    and does not block the host, as CUDA-graph capture needs (passes/lower/capture.py: capture_ready).
    event_timing: the STAMP ops record device events (runtime StepContext.events) instead of reading the host
    clock: a captured step replays the events, where a host stamp would keep the capture step's time.
    passes: names of the passes applied so far.
    """

    name: str
    rank: int
    microbatches: int
    inputs: tuple[str, ...] = ()
    ops: tuple[Op, ...] = ()
    output: str | None = None
    graphs: Mapping[str, ProgramGraph] = field(default_factory=dict)
    buffers: tuple[TensorType, ...] = ()
    host_buffers: tuple[TensorType, ...] = ()
    staged_inputs: bool = False
    wait_timeout: bool = True
    event_timing: bool = False
    passes: tuple[str, ...] = ()

    def replace(self, **changes) -> RankProgram:
        return dataclasses.replace(self, **changes)

    # ---- queries ----------------------------------------------------------------------------
    def of_kind(self, *kinds: OpKind) -> list[Op]:
        return [op for op in self.ops if op.kind in kinds]

    def run_ops(self) -> list[Op]:
        return self.of_kind(OpKind.RUN)

    def graph(self, op: Op) -> ProgramGraph:
        """The graph RUN op `op` calls."""
        found = self.graphs.get(op.args.graph)
        if found is None:
            raise LoweringError(f"rank {self.rank}: {op} calls graph {op.args.graph!r}, which is not in the "
                                f"program's graph table ({', '.join(self.graphs) or 'empty'})")
        return found

    def defined(self) -> set[str]:
        return set(self.inputs) | {v for op in self.ops for v in op.outs}

    def used(self) -> set[str]:
        used = {v for op in self.ops for v in op.ins}
        return used | ({self.output} if self.output else set())

    def readers(self) -> dict[str, list[int]]:
        """value -> the indices of the ops that read it, in program order."""
        out: dict[str, list[int]] = {}
        for i, op in enumerate(self.ops):
            for v in op.ins:
                out.setdefault(v, []).append(i)
        return out

    def local_stages(self) -> set[int]:
        return {op.args.action.stage for op in self.ops if op.kind is OpKind.RUN}

    # ---- checks -----------------------------------------------------------------------------
    def check(self, after: str = "", remote_ok: bool = False) -> RankProgram:
        """Every value is defined once, before its uses, and not used after it is freed; every op kind has a
        spec and every RUN op a graph. remote_ok: a stage value of a stage this rank does not run may be read
        without a definition (before insert_p2p receives it), and so may a vocabulary value while the program
        has no collective yet (before insert_collectives adds the waits that define it). Linear in the ops (set
        operations per op: it runs after every pass)."""
        live: set[str] = set(self.inputs)
        freed: dict[str, int] = {}
        local = self.local_stages() if remote_ok else set()
        free_kind, run_kind = OpKind.FREE, OpKind.RUN
        for i, op in enumerate(self.ops):
            kind = op.kind
            if kind not in SPECS:
                raise LoweringError(self._where(i, f"op kind {kind} has no OpSpec", after))
            if kind is run_kind and op.args.graph not in self.graphs:
                raise LoweringError(self._where(i, f"calls graph {op.args.graph!r}, not in the graph table", after))
            ins = op.ins
            if not live.issuperset(ins):
                self._undefined(i, op, live, local, remote_ok, after)
            if freed and not freed.keys().isdisjoint(ins):
                v = next(v for v in ins if v in freed)
                raise LoweringError(self._where(i, f"uses {v!r}, freed at op {freed[v]}", after))
            if kind is free_kind:
                freed.update((v, i) for v in ins)
            if not live.isdisjoint(op.outs):
                v = next(v for v in op.outs if v in live)
                raise LoweringError(self._where(i, f"defines {v!r} a second time", after))
            live.update(op.outs)
        if self.output and self.output not in live:
            raise LoweringError(f"rank {self.rank}: the program returns {self.output!r}, which is never defined")
        return self

    def _undefined(self, i: int, op: Op, live: set[str], local: set[int], remote_ok: bool, after: str) -> None:
        for v in op.ins:
            if v in live:
                continue
            value = parse_value(v)
            remote = value.scope == "stage" and value.stage not in local
            collected = value.scope == "vocab" and not any(o.kind is OpKind.COLLECTIVE for o in self.ops)
            if not (remote_ok and (remote or collected)):
                raise LoweringError(self._where(i, f"uses {v!r} before it is defined", after))

    def _where(self, index: int, what: str, after: str) -> str:
        at = f" after pass {after}" if after else ""
        return f"rank {self.rank}{at}, op {index} ({self.ops[index]}): {what}\n{self.to_text(mark=index)}"

    # ---- text -------------------------------------------------------------------------------
    def header(self) -> str:
        head = (f"# rank {self.rank} of {self.name}: {self.microbatches} microbatches, inputs {len(self.inputs)}, "
                f"ops {len(self.ops)}")
        if self.buffers:
            head += f", static receive buffers {len(self.buffers)} ({_mib(self.buffers):.2f} MiB)"
        if self.host_buffers:
            head += f", host pool {len(self.host_buffers)} ({_mib(self.host_buffers):.2f} MiB)"
        if self.staged_inputs:
            head += ", batch staged in static input buffers"
        if not self.wait_timeout:
            head += ", untimed waits"
        if self.event_timing:
            head += ", event timing"
        return head

    def to_text(self, mark: int | None = None, window: int = 12, width: int | None = None) -> str:
        """The whole program, one op per line, parseable by from_text. `mark`: only a window of ops around
        op `mark` (marked >>) under the header, lines cut to 160 characters, for error messages."""
        lo, hi = 0, len(self.ops)
        lines = [self.header()]
        if mark is not None:
            lo, hi = max(0, mark - window), min(len(self.ops), mark + window + 1)
            width = width or 160
        else:
            lines += [f"graph {k} = {g.signature()}" for k, g in self.graphs.items()]
            lines += [f"buffer {k} = {t}" for k, t in enumerate(self.buffers)]
            lines += [f"host {k} = {t}" for k, t in enumerate(self.host_buffers)]
            lines.append(f"inputs {', '.join(self.inputs)}")
            if self.passes:
                lines.append(f"passes {', '.join(self.passes)}")
        lines += [_cut(f"{'>>' if i == mark else '  '} {i:4d}  {self.ops[i]}", width) for i in range(lo, hi)]
        lines.append(f"     return {self.output}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_text()

    @staticmethod
    def from_text(text: str, graphs: Mapping[str, ProgramGraph] | None = None) -> RankProgram:
        """Parse `to_text()` back. `graphs`: the GraphModules to attach by key (their signatures must match the
        text's); without it each entry has gm=None."""
        return _Reader(text, graphs).program()


def _cut(line: str, width: int | None) -> str:
    return line if width is None or len(line) <= width else line[:width - 3] + "..."


def _mib(types: Iterable[TensorType]) -> float:
    return sum(t.nbytes for t in types) / 2**20


# ---- reading the text form -----------------------------------------------------------------------------
_HEAD_RE = re.compile(r"# rank (\d+) of (\S+): (\d+) microbatches, inputs \d+, ops \d+(, static receive buffers "
                      r"\d+ \([\d.]+ MiB\))?(?:, host pool \d+ \([\d.]+ MiB\))?"
                      r"(, batch staged in static input buffers)?(, untimed waits)?(, event timing)?")
_OP_RE = re.compile(r"(?:>>|  ) +\d+  (?:\[(\S+)\] )?(?:(.+?) = )?([\w.]+)\((.*)\)")


class _Reader:
    """from_text's parser: the header, the graph table, buffers, the host pool, inputs, then one op per line."""

    def __init__(self, text: str, graphs: Mapping[str, ProgramGraph] | None):
        self.lines = text.strip("\n").splitlines()
        self.attach = graphs

    def fail(self, n: int, what: str) -> LoweringError:
        return LoweringError(f"rank program text, line {n + 1} ({self.lines[n]!r}): {what}")

    def program(self) -> RankProgram:
        head = _HEAD_RE.fullmatch(self.lines[0]) if self.lines else None
        if head is None:
            raise LoweringError("not a rank program: the first line must read '# rank R of NAME: M microbatches, "
                                "inputs N, ops K[, ...]' as RankProgram.to_text prints it")
        fields = dict(rank=int(head.group(1)), name=head.group(2), microbatches=int(head.group(3)),
                      staged_inputs=head.group(5) is not None, wait_timeout=head.group(6) is None,
                      event_timing=head.group(7) is not None)
        graphs: dict[str, ProgramGraph] = {}
        buffers: list[TensorType] = []
        host: list[TensorType] = []
        ops: list[Op] = []
        for n, line in enumerate(self.lines[1:], start=1):
            if line.startswith("graph "):
                key, g = self.graph(n, line)
                graphs[key] = g
            elif line.startswith("buffer "):
                buffers.append(TensorType.parse(line.partition(" = ")[2]))
            elif line.startswith("host "):
                host.append(TensorType.parse(line.partition(" = ")[2]))
            elif line.startswith("inputs"):
                fields["inputs"] = tuple(v.strip() for v in line[len("inputs"):].split(",") if v.strip())
            elif line.startswith("passes "):
                fields["passes"] = tuple(v.strip() for v in line[len("passes "):].split(","))
            elif line.strip().startswith("return "):
                out = line.strip()[len("return "):]
                fields["output"] = None if out == "None" else out
            else:
                ops.append(self.op(n, line))
        return RankProgram(graphs=graphs, buffers=tuple(buffers), host_buffers=tuple(host), ops=tuple(ops),
                           **fields)

    def graph(self, n: int, line: str) -> tuple[str, ProgramGraph]:
        m = re.fullmatch(r"graph (\S+) = \((.*?)\) -> \((.*)\)( boxed)?(?: (\w+))?", line)
        if not m:
            raise self.fail(n, "expected 'graph KEY = (INPUTS) -> (OUTPUTS)'")
        key, ins, outs = m.group(1), _names(m.group(2)), []
        types = []
        for item in _names(m.group(3)):
            name, sep, t = item.partition(": [")
            outs.append(name)
            types.append(TensorType.parse("[" + t) if sep else None)
        g = ProgramGraph(None, ins, tuple(outs), types=tuple(types), boxed=m.group(4) is not None,
                         backend=m.group(5))
        if self.attach is not None:
            given = self.attach.get(key)
            if given is None or (given.inputs, given.outputs) != (g.inputs, g.outputs):
                raise self.fail(n, f"the graphs given to from_text have no graph {key!r} with this signature")
            g = dataclasses.replace(g, gm=given.gm)
        return key, g

    def op(self, n: int, line: str) -> Op:
        body, _, note = line.partition("    # ")
        m = _OP_RE.fullmatch(body)
        if not m:
            raise self.fail(n, "expected '  INDEX  [ACTION] OUTS = NAME(ARGS)'")
        action, outs_text, name, inner = m.groups()
        outs = _names(outs_text or "")
        if action is not None:
            return Op(OpKind.RUN, _names(inner), outs, RunArgs(Action.parse(action), name), note)
        s = spec_by_text(name)
        if s is None:
            raise self.fail(n, f"unknown op {name!r}; the kinds are {', '.join(x.text for x in SPECS.values())}")
        try:
            ins, args = s.parse(inner, outs)
        except LoweringError as e:
            raise self.fail(n, str(e)) from None
        return Op(s.kind, ins, outs, args, note)


def _names(text: str) -> tuple[str, ...]:
    """Comma-separated names; a tensor type's `[2, 8]` keeps its commas."""
    out, depth, cur = [], 0, []
    for c in text:
        depth += (c == "[") - (c == "]")
        if c == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(c)
    if "".join(cur).strip():
        out.append("".join(cur).strip())
    return tuple(out)
