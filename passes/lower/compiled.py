"""compile_graphs: the program's stage graphs run as code a compiler generated (torch inductor: C++ on CPU,
Triton on CUDA) instead of one aten op at a time.

A finishing pass over the graph table, after accumulate_grads and box_graphs have fixed every graph's inputs
and calling convention. Like box_graphs it only marks entries (`ProgramGraph.backend`): `gm` stays the aten
graph, which the alias analysis and the memory plan read, and the emitter builds the compiled form of the
graphs of the one program it emits (every rank lowers every rank's program but runs only its own):

    graph stage0_w_acc = (saved:data_0, grad:act:embedding, acc:grad:param:wte.weight) -> (...) boxed inductor

`compiled_module(g)` is that form: the aten graph re-traced with inductor's decompositions, and torch's own for
the ops inductor has no lowering of (`addmm_` -> `addmm`, `copy_`: the accumulating variants' `acc:` inputs are
still summed into in place, see compute.accumulating_graph),
compiled by `compile_fx_inner` without AOTAutograd in front (the graph is already post-autograd). What it
returns keeps the contract the lowering relies on:

    calling convention  boxed: inputs in one list it empties; each input is dropped after its last use
    aliasing            an output aliases an input only where the aten graph's does (inductor's noop removal
                        refuses to create new input / output aliasing); mutated inputs are mutated in place
    layouts             outputs keep the aten graph's strides; every call asserts its inputs' sizes and strides

One compilation per distinct graph and input layout per process (every microbatch, every rank of a threaded
run and every graph with the same code share it), and across processes inductor's own FX graph cache.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

import torch
from torch import fx, nn

from zbcompile._torch_private import (OpOverload, decompositions, inductor_compile, inductor_decompositions,
                                      inductor_eager_random,
                                      inductor_lowers, make_fx, static_fake_mode, tracing_context)
from zbcompile.errors import LoweringError, UsageError
from zbcompile.ir.program import ProgramGraph, RankProgram

__all__ = ["BACKENDS", "check_backend", "compile_graphs", "compiled_module"]

# backend name -> what it does (the error for an unknown name lists these)
BACKENDS = {"inductor": "torch inductor: C++ kernels on CPU, Triton on CUDA, one compilation per distinct graph"}


def check_backend(backend: str | None) -> str | None:
    """`backend` if it names a known compiler (or is None: the aten graphs run as they are), else UsageError."""
    if backend is not None and backend not in BACKENDS:
        choices = "; ".join(f"{k!r} ({v})" for k, v in BACKENDS.items())
        raise UsageError(f"backend={backend!r} is not a stage-graph compiler zbcompile knows; the choices are "
                         f"{choices}, or None to run the aten stage graphs as they are")
    return backend


def compile_graphs(backend: str):
    """The per-rank pass marking every graph of the table that computes something to run compiled by `backend`
    (and boxed: the compiled form takes its inputs in one list). A graph without ops (a B with nothing to
    compute) stays as it is."""
    check_backend(backend)

    def compile_graphs(program: RankProgram) -> RankProgram:
        return program.replace(graphs={k: dataclasses.replace(g, boxed=True, backend=backend) if _computes(g)
                                       else g for k, g in program.graphs.items()})
    return compile_graphs


def _computes(g: ProgramGraph) -> bool:
    return g.gm is not None and any(n.op == "call_function" for n in g.gm.graph.nodes)


# ---- the compiled form -----------------------------------------------------------------------------------
class CompiledGraph(nn.Module):
    """A compiled stage graph as the emitted program calls it: `forward(inputs)`, boxed. `forward` is the
    compiled callable itself (an instance attribute: no Python frame of ours between program and kernels)."""

    def __init__(self, fn, backend: str):
        super().__init__()
        self.forward = fn
        self.backend = backend


# (backend, graph code, input layouts) -> compiled callable; compilation is serialized, since inductor keeps
# per-compilation global state and the threaded test emits all ranks at once
_COMPILED: dict[tuple, object] = {}
log = logging.getLogger("zbcompile")
_LOCK = threading.Lock()


def compiled_module(g: ProgramGraph, where: str = "") -> CompiledGraph:
    """`g.gm` compiled by `g.backend`, wrapped for the emitter; compiled once per distinct graph. `where` names
    the graph in errors (`rank 0, graph stage0_f`)."""
    inputs = _input_vals(g, where)
    key = _memo_key(g, inputs)
    with _LOCK:
        fn = _COMPILED.get(key)
        if fn is None:   # inductor takes seconds a graph cold (100+ s a model): say what it is doing
            log.info("inductor: compiling %s (%d ops) ...", where or "a stage graph",
                     sum(n.op == "call_function" for n in g.gm.graph.nodes))
            start = time.perf_counter()
            fn = _COMPILED[key] = _inductor(g.gm, inputs, where)
            log.info("inductor: %s done in %.2f s", where or "the stage graph", time.perf_counter() - start)
    return CompiledGraph(fn, g.backend)


def _memo_key(g: ProgramGraph, inputs) -> tuple:
    """Graphs with the same code and input layouts compile to the same thing; a graph holding tensors of its
    own (get_attr) is only itself (its code does not show their values), and the memo keeps it alive."""
    layouts = tuple((tuple(v.shape), v.stride(), v.dtype, str(v.device)) for v in inputs)
    if any(n.op == "get_attr" for n in g.gm.graph.nodes):
        return g.backend, g.gm, layouts
    return g.backend, g.gm.code, layouts


def _input_vals(g: ProgramGraph, where: str) -> list[torch.Tensor]:
    """Each placeholder's traced value (FakeTensor meta["val"]): the shapes, strides and dtypes compiled for."""
    vals = []
    for node in g.gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise LoweringError(f"{where}: input {node.name} carries no traced tensor (meta['val']), so it cannot "
                                f"be compiled; stage graphs come from make_fx / export with meta['val'] on every "
                                f"placeholder (a pass adding one must set it), or compile with backend=None")
        vals.append(val)
    return vals


