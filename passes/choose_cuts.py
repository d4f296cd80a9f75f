"""Choosing cuts, the partition's policy: which split points balance the pipeline (passes/partition.py cuts).

    model, Traced, num_stages, placement  ->  split points (module names, in execution order)

Automatic cuts (`auto_split_points`) choose among "units": the children of the model's main repeated container
(the module whose children in the traced step include the most modules of one class, e.g. transformer blocks,
whatever holds them: ModuleList, Sequential, ModuleDict or plain attributes) and of its ancestors, and, inside
each block, its children where the cut sends no more bytes than a cut between blocks (a pre-norm block: before
`ln2`, where only the residual crosses). Leaf modules are never cut inside. A unit weighs its estimated training
time (`_node_time`: forward and backward, FLOPs plus bytes at FLOPS_PER_BYTE). The cuts minimize the heaviest
pipeline rank given the stage -> rank placement (then the heaviest stage); a cut inside a block is taken only
when it lowers the heaviest rank by more than WITHIN_BLOCK_GAIN over the best cut between blocks. Last, each
cut may move into a block next to it, down to the block's grandchildren, where up to REFINE_WIDTH times the
bytes cross (`blocks.7.attn.proj`: the residual and the attention output), one move at a time while a move
lowers the heaviest rank by more than REFINE_GAIN:

    benchmark GPT, 2 ranks     balanced between blocks  ->  refined
    loop (0, 1)                blocks.5                 ->  blocks.5.attn.proj   (heaviest rank, est.: 52.2 -> 50.6%)
    V (0, 1, 1, 0)             .. blocks.7.ln2          ->  .. blocks.7.attn.proj                (50.6 -> 50.3%)
"""

from __future__ import annotations

import itertools
import operator
from collections import Counter
from typing import Sequence

import torch
from torch import fx, nn
from torch.multiprocessing.reductions import StorageWeakRef

from zbcompile.errors import PartitionError
from zbcompile.passes import cost
from zbcompile.passes.analysis.step import constant_nodes, first_positions
from zbcompile.passes.balance import balance_placed, device_loads, group_weights, placement_loads
from zbcompile.ir.names import Role, role_of
from zbcompile.ir.stages import Traced, module_path, module_stack

__all__ = ["auto_split_points", "op_split_points", "op_units", "NODE_PREFIX", "cut_units", "FLOPS_PER_BYTE",
           "BACKWARD_PER_FORWARD", "WITHIN_BLOCK_GAIN", "REFINE_WIDTH", "REFINE_GAIN"]


NODE_PREFIX = "node:"   # "node:<op>": right before that op of the traced step (a cut between ops)

# One byte moved costs about as much time as this many FLOPs. Calibrated on the development CPU (1 thread,
# torch 2.13, the benchmark GPT): matmuls ran at ~65 GFLOP/s and memory-bound elementwise ops moved ~6 GB/s,
# 65 / 6 ~= 11. A GPU's ratio is higher (an H100's roofline ridge is ~300 FLOPs per byte, though small ops stay
# far below peak); re-measure before trusting the balance on another device.
FLOPS_PER_BYTE = 11.0

# Backward ~= 2 forwards (grad wrt input and grad wrt weight each redo the forward's work). Two op families
# break the ratio, measured on the F / B / W graphs of the benchmark GPT:
#   embedding            backward zero-fills and scatter-adds a DENSE [num_embeddings, dim] weight gradient,
#                        however few rows the forward gathered: + the weight's bytes
#   cross_entropy_loss   one composite node in the trace; F materializes the log-probabilities and B writes the
#                        one-hot gradient and runs log_softmax's backward: + ~5 passes over the logits
BACKWARD_PER_FORWARD = 2.0
_CROSS_ENTROPY_EXTRA_PASSES = 5.0

# Take a cut inside a block only when it lowers the heaviest rank by more than this fraction.
WITHIN_BLOCK_GAIN = 0.02

# Then each cut may move into a block next to it, down to the block's grandchildren (`blocks.3.attn.proj`), at
# a point where at most REFINE_WIDTH times the bytes of the widest cut between blocks cross (before a pre-norm
# block's attention projection: the residual and the attention output), while a move lowers the heaviest rank
# by more than REFINE_GAIN. Measured on the benchmark GPT (2 ranks, CPU): the balance between blocks left one
# rank 4-8% busier than the other, and moving a cut before an attention projection (a heaviest-rank estimate
# 0.6-3% lower) shortened the step by 1-4% (ZB-V and ZB-H1, runs alternating between the two splits). The
# extra boundary tensor costs one more P2P message per microbatch each way.
REFINE_WIDTH = 2.0
REFINE_GAIN = 0.005
# A boundary byte is passed over 4 times a microbatch, 2 on each side: the activation sent and received, its
# gradient sent back and received. The refinement charges those passes (at FLOPS_PER_BYTE) to the stages on
# either side of a cut, so a wider cut must pay for its extra bytes (on the benchmark GPT they come to ~0.1%
# of a rank's load; they weigh more where activations are large next to the compute: short hidden sizes,
# long sequences).
_BOUNDARY_PASSES_PER_SIDE = 2.0


