"""capture_problems: what would stop CUDA-graph capture of a rank's whole step, read off the finished program.

A CUDA graph records the device work of one step and replays it without running the host code again. The
whole per-rank program can be one graph (docs/design.md) when every step does the same device work on the same
memory and nothing on the host waits for the device. No CPU backend can capture, so this is a lint over the
IR, in three layers:

    program   the batch is copied into static input buffers (staged_inputs), not cut into fresh views
    ops       each op kind's OpSpec.capture: SAFE, or why not (a receive without a static slot, a timed wait,
              a SET_GRAD that takes ownership of .grad), with its OpSpec.fix; a kind that has not decided is
              reported too
    graphs    each stage graph a RUN op calls, node by node: torch's own predicate
              (torch._inductor.utils.is_cudagraph_unsafe_fx_node: `.item()`, `_assert_scalar`, ops tagged
              cudagraph_unsafe, ...), symbolic or data-dependent sizes, random ops given a generator of their
              own (torch registers only the default CUDA generator with a graph), and CPU nodes in a graph on a
              CUDA device

Each Problem names the rank, the op (index) or graph node, the reason and the fix. A program lowered with
`passes.lower.capture.capture_ready` before the finishing passes passes the check for every schedule; the GPU
tier still has to prove it (torch.cuda.graph, set_sync_debug_mode("error"), check_input_liveness).
"""

from __future__ import annotations

from typing import Iterable, NamedTuple, Sequence

import torch
from torch import fx

from zbcompile.errors import CaptureError
from zbcompile.ir.program import RankProgram
from zbcompile.ir.program.ops import Op, OpKind
from zbcompile.ir.program.values import parse

__all__ = ["Problem", "capture_problems", "check_capture", "problems_table", "node_problem"]


class Problem(NamedTuple):
    """One thing that blocks capture. op: the op's index in the program (None for the program as a whole);
    node: `GRAPH:NODE` of a stage-graph node (None for an op)."""

    rank: int
    op: int | None
    node: str | None
    reason: str
    fix: str

    @property
    def where(self) -> str:
        if self.node is not None:
            return f"graph {self.node}" + (f" (called at op {self.op})" if self.op is not None else "")
        return f"op {self.op}" if self.op is not None else "program"


def capture_problems(program: RankProgram) -> list[Problem]:
    """Every problem of one finished rank program, in program order (graph nodes at the first RUN op that calls
    their graph)."""
    rank = program.rank
    out: list[Problem] = []
    if not program.staged_inputs and any(parse(v).scope == "data" for v in program.inputs):
        out.append(Problem(rank, None, None, "the batch is not staged: each step's microbatches are fresh views of "
                           "the caller's tensor, at addresses a replay does not follow",
                           "lower with the finishing pass static_input_buffers; if it leaves staged_inputs False, "
                           "some value aliasing a data input outlives the step (a graph returns the input itself)"))
    seen: set[str] = set()
    for i, op in enumerate(program.ops):
        reason = op.spec.capture_problem(op, program)
        if reason is not None:
            out.append(Problem(rank, i, None, f"{_short(op)}: {reason}", _op_fix(op)))
        if op.kind is OpKind.RUN and op.args.graph not in seen:
            seen.add(op.args.graph)
            out += _graph_problems(program, op, i)
    return out


def _op_fix(op: Op) -> str:
    """How to make `op` capture-safe: its kind's OpSpec.fix. A kind without one has not decided capture (every
    kind that can refuse has a fix: tests/ir/test_op_specs.py)."""
    return op.spec.fix or f"decide OpSpec.capture for {op.kind.value} (zbcompile/ir/program/ops/)"


def check_capture(programs: Iterable[RankProgram]) -> None:
    """Raise CaptureError listing every problem of every program, if there is any."""
    problems = [p for q in programs for p in capture_problems(q)]
    if problems:
        ranks = sorted({p.rank for p in problems})
        raise CaptureError(f"the step cannot be captured as a CUDA graph: {len(problems)} problem(s) on rank(s) "
                           f"{ranks}\n{problems_table(problems)}")


def problems_table(problems: Sequence[Problem]) -> str:
    from tabulate import tabulate
    rows = [(p.rank, p.where, p.reason, p.fix) for p in problems]
    # names (where) are never wrapped, so that a grep finds them
    return tabulate(rows, headers=("rank", "where", "reason", "fix"), tablefmt="simple",
                    maxcolwidths=[None, None, 60, 50])


