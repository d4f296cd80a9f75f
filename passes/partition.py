"""Pass 2, partition: cut the traced step into pipeline stages by module boundaries.

    Traced, split_points  ->  Partition(stages=(Graph, ...))       (zbcompile.ir.stages)

A split point is a module name; the cut goes right BEFORE the first node the module computes. Two more forms
cover the split points users already wrote for torch.distributed.pipelining: `after:<module>` cuts right after
the module's last node (`SplitPoint.END` in a `split_spec`; `split_point_names` converts a split_spec), and
`pipe_split:<k>` cuts at the k-th `pipe_split()` marker the model calls (the trace keeps the markers as
`pippy._pipe_split` nodes; they compute nothing and are never copied into a stage), and `node:<op>` right
before an op of the traced step (the automatic cuts between ops, for models with too few modules). Nodes are assigned in
graph (= execution) order: a running stage counter advances at the first node of the next split point
(modules read from `meta["nn_module_stack"]`). So everything between two split points, including
top-level glue code, lands in the earlier stage, and the loss lands in the last one.

    graph order:  arange  embedding ... | blocks.2 ...         | blocks.4 ... ln_f lm_head loss
    stage:        0 (constant)  0       | 1  (split blocks.2)  | 2  (split blocks.4)

Constant nodes (depending on no data and no parameter: arange, causal masks, lifted constants; buffers count
as constant inputs) are not sent between stages: each stage that uses one recomputes it (with its constant
ancestors). Random ops are never constants. A constant that is also a step output (`num_batches_tracked + 1`)
is owned by exactly one stage, the one its module belongs to, so the buffer updates exactly once.

A value produced in stage i and read by stage j > i travels as `act:<node name>` through every stage in
between (received and re-sent unchanged: a pass-through). Each stage is a Graph (index, passthrough and
modules set): a functional fx graph whose placeholders and outputs carry value names (params, buffers, data,
received acts in; sent acts, loss, updated buffers out).

The split points come from the caller or from `zbcompile.passes.choose_cuts` (the policy: which cuts balance
the pipeline); this module only cuts. `auto_split_points`, `cut_units` and `FLOPS_PER_BYTE` are re-exported here.
"""

from __future__ import annotations

import bisect
import difflib
from typing import Iterable, Mapping, Sequence

from torch import fx, nn

from zbcompile._torch_private import OpOverload
from zbcompile.errors import PartitionError
from zbcompile.ir.names import Role, role_of
from zbcompile.passes.analysis.step import constant_nodes
# re-exported so that the chooser stays importable from here; cutting itself never calls it
from zbcompile.passes.graph_walk import ancestors
from zbcompile.passes.choose_cuts import FLOPS_PER_BYTE, NODE_PREFIX, auto_split_points, cut_units
from zbcompile.ir.stages import Graph, Partition, Traced, module_path

__all__ = ["partition", "check_split_points", "split_point_names", "markers", "cut_starts", "auto_split_points",
           "cut_units", "module_path", "FLOPS_PER_BYTE"]


MARKER_PREFIX = "pipe_split:"   # "pipe_split:<k>": at the k-th pipe_split() marker of the traced step
AFTER_PREFIX = "after:"         # "after:<module>": right after the module's last node (SplitPoint.END)
_PIPE_SPLIT = "pippy::_pipe_split"


def split_point_names(split_points) -> tuple[str, ...]:
    """Split points as names: a sequence of names passes through; torch.distributed.pipelining's `split_spec`
    ({module: SplitPoint.BEGINNING or SplitPoint.END}) becomes `<module>` / `after:<module>`, in its order."""
    if not isinstance(split_points, Mapping):
        return tuple(split_points)
    names = []
    for module, where in split_points.items():
        kind = getattr(where, "name", where)
        if kind not in ("BEGINNING", "END"):
            raise PartitionError(f"split_spec[{module!r}] is {where!r}: use torch.distributed.pipelining's "
                                 "SplitPoint.BEGINNING (cut before the module) or SplitPoint.END (cut after it)")
        names.append(module if kind == "BEGINNING" else AFTER_PREFIX + module)
    return tuple(names)