def _inductor(gm: fx.GraphModule, vals: list[torch.Tensor], where: str):
    """compile_fx_inner on `gm` re-traced with inductor's decompositions, under a fake mode with a ShapeEnv
    (static shapes): without one, inductor's FX graph cache is bypassed and every process compiles anew."""
    mode = static_fake_mode()
    with mode:   # fresh fakes of this mode: the graph's own vals belong to the split's fake modes
        fakes = [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device) for v in vals]
    try:
        with tracing_context(mode), inductor_eager_random():   # dropout: eager's RNG, no rewrite pass needed
            return inductor_compile(_decomposed(gm, fakes), fakes)
    except Exception as e:
        raise LoweringError(f"{where}: inductor could not compile the stage graph ({type(e).__name__}: {e}); "
                            f"compile with backend=None to run it as aten ops") from e


def _decomposed(gm: fx.GraphModule, fakes: list[torch.Tensor]) -> fx.GraphModule:
    """`gm` re-traced with inductor's decompositions plus torch's own for every op inductor has no lowering of:
    the gradient sums' fused `addmm_` becomes `addmm` then `copy_` into the sum, which inductor lowers as a
    mutation of that input (the sum stays in place). Inductor would fall back on such an op, and refuse to
    whenever the environment variable CI is set (GitHub Actions sets it). Ops found only inside a decomposition
    are found on the next round."""
    table = dict(inductor_decompositions())
    traced = make_fx(gm, table)(*fakes)
    for _ in range(_DECOMPOSE_ROUNDS):
        more = decompositions({n.target for n in traced.graph.nodes if isinstance(n.target, OpOverload)
                               and n.target not in table and not inductor_lowers(n.target)})
        if not more:
            break
        table.update(more)
        traced = make_fx(gm, table)(*fakes)
    return traced


# rounds of "trace, decompose what inductor does not lower"; one or two are needed in practice
_DECOMPOSE_ROUNDS = 4
