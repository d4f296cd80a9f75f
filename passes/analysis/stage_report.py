"""The stage table: what each stage of a StagedModel holds and costs, for `zbcompile.split.report` and the CLI.

    stage  modules          params             F flops    B flops    W flops    F saves    B->W alive
    0      wte, blocks.0-1  <count> (<bytes>)  <FLOPs>    <FLOPs>    <FLOPs>    <bytes>    <bytes>

F/B/W FLOPs come from the cost model (passes/cost.py); "F saves" are the bytes of F's saved:* outputs that are
not parameters or buffers (or views of them: those cost no extra memory, see analysis/aliases.view_base);
"B->W alive" what W reads from F and B. Then the boundary tensors per microbatch and the tied parameter groups.

Reads a zbcompile.ir.stages.StagedModel through its fields only (the IR is a leaf and does not know of it).
"""

from __future__ import annotations

import re
from typing import Sequence

import tabulate

from zbcompile._format import format_bytes, format_flops
from zbcompile.ir.names import Role, role_of
from zbcompile.passes import cost
from zbcompile.passes.analysis.aliases import view_base

__all__ = ["report"]


def _state_aliases(f) -> set[str]:
    """saved:* outputs of F that are parameters / buffers or views of them: they cost no extra memory."""
    state = {ph for name, ph in f.input_nodes().items() if role_of(name) in (Role.PARAM, Role.BUFFER)}
    aliases = set()
    for name, node in zip(f.outputs, f.gm.graph.output_node().args[0]):
        if view_base(node) in state:
            aliases.add(name)
    return aliases


# what W holds: F's and B's saved tensors and the gradients it reads
_W_ALIVE = (Role.SAVED, Role.WSAVED, Role.GRAD_ACT, Role.GRAD_PARAM, Role.GRAD_LOSS)


def _activation_bytes(names: Sequence[str], nodes: Sequence, roles, skip: set[str]) -> int:
    """Bytes of the values with one of `roles` (a graph's inputs or outputs), leaving out `skip`."""
    return sum(cost.value_bytes(n) for name, n in zip(names, nodes) if role_of(name) in roles and name not in skip)


def _param_count(stage) -> tuple[int, int]:
    vals = [ph.meta["val"] for name, ph in stage.f.input_nodes().items() if role_of(name) is Role.PARAM]
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


def report(staged) -> str:
    """A table per stage of `staged` (a StagedModel: modules, params, F/B/W FLOPs, activation bytes) plus the
    boundary tensors and the tied groups."""
    fmt_f, fmt_b = format_flops, format_bytes
    rows = []
    for st in staged.stages:
        count, nbytes = _param_count(st)
        free = _state_aliases(st.f)
        saves = _activation_bytes(st.f.outputs, st.f.gm.graph.output_node().args[0], (Role.SAVED,), free)
        w_alive = _activation_bytes(st.w.inputs, st.w.input_nodes().values(), _W_ALIVE, free)
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
    cuts = staged.meta.get("cuts")
    if cuts and cuts["points"]:
        lines += ["", f"cuts before: {', '.join(cuts['points'])}", f"  why: {cuts['why']}"]
    boundary = [
        (st.index, st.index + 1, s.name, tuple(s.shape), str(s.dtype).replace("torch.", ""), s.requires_grad,
         fmt_b(s.nbytes))
        for st in staged.stages for s in st.send
    ]
    if boundary:
        lines += ["", "boundary tensors (per microbatch)",
                  tabulate.tabulate(boundary, headers=("from", "to", "name", "shape", "dtype", "grad", "bytes"))]
    users: dict[str, list[int]] = {}
    for st in staged.stages:
        for p in st.params:
            users.setdefault(p, []).append(st.index)
    # a module called in several stages (its nodes in each, so in no stage's `modules` column): its parameters
    shared: dict[tuple[int, ...], list[str]] = {}
    aliased = {name for group in staged.tied for name in group}
    for p, stages in users.items():
        if len(stages) > 1 and p not in aliased:
            shared.setdefault(tuple(stages), []).append(p)
    if shared:
        lines += ["", "parameters several stages use (a module called in each; grads summed over them)"]
        lines += [f"  {', '.join(names)}  (stages {list(stages)})" for stages, names in shared.items()]
    if staged.tied:
        lines += ["", "tied parameters (grads summed over the stages that use them)"]
        lines += [f"  {' = '.join(group)}  (stages {users.get(group[0], [])})" for group in staged.tied]
    return "\n".join(lines)
