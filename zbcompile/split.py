"""Public entry: split a model's training step into pipeline stages, each as F, B, W and BW graphs.

    split_model(model, loss_fn, (inputs, targets), num_stages=4)              # balanced automatically
    split_model(model, loss_fn, (inputs, targets), split_points=["blocks.4"])  # cut before these modules

runs the passes  trace -> partition -> split_fbw  (see zbcompile.passes) and returns a StagedModel (the stage
IR of zbcompile.stages). `report(staged)` / `staged.report()` prints per-stage modules, parameters, estimated
FLOPs of F / B / W, saved activation bytes and boundary tensors.
"""

from __future__ import annotations

import dataclasses
import re
import time
from typing import Callable, Mapping, Sequence

import tabulate
import torch
from torch import nn

from zbcompile.errors import PartitionError
from zbcompile.passes import cost
from zbcompile.passes.analysis.aliases import view_base
from zbcompile.passes.partition import StageGraph, auto_split_points, check_split_points, partition
from zbcompile.passes.split_fbw import StageProgram, split_stage
from zbcompile.passes.trace import Traced, retarget_device, trace
from zbcompile.stages import Graph, Stage, StagedModel, TensorSpec

__all__ = ["split_model", "split_traced", "report"]


def split_model(
    model: nn.Module,
    loss_fn: Callable[..., torch.Tensor],
    example,
    *,
    num_stages: int | None = None,
    split_points: Sequence[str] | None = None,
    placement: Sequence[int] | None = None,
) -> StagedModel:
    """Trace `loss_fn(model(*inputs), *targets)` for `example = (inputs, targets)` and cut it into stages.

    `split_points` are module names to cut BEFORE, in execution order; without them, `num_stages` (default 1,
    or len(placement)) stages are balanced by estimated training time (forward + backward FLOPs and bytes),
    cutting between children of the model's main repeated container and its ancestors, or inside a block
    where that balances better (before `ln2` or an attention projection; zbcompile.passes.partition).
    `placement[s]` is the pipeline rank (any group id) that runs stage s: the cuts then balance the summed
    work per rank, e.g. a V over two ranks `placement=(0, 1, 1, 0)`. Placement is ignored with explicit split
    points.
    Raises TraceError / PartitionError / SplitError; nothing is half-built.
    """
    if split_points is not None:
        split_points = tuple(split_points)
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
    staged = split_traced(model, traced, num_stages=num_stages, split_points=split_points, placement=placement)
    return StagedModel(staged.stages, staged.num_inputs, staged.num_targets, staged.tied,
                       {**staged.meta, "seconds": time.perf_counter() - started})


def split_traced(
    model: nn.Module, traced: Traced, *, num_stages: int | None = None, split_points: Sequence[str] | None = None,
    placement: Sequence[int] | None = None,
) -> StagedModel:
    """`split_model` after the trace pass: partition and split an already traced step (cheap to repeat)."""
    if split_points is None:
        if num_stages is None and placement is not None:
            num_stages = len(placement)
        split_points = auto_split_points(model, traced, num_stages or 1, placement)
    cut = partition(traced, split_points)
    grads: dict[str, bool] = {}
    stages = []
    for sg in cut.stages:
        if traced.device is not None:  # traced on meta: differentiate on the device the graphs will run on
            sg = dataclasses.replace(sg, gm=retarget_device(sg.gm, traced.device))
        program = split_stage(sg, lambda name: _requires_grad(name, traced, grads), device=traced.device)
        grads.update({n: v for n, v in program.requires_grad.items() if n.startswith("act:")})
        stages.append(_stage(sg, program))
    meta = {"split_points": tuple(split_points)}
    return StagedModel(tuple(stages), traced.num_inputs, traced.num_targets, traced.tied, meta)


def _requires_grad(name: str, traced: Traced, acts: Mapping[str, bool]) -> bool:
    if name.startswith("param:"):
        return name[len("param:") :] not in traced.frozen
    if name.startswith("act:"):
        return acts[name]
    return False  # buffers and user data


