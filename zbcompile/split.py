"""Public entry: split a model's training step into pipeline stages, each as F, B, W and BW graphs.

    split_model(model, loss_fn, (inputs, targets), num_stages=4)              # balanced automatically
    split_model(model, loss_fn, (inputs, targets), split_points=["blocks.4"])  # cut before these modules

runs the split passes and returns a StagedModel (the stage IR of zbcompile.ir.stages). `report(staged)`
prints per-stage modules, parameters, estimated FLOPs of F / B / W, saved activation bytes
and boundary tensors.

The split side is a list of named, pure passes over the IRs of zbcompile.ir.stages, each result checked
(`.check()`: every graph lints and its names match its placeholders and outputs; stages chain):

    trace             model, loss_fn, example -> Traced        export + functionalize one training step
    [linear_head]     Traced -> Traced                         vocabulary parallelism: a head written as
                                                               `h @ W.T` (+ b) made the one linear op it is
    (choose cuts)     auto_split_points, unless split points are given: a decision, not a rewrite
    partition         Traced -> Partition                      cut the step before each split point
    retarget_stages   Partition -> Partition                   meta traces: tensors made on the example's device
    [shard_vocab]     Partition -> Partition                   vocabulary parallelism (vocab_shards=p): the
                                                               embedding and the output layer + loss cut out
                                                               of the end stages and sharded over the ranks
    split_fbw         Partition -> StagedModel                 differentiate each stage, cut its backward into B, W

A pass with options is a functools.partial (partition's split points), named after the function it binds.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Callable, Mapping, Sequence

import torch
from torch import nn

from zbcompile.errors import PartitionError, SplitError
from zbcompile.passes.analysis.stage_report import report
from zbcompile.passes.choose_cuts import NODE_PREFIX
from zbcompile.passes.partition import (auto_split_points, check_split_points, cut_starts, markers, partition,
                                        split_point_names)
from zbcompile.passes.shard_vocab import find_vocab_layers, shard_vocab
from zbcompile.passes.vocab_head import linear_head
from zbcompile.passes.split_fbw import split_fbw
from zbcompile.passes.trace import retarget_stages, trace
from zbcompile.ir.stages import Partition, StagedModel, Traced

__all__ = ["split_model", "split_traced", "split_passes", "run_split_passes", "report", "autocast_state"]

log = logging.getLogger("zbcompile")

SplitPass = Callable[[Traced | Partition], Partition | StagedModel]


def split_passes(split_points: Sequence[str], vocab_shards: int | None = None) -> tuple[SplitPass, ...]:
    """The passes after the trace, in order, for cuts before `split_points` (see the module docstring);
    with `vocab_shards`, the vocabulary layers are sharded over that many ranks."""
    vocab = (functools.partial(shard_vocab, shards=vocab_shards),) if vocab_shards else ()
    return (
        functools.partial(partition, split_points=tuple(split_points)),
        retarget_stages,
        *vocab,
        split_fbw,
    )


def run_split_passes(traced: Traced, passes: Sequence[SplitPass]) -> StagedModel:
    """Run `passes` from `traced`, checking each result; raises SplitError naming the pass whose result is
    malformed (a zbcompile bug) and whatever error a pass raises on bad input."""
    ir = _checked(traced, "trace")
    for p in passes:
        ir = _checked(p(ir), _name(p))
    return ir


def _checked(ir: Traced | Partition | StagedModel, after: str):
    try:
        return ir.check(after)
    except SplitError as exc:
        raise SplitError(f"{exc}\nfix: none on your side; pass `{after}` returned a malformed result, a zbcompile "
                         "bug: please report it with this message") from exc


def _name(p: SplitPass) -> str:
    return p.func.__name__ if isinstance(p, functools.partial) else p.__name__


def split_model(
    model: nn.Module,
    loss_fn: Callable[..., torch.Tensor],
    example,
    *,
    num_stages: int | None = None,
    split_points: Sequence[str] | None = None,
    placement: Sequence[int] | None = None,
    vocab_shards: int | None = None,
) -> StagedModel:
    """Trace `loss_fn(model(*inputs), *targets)` for `example = (inputs, targets)` and cut it into stages.

    `split_points` are module names to cut BEFORE, in execution order, or `after:<module>`, `pipe_split:<k>`
    (zbcompile.passes.partition), or torch.distributed.pipelining's split_spec, {module: SplitPoint.BEGINNING
    or SplitPoint.END}, in any order. Without them, `pipe_split()` markers the model calls are the split
    points (then num_stages, if given, must be one more than the markers); without those either, `num_stages`
    (default 1, or len(placement)) stages are balanced by estimated training time (forward + backward FLOPs
    and bytes), cutting between children of the model's main repeated container and its ancestors, or inside a
    block where that balances better (before `ln2` or an attention projection; zbcompile.passes.choose_cuts).
    So explicit split points win over markers, and markers over the automatic balance.
    `placement[s]` is the pipeline rank (any group id) that runs stage s: the cuts then balance the summed
    work per rank, e.g. a V over two ranks `placement=(0, 1, 1, 0)`. Placement is ignored with explicit split
    points.
    `vocab_shards=p` shards the input embedding and the output layer + cross-entropy over p ranks
    (passes/shard_vocab.py; VocabError where the step has no such layers); the automatic cuts then balance
    the rest of the model.
    Raises TraceError / PartitionError / SplitError; nothing is half-built.
    """
    spec = split_points
    if split_points is not None:
        split_points = split_point_names(split_points)
        check_split_points(model, split_points)
        if num_stages is not None and num_stages != len(split_points) + 1:
            raise PartitionError(
                f"num_stages={num_stages} disagrees with {len(split_points)} split points "
                f"({len(split_points) + 1} stages); pass one of them"
            )
    elif num_stages is not None and num_stages < 1:
        raise PartitionError(f"num_stages must be at least 1, got {num_stages}")
    elif placement is not None and num_stages is not None and len(placement) != num_stages:
        raise PartitionError(f"placement {list(placement)} has {len(placement)} stages but num_stages={num_stages}")
    started = time.perf_counter()
    traced = trace(model, loss_fn, example)
    log.info("trace: done in %.2f s (%d nodes)", time.perf_counter() - started, len(traced.gm.graph.nodes))
    if isinstance(spec, Mapping):   # a split_spec names modules in no particular order
        split_points = tuple(p for _, p in sorted(zip(cut_starts(traced, split_points), split_points)))
    staged = split_traced(model, traced, num_stages=num_stages, split_points=split_points, placement=placement,
                          vocab_shards=vocab_shards)
    return dataclasses.replace(staged, meta={**staged.meta, "seconds": time.perf_counter() - started,
                                             "autocast": autocast_state(),
                                             "default_dtype": default_dtype_reads(traced)})


def autocast_state() -> tuple[tuple[str, str], ...]:
    """The torch.autocast regions in force, as (device type, dtype) pairs: a step traced under autocast has its
    casts in the graphs, so the compiled step runs as the trace did whatever is in force when it runs."""
    return tuple((d, str(torch.get_autocast_dtype(d)).removeprefix("torch.")) for d in ("cpu", "cuda")
                 if torch.is_autocast_enabled(d))


def default_dtype_reads(traced: Traced) -> tuple[str, str] | None:
    """(the default dtype, an op) where the traced step makes a floating tensor from no tensor without naming its
    dtype (`torch.linspace(0, 1, n)`, `torch.full((n,), 0.5)` in forward): that op reads torch's default dtype
    each time it runs, so the compiled step depends on it. None where no op does."""
    default = torch.get_default_dtype()
    for node in traced.gm.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        val = node.meta.get("val")
        if (node.op == "call_function" and schema is not None and not node.all_input_nodes
                and any(a.name == "dtype" for a in schema.arguments) and node.kwargs.get("dtype") is None
                and isinstance(val, torch.Tensor) and val.dtype == default):
            return str(default).removeprefix("torch."), f"{node.target}"
    return None


def split_traced(
    model: nn.Module, traced: Traced, *, num_stages: int | None = None, split_points: Sequence[str] | None = None,
    placement: Sequence[int] | None = None, vocab_shards: int | None = None,
) -> StagedModel:
    """`split_model` after the trace pass: partition and split an already traced step (cheap to repeat).
    Explicit `split_points` win over the model's pipe_split() markers, and markers over the automatic balance."""
    why = "given (split_points=...)"
    if vocab_shards:   # a head written as `h @ W.T (+ b)`: the one linear op the shards replace
        traced = linear_head(traced)
    if split_points is None:
        if num_stages is None and placement is not None:
            num_stages = len(placement)
        skip, inside = frozenset(), None
        if vocab_shards:   # the vocabulary layers weigh on every rank alike: balance the rest, cut between them
            p = find_vocab_layers(traced.graph, traced.graph)
            skip, inside = frozenset((p.embedding, p.linear, *p.chain, p.loss)), (p.embedding, p.linear)
        split_points = _marked_split_points(traced, num_stages)
        why = "the model's pipe_split() markers"
        if not split_points:
            split_points = auto_split_points(model, traced, num_stages or 1, placement, skip, inside)
            why = _why_automatic(split_points, placement)
    staged = run_split_passes(traced, split_passes(split_points, vocab_shards))
    return dataclasses.replace(staged, meta={**staged.meta, "cuts": {"points": tuple(split_points), "why": why}})


def _why_automatic(points: Sequence[str], placement) -> str:
    """Why the automatic cuts are where they are, for split.report and inspect."""
    per = "per rank of the placement" if placement is not None else "per stage"
    if any(p.startswith(NODE_PREFIX) for p in points):
        return (f"balanced by estimated training time {per}, between ops: the model has fewer cuttable modules "
                f"than the {len(points) + 1} stages (node:<op> cuts before that op of the traced step)")
    return f"balanced by estimated training time {per}, between modules"


def _marked_split_points(traced: Traced, num_stages: int | None) -> tuple[str, ...]:
    """The traced step's pipe_split() markers as split points (none without markers); PartitionError when
    `num_stages` asks for another number of stages than the markers make."""
    marked = markers(traced)
    if marked and num_stages is not None and num_stages != len(marked) + 1:
        raise PartitionError(
            f"the model calls pipe_split() {len(marked)} time{'s' if len(marked) != 1 else ''} "
            f"({len(marked) + 1} stages) but {num_stages} stages were asked for (the schedule's model stages): add or "
            "remove pipe_split() calls, or pass split_points=[...] (explicit split points win over the markers)"
        )
    return marked