def cut_units(model: nn.Module, traced: Traced, *, within_blocks: int = 0) -> list[str]:
    """Module names a cut may go before, in execution order (see the module docstring).

    within_blocks (levels; True = 1) adds the modules that many levels inside each child of the main repeated
    container (1: `blocks.3.ln2`, 2: also `blocks.3.attn.proj`), without checking how much such a cut sends
    (auto_split_points does).
    """
    spine = _spine(traced)
    allowed = set()
    for name, module in model.named_modules():
        if name == spine or (spine.startswith(name + ".") if name else True):
            for child, _ in module.named_children():
                allowed.add(f"{name}.{child}" if name else child)
    if within_blocks and spine:
        for block, module in model.get_submodule(spine).named_children():
            allowed.update(f"{spine}.{block}.{name}" for name, _ in module.named_modules()
                           if name and name.count(".") < int(within_blocks))
    first = first_positions(traced)
    units: dict[int, str] = {}
    for position, name in sorted((first[n], n) for n in allowed if n in first):
        units.setdefault(position, name)  # modules starting at the same node are the same cut
    return list(units.values())


def _spine(traced: Traced) -> str:
    """The main repeated container: the module with the most children of one class, as the traced step ran
    them, preferring classes with modules of their own (transformer blocks over a block's four Linears), then
    containers that never run themselves (a ModuleList of blocks over a model holding an encoder and a decoder
    of one class), then the shallowest; '' (the model) when nothing repeats.

    Read from the graph's module stacks rather than from container types, so blocks held in an nn.ModuleDict
    (torchtitan's layout), a ModuleList, a Sequential or plain attributes are found alike; the container itself
    need not appear in the trace (a ModuleDict is never called).
    """
    children: dict[str, dict[str, str]] = {}   # parent path -> {child path: class}
    for node in traced.gm.graph.nodes:
        for path, kind in module_stack(node):
            if path:
                children.setdefault(path.rpartition(".")[0], {})[path] = kind
    ran = {child for kinds in children.values() for child in kinds} | {""}
    # modules with modules of their own that ran (perhaps behind a container: T5Block.layer is a ModuleList)
    outer = {path[:i] for path in ran for i, c in enumerate(path) if c == "."}
    best, best_key = "", (False, 1, False, 0)
    for parent, kinds in children.items():
        kind, count = Counter(kinds.values()).most_common(1)[0]
        inner = any(child in outer for child, k in kinds.items() if k == kind)
        key = (inner, count, parent not in ran, -_depth(parent))
        if key > best_key:
            best, best_key = parent, key
    return best


def _depth(path: str) -> int:
    return path.count(".") + 1 if path else 0


def auto_split_points(model: nn.Module, traced: Traced, num_stages: int,
                      placement: Sequence[int] | None = None, skip: frozenset[fx.Node] = frozenset(),
                      inside: tuple[fx.Node, fx.Node] | None = None) -> tuple[str, ...]:
    """Split points for `num_stages` stages balanced by estimated training time over `cut_units`.

    placement[s] is the rank (any group id) running stage s; without it every stage is its own rank. The cuts
    minimize the heaviest rank's summed weight, then the heaviest stage's. Nodes in `skip` weigh nothing: their
    work is not the stages' (the vocabulary layers, which vocabulary parallelism spreads over every rank).
    With `inside=(a, b)` every cut falls after node a and before node b (a stays in the first stage, b in the
    last: the embedding lookup and the output layer, which vocabulary parallelism takes out of those stages).
    """
    placement = tuple(range(num_stages)) if placement is None else tuple(placement)
    if len(placement) != num_stages:
        raise PartitionError(f"placement {list(placement)} names {len(placement)} stages but {num_stages} were "
                             "asked for: give one rank per stage")
    if num_stages == 1:
        return ()
    coarse = _within(traced, cut_units(model, traced), inside)
    if len(coarse) < num_stages:   # too few modules: cut between ops
        return op_split_points(traced, num_stages, placement, skip, inside)
    units = _narrow_units(traced, coarse, _within(traced, cut_units(model, traced, within_blocks=True), inside))
    coarse_set = set(coarse)
    weights = _unit_weights(traced, units, skip)
    between = [i for i, u in enumerate(units) if u in coarse_set]  # units[0] is always one
    coarse_weights = [sum(weights[a:b]) for a, b in itertools.pairwise((*between, len(units)))]
    coarse_cuts = balance_placed(coarse_weights, placement)
    cuts = tuple(between[i] for i in coarse_cuts)
    if len(units) > len(coarse):
        fine_cuts = balance_placed(weights, placement)
        fine = max(placement_loads(weights, fine_cuts, placement).values())
        if fine < (1 - WITHIN_BLOCK_GAIN) * max(placement_loads(coarse_weights, coarse_cuts, placement).values()):
            cuts = fine_cuts
    chosen = [units[i] for i in cuts]
    return _refine(traced, coarse, chosen, _within(traced, cut_units(model, traced, within_blocks=2), inside),
                   placement, skip)