def markers(traced: Traced) -> tuple[str, ...]:
    """The split points the model wrote itself: one `pipe_split:<k>` per pipe_split() call in the traced step."""
    return tuple(f"{MARKER_PREFIX}{k}" for k, _ in enumerate(_marker_nodes(traced)))


def _marker_nodes(traced: Traced) -> list[fx.Node]:
    return [n for n in traced.gm.graph.nodes
            if isinstance(n.target, OpOverload) and n.target.name() == _PIPE_SPLIT]


def check_split_points(model: nn.Module, split_points: Sequence[str]) -> None:
    """Raise PartitionError for a split point naming no module of `model` (with close names) or a repeated one;
    `pipe_split:<k>` markers are checked against the trace (`partition`)."""
    names = [n for n, _ in model.named_modules() if n]
    known = set(names)
    for point in split_points:
        if point.startswith((MARKER_PREFIX, NODE_PREFIX)):   # checked against the trace (cut_starts)
            continue
        module = point.removeprefix(AFTER_PREFIX)
        if module not in known:
            close = difflib.get_close_matches(module, names, n=5, cutoff=0.5)
            hint = f"; close names: {', '.join(close)}" if close else ""
            raise PartitionError(f"unknown split point `{point}`: the model has no module `{module}`{hint}")
    if len(set(split_points)) != len(split_points):
        raise PartitionError(f"split points repeat a module: {list(split_points)}")


def partition(traced: Traced, split_points: Sequence[str]) -> Partition:
    """Cut `traced` before each of `split_points` (in execution order): module names, `after:<module>` or
    `pipe_split:<k>` markers."""
    stage_of = _assign(traced, tuple(split_points))
    const = constant_nodes(traced)
    graph = traced.gm.graph
    num_stages = len(split_points) + 1
    output = graph.output_node()
    out_values = dict(zip(traced.graph.outputs, output.args[0], strict=True))
    loss = out_values["loss"]
    if stage_of[loss] != num_stages - 1:
        raise PartitionError(
            f"the loss is computed in stage {stage_of[loss]} but the last stage is {num_stages - 1}: "
            f"split point `{split_points[stage_of[loss]]}` runs after the loss"
        )
    last_use = _last_use(graph, stage_of, const, out_values)
    modules = _stage_modules(graph, stage_of, const, num_stages)
    stages = []
    for s in range(num_stages):
        owned = [n for n in graph.nodes if n.op == "call_function" and not const[n] and stage_of[n] == s]
        if not owned:
            bounds = ("<start>",) + tuple(split_points) + ("<end>",)
            raise PartitionError(
                f"stage {s} would be empty: no work between `{bounds[s]}` and `{bounds[s + 1]}` "
                f"(split points {list(split_points)}); drop one of them"
            )
        stages.append(_build_stage(traced, s, stage_of, const, last_use, out_values, modules[s]))
    _check_buffers_on_one_stage(stages, split_points)
    return Partition(tuple(stages), tuple(split_points), traced)


def _check_buffers_on_one_stage(stages: Sequence[Graph], split_points: Sequence[str]) -> None:
    """PartitionError for a buffer the forward updates in one stage and reads in another (one BatchNorm module
    called in the first and in the last stage). Eager updates it microbatch by microbatch, each call reading the
    value the previous call left; the pipeline runs a stage's microbatch i+1 before a later stage has run
    microbatch i (and the stages may be on different ranks, each holding its own copy), so no schedule keeps that
    order: the buffer would end wrong, or the rank writing it would not hold it."""
    readers: dict[str, list[int]] = {}
    for st in stages:   # a stage that lists a buffer but computes nothing from it (its new value comes as an
        # activation; a dead copy of a cheap op) reads none
        live = ancestors(st.gm.graph.output_node().all_input_nodes)
        for name, ph in zip(st.inputs, st.gm.graph.find_nodes(op="placeholder")):
            if role_of(name) is Role.BUFFER and ph in live:
                readers.setdefault(name, []).append(st.index)
    for st in stages:
        for name in st.outputs:
            others = [s for s in readers.get(name, ()) if s != st.index]
            if role_of(name) is not Role.BUFFER or not others:
                continue
            fqn = name[len(Role.BUFFER.value):]
            owner = fqn.rpartition(".")[0]
            where = f"module `{owner}`" if owner else "the model's own forward"
            used = " and ".join(map(str, sorted({st.index, *others})))
            raise PartitionError(
                f"buffer `{fqn}` is updated by the forward in stage {st.index} and read in stage"
                f"{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} too (the uses of {where} fall in "
                f"stages {used} of the cuts {list(split_points)}): eager updates it microbatch by microbatch, each "
                "use reading what the previous one left, but a pipeline runs an earlier stage's next microbatch "
                "before a later stage has finished this one (and the stages may be on different ranks), so the "
                "updates cannot keep eager's order. Fix: cut so that every use of it falls in one stage "
                "(split_points=[...] with no cut between them), or give each use its own module (e.g. two "
                "BatchNorm layers instead of one called twice)")