def _short(op: Op) -> str:
    text = str(op)
    return text if len(text) <= 80 else text[:77] + "..."


# ---- stage graphs ------------------------------------------------------------------------------------------
_UNSAFE_REASONS = {
    "aten._local_scalar_dense": ".item() / .tolist(): copies a device value to the host, a sync capture forbids "
                                "(and replay would keep the captured value)",
    "aten._assert_scalar": "a data-dependent assert reads a device value on the host",
}


def _graph_problems(program: RankProgram, op: Op, at: int) -> list[Problem]:
    g = program.graph(op)
    key = op.args.graph
    if g.gm is None:
        return [Problem(program.rank, at, key, "the program was read from text without its GraphModules, so the "
                        "stage graph's nodes cannot be checked", "pass graphs= to RankProgram.from_text")]
    on_device = _devices(g.gm) - {"cpu", "meta"}
    out = []
    for node in g.gm.graph.nodes:
        reason = node_problem(node, on_device=bool(on_device))
        if reason is not None:
            out.append(Problem(program.rank, at, f"{key}:{node.name}", f"{node.target}: {reason}", _node_fix(node)))
    return out


def node_problem(node: fx.Node, on_device: bool = False) -> str | None:
    """Why one stage-graph node blocks capture, or None. on_device: the graph runs on a CUDA device (a node
    whose value lives on the CPU then runs on the host, outside the graph)."""
    if node.op != "call_function":
        return None
    from torch._inductor.utils import FORBIDDEN_CUDAGRAPH_OPS, is_cudagraph_unsafe_fx_node
    # torch 2.13's FORBIDDEN_CUDAGRAPH_OPS names some ops by packet ('aten._local_scalar_dense') and compares
    # str(target), which for an aten graph's OpOverload ends in '.default': the packet is checked here too
    if is_cudagraph_unsafe_fx_node(node) or _packet(node) in FORBIDDEN_CUDAGRAPH_OPS:
        return _UNSAFE_REASONS.get(_packet(node), "torch marks it unsafe for CUDA graphs "
                                   "(torch._inductor.utils.is_cudagraph_unsafe_fx_node)")
    vals = _vals(node.meta.get("val"))
    if any(isinstance(d, torch.SymInt) for v in vals for d in (*v.shape, *v.stride())) or \
            isinstance(node.meta.get("val"), torch.SymInt):
        return "symbolic or data-dependent size: a graph replays fixed shapes"
    if _own_generator(node):
        return ("draws random numbers from a torch.Generator of its own, which capture does not register (only "
                "the default CUDA generator is): every replay would repeat the captured draw")
    if on_device and any(v.device.type == "cpu" and v.dim() > 0 for v in vals):
        return "runs on the CPU in a graph on a CUDA device (outside the captured stream)"
    return None


def _packet(node: fx.Node) -> str:
    target = node.target
    return str(target.overloadpacket) if isinstance(target, torch._ops.OpOverload) else str(target)


def _own_generator(node: fx.Node) -> bool:
    """A random op (tagged nondeterministic_seeded) given an explicit generator. torch registers the default
    CUDA generator with every graph it captures, and each replay then advances its offset: dropout and the
    like, which draw from the default generator, get fresh numbers each replay."""
    target = node.target
    if not (isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags):
        return False
    for k, arg in enumerate(target._schema.arguments):
        if arg.name == "generator":
            value = node.args[k] if k < len(node.args) else node.kwargs.get("generator")
            return value is not None
    return False


def _node_fix(node: fx.Node) -> str:
    if _packet(node) in _UNSAFE_REASONS:
        return "keep the value on the device (no .item(), .tolist() or Python branch on a tensor) in the model or loss"
    return "rewrite the model so that this op is not traced into the step, or run without cuda_graphs"


def _vals(val) -> list[torch.Tensor]:
    items = val if isinstance(val, (list, tuple)) else [val]
    return [v for v in items if isinstance(v, torch.Tensor)]


def _devices(gm: fx.GraphModule) -> set[str]:
    return {v.device.type for n in gm.graph.nodes for v in _vals(n.meta.get("val"))}