def op_split_points(traced: Traced, num_stages: int, placement: Sequence[int] | None = None,
                    skip: frozenset[fx.Node] = frozenset(),
                    inside: tuple[fx.Node, fx.Node] | None = None) -> tuple[str, ...]:
    """Split points for `num_stages` stages between any two ops of the step, for a model whose modules are too
    few (a model of three Linears, a few ops in one forward): before each computed op (a module's name where one
    begins there, else `node:<op>`), balanced by estimated training time as the module cuts are, charging each
    cut the bytes it sends. PartitionError only where the step has fewer ops than stages."""
    placement = tuple(range(num_stages)) if placement is None else tuple(placement)
    starts, names = op_units(traced, inside)
    if len(starts) < num_stages:
        raise PartitionError(f"cannot cut the training step into {num_stages} stages: it computes only "
                             f"{len(starts)} ops a cut can go before ({', '.join(names) or 'none'}); use fewer "
                             "stages (a schedule with fewer model stages, or fewer ranks)")
    weights = _position_weights(traced, starts, skip)
    width = _boundary_bytes(traced)
    transfer = [_BOUNDARY_PASSES_PER_SIDE * FLOPS_PER_BYTE * width[p] for p in starts]
    cuts = balance_placed([w for w in weights], placement)
    best = _heaviest_with_transfer(weights, cuts, placement, transfer)
    # the balance ignored what each cut sends: move a cut to a neighbour while that lowers the heaviest rank
    cuts = list(cuts)
    improved = True
    while improved:
        improved = False
        for k in range(len(cuts)):
            lo, hi = (cuts[k - 1] if k else 0) + 1, (cuts[k + 1] if k + 1 < len(cuts) else len(starts)) - 1
            for j in (cuts[k] - 1, cuts[k] + 1):
                if lo <= j <= hi:
                    score = _heaviest_with_transfer(weights, cuts[:k] + [j] + cuts[k + 1:], placement, transfer)
                    if score < best:
                        best, cuts[k], improved = score, j, True
    return tuple(names[c] for c in cuts)