def cut_starts(traced: Traced, split_points: Sequence[str]) -> list[int]:
    """Graph position where each split point's stage begins: a module's first node, the node after a module's
    last one (`after:`), or a pipe_split() marker (`pipe_split:<k>`)."""
    nodes = list(traced.gm.graph.nodes)
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for i, node in enumerate(nodes):
        for path in module_path(node):
            # a torch.compile'd submodule (`self.b = torch.compile(block)`) runs its module as `b._orig_mod`:
            # named by the user's path, `b`, as well
            for name in {path, ".".join(p for p in path.split(".") if p != "_orig_mod")}:
                first.setdefault(name, i)
                last[name] = i
    position = {n: i for i, n in enumerate(nodes)}
    marks = [position[n] for n in _marker_nodes(traced)]
    by_name = {n.name: i for i, n in enumerate(nodes)}
    starts = []
    for point in split_points:
        module = point.removeprefix(AFTER_PREFIX)
        if point.startswith(NODE_PREFIX):
            op = point[len(NODE_PREFIX):]
            if op not in by_name or nodes[by_name[op]].op != "call_function":
                close = difflib.get_close_matches(op, [n.name for n in nodes if n.op == "call_function"], n=5)
                raise PartitionError(f"split point `{point}`: the traced step has no op `{op}`"
                                     + (f"; close names: {', '.join(close)}" if close else "")
                                     + " (op names are the trace's: `python -m zbcompile inspect` lists the cuts)")
            starts.append(by_name[op])
        elif point.startswith(MARKER_PREFIX):
            k = point[len(MARKER_PREFIX):]
            if not (k.isdigit() and int(k) < len(marks)):
                said = f"marker {k}" if k.isdigit() else f"{k!r} is no marker number"
                raise PartitionError(f"split point `{point}`: {said}, but the traced step has {len(marks)} "
                                     f"pipe_split() markers, pipe_split:0 to pipe_split:{len(marks) - 1} (they count "
                                     "from 0 in execution order)" if marks else
                                     f"split point `{point}`: the traced step has no pipe_split() marker")
            starts.append(marks[int(k)])
        elif module not in first:
            raise PartitionError(
                f"split point `{point}` is a module of the model but computes nothing in the traced step "
                "(it is never called): choose a module that runs"
            )
        else:
            starts.append(last[module] + 1 if point.startswith(AFTER_PREFIX) else first[module])
    return starts


def _assign(traced: Traced, split_points: tuple[str, ...]) -> dict[fx.Node, int]:
    """Stage of every node: the number of split points whose stage begins at or before it (graph order)."""
    starts = cut_starts(traced, split_points)
    for a in range(len(starts) - 1):
        if starts[a + 1] < starts[a]:  # a later split point runs before the current one
            by_start = [p for _, p in sorted(zip(starts, split_points))]
            raise PartitionError(
                f"split point `{split_points[a + 1]}` runs before `{split_points[a]}`: list split points in "
                f"execution order, e.g. {by_start}"
            )
    return {node: bisect.bisect_right(starts, i) for i, node in enumerate(traced.gm.graph.nodes)}