def _stage(sg: StageGraph, program: StageProgram) -> Stage:
    in_vals = {name: ph.meta["val"] for name, ph in zip(sg.inputs, sg.gm.graph.find_nodes(op="placeholder"))}
    out_vals = {name: n.meta["val"] for name, n in zip(sg.outputs, sg.gm.graph.output_node().args[0])}
    rg = program.requires_grad

    def spec(name: str, val: torch.Tensor) -> TensorSpec:
        return TensorSpec(name, tuple(int(d) for d in val.shape), val.dtype, rg[name])

    return Stage(
        index=sg.index,
        f=program.f,
        b=program.b,
        w=program.w,
        bw=program.bw,
        params=tuple(n[len("param:") :] for n in sg.inputs if n.startswith("param:")),
        buffers=tuple(n[len("buffer:") :] for n in sg.inputs if n.startswith("buffer:")),
        recv=tuple(spec(n, v) for n, v in in_vals.items() if n.startswith("act:")),
        send=tuple(spec(n, v) for n, v in out_vals.items() if n.startswith("act:")),
        data=tuple(int(n[len("data:") :]) for n in sg.inputs if n.startswith("data:")),
        modules=sg.modules,
        has_loss="loss" in sg.outputs,
    )


# ---------------------------------------------------------------------------------------------------------------
# Report


def _state_aliases(f: Graph) -> set[str]:
    """saved:* outputs of F that are parameters / buffers or views of them: they cost no extra memory."""
    state = {ph for name, ph in f.input_nodes().items() if name.startswith(("param:", "buffer:"))}
    aliases = set()
    for name, node in zip(f.outputs, f.gm.graph.output_node().args[0]):
        if view_base(node) in state:
            aliases.add(name)
    return aliases


def _activation_bytes(names: Sequence[str], nodes: Sequence, prefixes, skip: set[str]) -> int:
    """Bytes of the values named with `prefixes` (a graph's inputs or outputs), leaving out `skip`."""
    return sum(cost.value_bytes(n) for name, n in zip(names, nodes) if name.startswith(prefixes) and name not in skip)


def _param_count(stage: Stage) -> tuple[int, int]:
    vals = [ph.meta["val"] for name, ph in stage.f.input_nodes().items() if name.startswith("param:")]
    return sum(v.numel() for v in vals), sum(v.numel() * v.element_size() for v in vals)


def _compact(modules: Sequence[str]) -> str:
    """['blocks.0', 'blocks.1', 'blocks.2', 'ln_f'] -> 'blocks.0-2, ln_f'."""
    parts: list[list] = []
    for m in modules:
        match = re.fullmatch(r"(.*\.)(\d+)", m)
        if match and parts and parts[-1][0] == match[1] and parts[-1][2] == int(match[2]) - 1:
            parts[-1][2] = int(match[2])
        elif match:
            parts.append([match[1], int(match[2]), int(match[2])])
        else:
            parts.append([m, None, None])
    text = [p[0] if p[1] is None else f"{p[0]}{p[1]}" + (f"-{p[2]}" if p[2] != p[1] else "") for p in parts]
    return ", ".join(text)


def report(staged: StagedModel) -> str:
    """A table per stage (modules, params, F/B/W FLOPs, activation bytes) plus boundaries and tied groups."""
    fmt_f, fmt_b = cost.format_flops, cost.format_bytes
    rows = []
    for st in staged.stages:
        count, nbytes = _param_count(st)
        free = _state_aliases(st.f)
        saves = _activation_bytes(st.f.outputs, st.f.gm.graph.output_node().args[0], "saved:", free)
        w_alive = _activation_bytes(st.w.inputs, st.w.input_nodes().values(), ("saved:", "wsaved:", "grad:"), free)
        rows.append((
            st.index,
            _compact(st.modules),
            f"{count:,} ({fmt_b(nbytes)})",
            fmt_f(cost.graph_cost(st.f.gm).flops),
            fmt_f(cost.graph_cost(st.b.gm).flops),
            fmt_f(cost.graph_cost(st.w.gm).flops),
            fmt_b(saves),
            fmt_b(w_alive),
        ))
    headers = ("stage", "modules", "params", "F flops", "B flops", "W flops", "F saves", "B->W alive")
    lines = [tabulate.tabulate(rows, headers=headers)]
    boundary = [
        (st.index, st.index + 1, s.name, tuple(s.shape), str(s.dtype).replace("torch.", ""), s.requires_grad,
         fmt_b(s.nbytes))
        for st in staged.stages for s in st.send
    ]
    if boundary:
        lines += ["", "boundary tensors (per microbatch)",
                  tabulate.tabulate(boundary, headers=("from", "to", "name", "shape", "dtype", "grad", "bytes"))]
    if staged.tied:
        users = {}
        for st in staged.stages:
            for p in st.params:
                users.setdefault(p, []).append(st.index)
        lines += ["", "tied parameters (grads summed over the stages that use them)"]
        lines += [f"  {' = '.join(group)}  (stages {users.get(group[0], [])})" for group in staged.tied]
    return "\n".join(lines)