def op_units(traced: Traced, inside: tuple[fx.Node, fx.Node] | None = None) -> tuple[list[int], list[str]]:
    """(graph positions, split point names) where a cut between ops may go, in order: before every computed op
    up to the loss (constants are recomputed where used; views and an op's tuple results stay with it), named by the
    outermost module that begins there or as `node:<op>`; the first is the start of the step."""
    const = constant_nodes(traced)
    nodes = list(traced.gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    loss = dict(zip(traced.graph.outputs, traced.gm.graph.output_node().args[0]))["loss"]
    module_at: dict[int, str] = {}
    first = first_positions(traced)
    for path, i in sorted(first.items(), key=lambda kv: (kv[1], _depth(kv[0]))):
        module_at.setdefault(i, path)
    lo, hi = (position[inside[0]], position[inside[1]]) if inside is not None else (-1, len(nodes))
    blocked = _inside([*_view_spans(nodes, position, const), *_buffer_update_spans(traced, position)], len(nodes))
    starts, names = [], []
    for i, node in enumerate(nodes[:position[loss] + 1]):
        if node.op != "call_function" or const[node] or not _computes(node) or (starts and blocked[i]):
            continue
        if starts and not lo < i < hi:
            continue
        # a module's name where the module begins here (its first node may be a view just before this op)
        begins = [m for m in module_path(node) if m and (starts[-1] if starts else -1) < first.get(m, -1) <= i]
        starts.append(i)
        names.append(module_at.get(i) or (begins[0] if begins else f"{NODE_PREFIX}{node.name}"))
    return starts, names


def _view_spans(nodes: Sequence[fx.Node], position: dict, const) -> list[tuple[int, int]]:
    """(first, last) spans a cut inside would send a view across (a view of the sending stage's input would be
    a stage output aliasing an input, which the stage's backward cannot be traced for)."""
    spans = []
    for i, node in enumerate(nodes):
        if node.op != "call_function" or const[node]:
            continue
        view = _aliases(node) or (node.target is operator.getitem and _aliases(node.args[0]))
        last = max((position[u] for u in node.users if u.op != "output"), default=i)
        if view and last > i:
            spans.append((i, last))
    return spans


def _buffer_update_spans(traced: Traced, position: dict) -> list[tuple[int, int]]:
    """(first, last) spans a cut inside would split a buffer the forward updates across: its reads and the op
    making its new value must fall in one stage (partition refuses a buffer updated in one stage and read in
    another: the updates could not keep eager's order), e.g. `mean.mul_(0.9).add_(x, alpha=0.1)`'s two ops."""
    spans = []
    placeholders = dict(zip(traced.graph.inputs, traced.gm.graph.find_nodes(op="placeholder")))
    for name, new in zip(traced.graph.outputs, traced.gm.graph.output_node().args[0]):
        if role_of(name) is not Role.BUFFER or name not in placeholders:
            continue
        span = [position[u] for u in placeholders[name].users if u.op != "output"]
        span += [position[new]] if isinstance(new, fx.Node) and new.op != "placeholder" else []
        if span:
            spans.append((min(span), max(span)))
    return spans


def _inside(spans: Sequence[tuple[int, int]], length: int) -> list[bool]:
    """Per graph position, whether it lies inside one of `spans` (after its first position, up to its last)."""
    delta = [0] * (length + 2)
    for first, last in spans:
        delta[first + 1] += 1
        delta[last + 1] -= 1
    return [c > 0 for c in itertools.accumulate(delta)]


def _computes(node: fx.Node) -> bool:
    """A cut may go before this node: it makes a tensor of its own, not a view or one of a tuple's results (a
    stage that began with a view could return a view of its own input), and something reads it."""
    return node.target is not operator.getitem and bool(node.users) and not _aliases(node)


def _aliases(node: fx.Node) -> bool:
    """The op returns a view of an argument (view, expand, broadcast_tensors, ...): its schema says so, or its
    traced result shares an argument's storage (composite ops such as broadcast_tensors annotate nothing)."""
    schema = getattr(node.target, "_schema", None)
    if schema is not None and any(r.alias_info is not None for r in schema.returns):
        return True
    out = node.meta.get("val")
    results = out if isinstance(out, (tuple, list)) else (out,)
    storages = {_storage(a.meta.get("val")) for a in node.all_input_nodes} - {None}
    return any(_storage(r) in storages for r in results)


def _storage(val):
    if not isinstance(val, torch.Tensor):
        return None
    try:
        return StorageWeakRef(val.untyped_storage())
    except (RuntimeError, NotImplementedError):   # a tensor without storage (a sparse or wrapper tensor)
        return None


def _position_weights(traced: Traced, starts: Sequence[int], skip: frozenset[fx.Node]) -> list[float]:
    """Estimated training time of the nodes from each start up to the next one (the first start takes what is
    before it too)."""
    weights = [0.0] * len(starts)
    k = 0
    for i, node in enumerate(traced.gm.graph.nodes):
        while k + 1 < len(starts) and starts[k + 1] <= i:
            k += 1
        if node.op == "call_function" and node not in skip:
            weights[k] += _node_time(node)
    return weights


def _within(traced: Traced, units: list[str], inside: tuple[fx.Node, fx.Node] | None) -> list[str]:
    """`units` (the first always kept) whose cut falls after inside[0] and before inside[1]."""
    if inside is None:
        return units
    position = {n: i for i, n in enumerate(traced.gm.graph.nodes)}
    lo, hi = position[inside[0]], position[inside[1]]
    first = first_positions(traced)
    return units[:1] + [u for u in units[1:] if lo < first[u] < hi]


def _refine(traced: Traced, coarse: Sequence[str], chosen: Sequence[str], finest: Sequence[str],
            placement: Sequence[int], skip: frozenset[fx.Node] = frozenset()) -> tuple[str, ...]:
    """`chosen` cuts, each moved inside the blocks next to it while that lowers the heaviest rank by more than
    REFINE_GAIN (see REFINE_WIDTH). A cut stays between the block boundaries around it, so the stages keep the
    sizes the balance gave them; one best move at a time, until none helps."""
    first = first_positions(traced)
    width = _boundary_bytes(traced)
    units = _narrow_units(traced, coarse, finest, factor=REFINE_WIDTH, keep=chosen)
    weights = _unit_weights(traced, units, skip)
    transfer = [_BOUNDARY_PASSES_PER_SIDE * FLOPS_PER_BYTE * width[first[u]] for u in units]
    index = {u: i for i, u in enumerate(units)}
    walls = [index[u] for u in coarse] + [len(units)]
    cuts = [index[u] for u in chosen]

    def heaviest(cs: Sequence[int]) -> tuple[float, float]:
        return _heaviest_with_transfer(weights, cs, placement, transfer)

    best = heaviest(cuts)
    while True:
        moves = []
        for k, c in enumerate(cuts):
            lo = max([w for w in walls if w < c] + [cuts[k - 1] if k else 0])
            hi = min([w for w in walls if w > c] + [cuts[k + 1] if k + 1 < len(cuts) else len(units)])
            moves += [(heaviest(cuts[:k] + [j] + cuts[k + 1:]), k, j) for j in range(lo + 1, hi) if j != c]
        if not moves:
            break
        score, k, j = min(moves)
        if score[0] >= (1 - REFINE_GAIN) * best[0]:
            break
        best, cuts[k] = score, j
    return tuple(units[c] for c in cuts)


def _heaviest_with_transfer(weights: Sequence[float], cuts: Sequence[int], placement: Sequence[int],
                            transfer: Sequence[float]) -> tuple[float, float]:
    """(heaviest rank, heaviest stage) for `cuts`, the cut at unit c charging transfer[c] to both its sides."""
    groups = list(group_weights(weights, cuts))
    for g, c in enumerate(cuts):   # cut g sits between stages g and g + 1
        groups[g] += transfer[c]
        groups[g + 1] += transfer[c]
    return max(device_loads(groups, placement).values()), max(groups)


def _narrow_units(traced: Traced, coarse: Sequence[str], fine: Sequence[str], *, factor: float = 1.0,
                  keep: Sequence[str] = ()) -> list[str]:
    """`fine` without the within-block cuts that would send more than `factor` times the bytes of the widest
    cut between units (`coarse` and `keep` stay whatever they send)."""
    first = first_positions(traced)
    width = _boundary_bytes(traced)
    limit = factor * max((width[first[u]] for u in coarse[1:]), default=0)
    kept = set(coarse) | set(keep)
    return [u for u in fine if u in kept or width[first[u]] <= limit]


def _boundary_bytes(traced: Traced) -> list[float]:
    """Per graph position p, bytes of the computed values made before p and read at or after p."""
    const = constant_nodes(traced)
    nodes = list(traced.gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    delta = [0.0] * (len(nodes) + 2)
    for i, node in enumerate(nodes):
        if node.op != "call_function" or const[node]:
            continue
        last = max((position[u] for u in node.users if u.op != "output"), default=i)
        if last > i:
            nbytes = float(cost.value_bytes(node))
            delta[i + 1] += nbytes
            delta[last + 1] -= nbytes
    return list(itertools.accumulate(delta))


def _unit_weights(traced: Traced, units: Sequence[str], skip: frozenset[fx.Node] = frozenset()) -> list[float]:
    """Estimated training time (`_node_time`) of the nodes from each unit's first node up to the next unit's."""
    starts = {name: i for i, name in enumerate(units)}
    weights = [0.0] * len(units)
    current = 0
    for node in traced.gm.graph.nodes:
        for path in module_path(node):
            if path in starts and starts[path] >= current:
                current = starts[path]
        if node.op == "call_function" and node not in skip:
            weights[current] += _node_time(node)
    return weights


def _node_time(node: fx.Node) -> float:
    """Forward + backward time of one node in FLOP-equivalents (see FLOPS_PER_BYTE, BACKWARD_PER_FORWARD)."""
    c = cost.node_cost(node)
    # one FLOP per node keeps free modules (embeddings, dropout) from weighing nothing
    forward = float(c.flops) + FLOPS_PER_BYTE * float(c.bytes) + 1.0
    extra = 0.0
    if node.target is torch.ops.aten.embedding.default:
        extra = float(cost.value_bytes(node.args[0]))
    elif node.target is torch.ops.aten.cross_entropy_loss.default:
        extra = _CROSS_ENTROPY_EXTRA_PASSES * float(cost.value_bytes(node.args[0]))
    return (1.0 + BACKWARD_PER_FORWARD) * forward + FLOPS_PER_BYTE * extra