def _last_use(graph: fx.Graph, stage_of, const, out_values) -> dict[fx.Node, int]:
    """The last stage reading each non-constant computed value (its own stage if only read there)."""
    owner = {node: stage_of[node] for node in out_values.values()}
    last: dict[fx.Node, int] = {}
    for node in graph.nodes:
        if node.op != "call_function" or const[node]:
            continue
        use = stage_of[node]
        for user in node.users:
            if user.op == "output":
                use = max(use, owner[node])
            else:
                use = max(use, stage_of[user])
        last[node] = use
    return last


def _stage_modules(graph: fx.Graph, stage_of, const, num_stages: int) -> list[tuple[str, ...]]:
    """Per stage, the outermost module paths whose nodes all lie in that stage, in execution order."""
    spans: dict[str, set[int]] = {}
    for node in graph.nodes:
        if node.op == "call_function" and not const[node]:
            for path in module_path(node):
                spans.setdefault(path, set()).add(stage_of[node])
    result: list[dict[str, None]] = [{} for _ in range(num_stages)]
    for node in graph.nodes:
        if node.op == "call_function" and not const[node]:
            for path in module_path(node):
                if path and spans[path] == {stage_of[node]}:
                    result[stage_of[node]][path] = None
                    break
    return [tuple(r) for r in result]


def _build_stage(traced: Traced, s: int, stage_of, const, last_use, out_values, modules) -> Graph:
    graph = traced.gm.graph
    computed = [n for n in graph.nodes if n.op == "call_function" and not const[n] and stage_of[n] == s]
    # values from earlier stages that this stage reads or forwards
    recv = [n for n, last in last_use.items() if stage_of[n] < s <= last]
    send = [n for n, last in last_use.items() if stage_of[n] <= s < last]
    outputs: list[tuple[str, fx.Node]] = [(f"act:{n.name}", n) for n in send]
    # step outputs (loss, buffer updates) leave from the stage their module belongs to, exactly once
    outputs += [(name, node) for name, node in out_values.items() if stage_of[node] == s]
    # (a value this stage only receives and sends on needs none of the constants that made it)
    received = set(recv)
    needed_consts = _constant_closure(computed + [n for _, n in outputs if n not in received], const)

    placeholders = _stage_placeholders(traced, computed + needed_consts, recv)
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    input_names = []
    for name, node in placeholders:
        ph = g.placeholder(_identifier(name))
        ph.meta = dict(node.meta)
        env[node] = ph
        input_names.append(name)
    body = set(computed) | set(needed_consts)
    for node in graph.nodes:
        if node in body and node not in env:
            env[node] = g.node_copy(node, lambda n: env[n])
    g.output(tuple(env[n] for _, n in outputs))
    gm = fx.GraphModule(traced.gm, g, class_name=f"Stage{s}Forward")
    passthrough = tuple(name for name, n in outputs if role_of(name) is Role.ACT and stage_of[n] < s)
    return Graph(gm, tuple(input_names), tuple(name for name, _ in outputs), index=s, passthrough=passthrough,
                 modules=modules)


def _constant_closure(roots: Iterable[fx.Node], const) -> list[fx.Node]:
    """Constant call_function / get_attr nodes feeding `roots` (or being roots)."""
    seen: set[fx.Node] = set()
    stack = [r for r in roots if const.get(r) and r.op != "placeholder"]
    stack += [i for r in roots for i in r.all_input_nodes if const.get(i) and i.op != "placeholder"]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(i for i in n.all_input_nodes if const[i] and i.op != "placeholder")
    return list(seen)


def _stage_placeholders(traced: Traced, body: Sequence[fx.Node], recv: Sequence[fx.Node]):
    """(value name, original node) per stage input: params, buffers, data in trace order, then received acts."""
    used = {i for n in body for i in n.all_input_nodes if i.op == "placeholder"}
    kind_order = {"param": 0, "buffer": 1, "data": 2}
    named = [(name, n) for name, n in traced.graph.input_nodes().items() if n in used]
    named.sort(key=lambda pair: kind_order[pair[0].split(":")[0]])
    return named + [(f"act:{n.name}", n) for n in recv]


def _identifier(value_name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in value_name)
