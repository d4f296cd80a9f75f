"""reduce_over_replicas: average every gradient over the data-parallel replicas, each reduction placed where the
gradient is final. A per-rank pass, after reduce_shared_grads.

A parameter's gradient is final at its SET_GRAD: accumulate_grads puts it right after the last W (or BW) that
adds to it, reduce_shared_grads after the sum of a tied or mirrored parameter's copies. The gradients that
become final together (one stage's, after its last W) go into buckets, by dtype and at most `bucket_bytes`
each, and each bucket's all-reduce is posted right there, before the next op of the step. The step then goes on
with the remaining B and W work while the reduction runs on the data-parallel group's stream; the waits, and
the SET_GRADs of the averaged gradients, come at the end of the program, where the optimizer needs them:

    [1W7] acc7.grad:param:w = stage1_w_acc(...)            [1W7] acc7.grad:param:w = stage1_w_acc(...)
    set_grad(param:w, acc7.grad:param:w; True)     ->      h:dp2 = dp_reduce(acc7.grad:param:w; bucket 2)
    [0B7] ...                                              [0B7] ...
                                                           ...
                                                           dp.grad:param:w = wait_dp(h:dp2)
                                                           set_grad(param:w, dp.grad:param:w; True)

A bucket closes when the gradients finished together end (the compiler knows no more arrive before the next
compute op), not when it fills as DDP's do: holding a bucket open across compute would only delay it.
`overlap=False` posts every bucket at the end of the step instead (the exposed reduction a step without
overlap has; the benchmark's baseline). A vocabulary shard is reduced like any parameter: the replicas of a rank
hold the same rows.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from zbcompile.errors import LoweringError
from zbcompile.passes.graph_walk import ancestors, is_computed
from zbcompile.passes.lower.reduce import check_dense, grad_types
from zbcompile.ir.program import RankProgram
from zbcompile.ir.program.ops import DPArgs, Op, OpKind, SetGradArgs, TensorType
from zbcompile.ir.program.values import handle, parse

__all__ = ["DataParallel", "reduce_over_replicas", "shardable", "capped_buckets"]


@dataclasses.dataclass(frozen=True)
class DataParallel:
    """How the lowering reduces gradients over data-parallel replicas (the defaults match CompileOptions';
    passes import nothing of the core, so they are written here again).

    bucket_mb: at most this many MiB of gradients in one all-reduce (0: one all-reduce per gradient).
    overlap: post each bucket right after its gradients are final (True) or all at the end of the step (False).
    w_pieces: with overlap, each rank's trailing W's are each split into this many gradient groups
        (finish_grads_in_groups), so that the groups' reductions overlap the rest of the tail; 1 leaves them.
    shard: sharded data parallelism over this many replicas (0: replicated): each replica holds dim-0 shards of
        the parameters, the gradients are reduce-scattered instead of all-reduced, and the parameters are
        gathered where the step reads them (passes/lower/dp_shard.py).
    gather: with shard, when the whole parameters are gathered: "step" (once, before the first action that
        reads them; dropped after the last) or "microbatch" (before every action that reads them, dropped after
        it: less memory, one gather per action).
    """

    bucket_mb: float = 25.0
    overlap: bool = True
    w_pieces: int = 4
    shard: int = 0
    gather: str = "step"

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * 2**20)


def reduce_over_replicas(choice: DataParallel):
    """The pass over all programs for `choice` (named reduce_over_replicas)."""
    def run(programs: Sequence[RankProgram]) -> tuple[RankProgram, ...]:
        types = grad_types(programs)
        check_dense(programs, dict.fromkeys(types, "the data-parallel replicas each hold a copy of it"))
        return tuple(_reduce(p, types, choice) for p in programs)
    run.__name__ = "reduce_over_replicas"
    return run


def _reduce(program: RankProgram, types: dict[str, TensorType], choice: DataParallel) -> RankProgram:
    ops: list[Op] = []
    at_end: list[Op] = []     # posts held back to the end (overlap=False)
    waits: list[Op] = []
    finished: list[Op] = []   # SET_GRADs of the gradients that just became final together
    buckets = 0

    def close() -> None:
        nonlocal buckets
        for bucket, sharded in _buckets(program.rank, finished, types, choice):
            h = handle(f"dp{buckets}")
            grads = tuple(op.ins[1] for op in bucket)
            fqns = [parse(op.ins[0]).key for op in bucket]
            averaged = tuple(f"dp.grad:param:{fqn}" for fqn in fqns)
            nbytes = sum(types[fqn].nbytes for fqn in fqns)
            what = f"{len(bucket)} gradients" if len(bucket) > 1 else "1 gradient"
            (ops if choice.overlap else at_end).append(
                Op(OpKind.DP_REDUCE, grads, (h,), DPArgs(buckets, choice.shard if sharded else 0),
                   note=f"{what}, {nbytes} bytes"))
            waits.append(Op(OpKind.WAIT_DP, (h,), averaged))
            # sharded: .grad of the replica's shard (the Parameter is the program input zero.param:)
            targets = [f"zero.param:{fqn}" if choice.shard else op.ins[0] for op, fqn in zip(bucket, fqns)]
            waits.extend(Op(OpKind.SET_GRAD, (target, avg), args=SetGradArgs(True), note="averaged over dp")
                         for target, avg in zip(targets, averaged))
            buckets += 1
        finished.clear()

    for op in program.ops:
        if op.kind is OpKind.SET_GRAD:
            finished.append(op)
            continue
        if finished:
            close()
        ops.append(op)
    if finished:
        close()
    # sharded: the Parameters whose .grad the SET_GRADs set are program inputs (gather_params then drops the
    # whole parameters the stage graphs read from the inputs)
    targets = tuple(dict.fromkeys(op.ins[0] for op in waits if op.kind is OpKind.SET_GRAD
                                  and op.ins[0] not in program.inputs))
    return program.replace(ops=tuple(ops + at_end + waits), inputs=program.inputs + targets)


def shardable(t: TensorType) -> bool:
    """Whether sharded data parallelism cuts a parameter of type `t` into dim-0 shards (a 0-dim or empty one
    stays whole on every replica: its gradient is all-reduced)."""
    return len(t.shape) > 0 and t.shape[0] > 0


def _buckets(rank: int, finished: list[Op], types: dict[str, TensorType],
             choice: DataParallel) -> list[tuple[list[Op], bool]]:
    """The SET_GRADs of `finished` in buckets, each with whether it is reduce-scattered: one dtype each (a flat
    collective) and, sharded, sharded or whole parameters apart; at most `choice.bucket_bytes` unless one
    gradient alone is larger, in program order within a bucket kind."""
    items = []
    for op in finished:
        fqn = parse(op.ins[0]).key
        if fqn not in types:
            raise LoweringError(f"rank {rank}: parameter {fqn!r} has no known gradient type (no stage graph declares "
                                "its shape), so its data-parallel bucket cannot be sized")
        sharded = bool(choice.shard) and shardable(types[fqn])
        items.append(((types[fqn].dtype, sharded), op, types[fqn].nbytes))
    return [(bucket, kind[1]) for kind, bucket in capped_buckets(items, choice.bucket_bytes)]


def capped_buckets(items, cap: int) -> list[tuple[object, list]]:
    """[(kind, [item, ...])]: the (kind, item, bytes) triples of `items` in buckets of one kind each (a flat
    collective takes one dtype), at most `cap` bytes unless one item alone is larger, in order within a kind."""
    by_kind: dict = {}
    for kind, item, nbytes in items:
        by_kind.setdefault(kind, []).append((item, nbytes))
    out = []
    for kind, group in by_kind.items():
        current: list = []
        size = 0
        for item, nbytes in group:
            if current and size + nbytes > cap:
                out.append((kind, current))
                current, size = [], 0
            current.append(item)
            size += nbytes
        out.append((kind, current))
    return out


# ---- finishing gradients one group at a time ---------------------------------------------------------------
def finish_grads_in_groups(choice: DataParallel):
    """The per-rank pass (named finish_grads_in_groups) that gives the reductions compute to hide behind.

    In a pipeline step every parameter's gradient becomes final in the cooldown, at its stage's last W, and
    a W computes all of its stage's weight gradients at once: left as it is, the reduction of the stage that
    finishes last has nothing left to overlap. The pass takes each rank's trailing W's (the run of W's that
    ends its step; the W's before them fill waits the schedule placed them in, and stay) and

    1. splits each into `choice.w_pieces` graphs over disjoint groups of its parameters (contiguous, of about
       equal bytes; a graph with fewer gradients, or with an in-place op, stays whole);
    2. runs them stage by stage (the stage with the most gradient bytes first), group by group: each group's
       gradients are final, and their all-reduce posted, while the rest of the tail still computes. Only the
       last group of the last stage is left exposed.

        1B7 1W6 1W7    ->    1B7  1W6[a] 1W7[a]  (all-reduce a)  1W6[b] 1W7[b]  (all-reduce b) ...

    W's depend on nothing but their own B, so any order of the trailing ones is valid; nothing waits on them.

    The pieces are graphs `<key>_p<g>` in the graph table; each keeps only the inputs its outputs need.
    """
    def finish(program: RankProgram) -> RankProgram:
        return _finish(program, choice.w_pieces)
    finish.__name__ = "finish_grads_in_groups"
    return finish


def _finish(program: RankProgram, pieces: int) -> RankProgram:
    from zbcompile.ir.schedule import KIND_SPECS, Kind

    ops = list(program.ops)
    runs = [i for i, op in enumerate(ops) if op.kind is OpKind.RUN]
    tail: list[int] = []   # the rank's trailing W's
    for i in reversed(runs):
        if ops[i].action.kind is not Kind.W or KIND_SPECS[ops[i].action.kind].sharded:
            break
        tail.insert(0, i)
    if not tail:
        return program
    graphs = dict(program.graphs)
    # the stage with the most gradient bytes first: the one finishing last leaves its last group exposed
    stages = sorted(dict.fromkeys(ops[i].args.graph for i in tail), key=lambda k: -_grad_bytes(graphs[k]))
    moved: list[Op] = []
    for key in stages:
        split = _split_graph(graphs[key], pieces)
        mine = [ops[i] for i in tail if ops[i].args.graph == key]
        if split is None:
            moved += mine
            continue
        whole = graphs[key]
        for g, (piece, ins, outs) in enumerate(split):
            graphs[f"{key}_p{g}"] = piece
            moved += [op._replace(ins=_globals(op.ins, whole.inputs, ins, op), outs=_globals(op.outs, whole.outputs,
                                                                                           outs, op),
                                  args=op.args._replace(graph=f"{key}_p{g}"),
                                  note=f"gradient group {g + 1} of {len(split)}") for op in mine]
    gone = set(tail)
    new = [op for i, op in enumerate(ops) if i not in gone]
    at = tail[0] - sum(1 for i in gone if i < tail[0])
    return program.replace(ops=tuple(new[:at] + moved + new[at:]), graphs=graphs)


def _globals(values, names, wanted, op) -> tuple[str, ...]:
    """The program's values for a piece's local `wanted` names: the W's own where the whole graph has the name,
    else a value between the pieces of this W (stage, microbatch of the W)."""
    from zbcompile.ir.program.values import stage_value

    of = dict(zip(names, values))
    action = op.action
    return tuple(of[n] if n in of else stage_value(action.stage, action.microbatch, n) for n in wanted)


def _grad_bytes(g) -> int:
    return sum(t.nbytes for t in g.types if t is not None) if g.types else 0


def _split_graph(g, pieces: int):
    """[(piece graph, its input names, its output names)]: g cut into up to `pieces` graphs run one after the
    other, each returning a group of g's outputs (contiguous in the order g computes them, of about equal
    bytes). Every node is computed once, in the first piece that needs it; a later piece that needs it too
    takes it as an input `wsaved:split_<node>` the earlier piece returns. None where g stays whole (fewer than
    two outputs, an in-place op)."""
    from torch import fx

    graph = g.gm.graph if g.gm is not None else None
    if pieces < 2 or len(g.outputs) < 2 or graph is None or any(
            n.is_impure() for n in graph.nodes if n.op == "call_function"):
        return None
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    outs = list(graph.output_node().args[0])
    order = sorted(range(len(outs)), key=lambda j: pos.get(outs[j], -1))   # outputs in the order g makes them
    sizes = [g.types[j].nbytes if g.types and g.types[j] is not None else 0 for j in order]
    groups = [sorted(order[k] for k in chunk) for chunk in _groups(sizes, pieces)]
    if len(groups) < 2:
        return None
    owner: dict = {}
    for k, group in enumerate(groups):
        for j in group:
            for n in ancestors([outs[j]], through=is_computed):
                owner.setdefault(n, k)
    placeholders = list(graph.find_nodes(op="placeholder"))
    local = dict(zip(placeholders, g.inputs))
    # per piece, the nodes an earlier piece computes that it reads, or returns (an output of its group that an
    # earlier group's outputs are computed from)
    later = {k: [n for n in nodes if n.op == "call_function" and owner.get(n, k) < k
                 and (any(owner.get(u, -1) >= k for u in n.users) or any(outs[j] is n for j in group))]
             for k, group in enumerate(groups)}
    out = []
    for k, group in enumerate(groups):
        new, env, ins = fx.Graph(), {}, []
        mine = [n for n in nodes if owner.get(n) == k]
        needed = {x for n in mine for x in n.all_input_nodes} | {outs[j] for j in group}
        for ph in placeholders:
            if ph in needed:
                env[ph] = new.node_copy(ph)
                ins.append(local[ph])
        for n in later[k]:   # computed by an earlier piece
            if n in needed:
                env[n] = new.placeholder(f"split_{n.name}")
                env[n].meta = dict(n.meta)
                ins.append(f"wsaved:split_{n.name}")
        for n in mine:
            for x in n.all_input_nodes:
                if x not in env:   # a get_attr (a constant of the graph)
                    env[x] = new.node_copy(x)
            env[n] = new.node_copy(n, lambda x: env[x])
        passed = [n for n in later.get(k + 1, []) + sum((later[q] for q in range(k + 2, len(groups))), [])
                  if owner.get(n) == k]
        passed = list(dict.fromkeys(passed))
        new.output(tuple(env[outs[j]] for j in group) + tuple(env[n] for n in passed))
        new.lint()
        gm = fx.GraphModule(g.gm, new, class_name=type(g.gm).__name__ + "Piece")
        names = tuple(g.outputs[j] for j in group) + tuple(f"wsaved:split_{n.name}" for n in passed)
        types = tuple(g.types[j] for j in group) + (None,) * len(passed) if g.types else ()
        out.append((dataclasses.replace(g, gm=gm, inputs=tuple(ins), outputs=names, types=types),
                    tuple(ins), names))
    return out


def _groups(sizes: list[int], n: int) -> list[list[int]]:
    """Positions 0..len(sizes)-1 in at most n non-empty contiguous groups, each closing once it holds its share
    of the bytes."""
    total = sum(sizes)
    groups: list[list[int]] = []
    current: list[int] = []
    acc = 0
    for k, size in enumerate(sizes):
        current.append(k)
        acc += size
        left, need = len(sizes) - k - 1, n - len(groups) - 1   # positions still to place, groups still to open
        if need and left and (left == need or (total and acc >= total * (len(groups) + 1) / n)):
            groups.append(current)
            current = []
    if current:
        groups.append(current)
    return groups
