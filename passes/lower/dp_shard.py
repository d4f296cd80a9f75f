"""gather_params: sharded data parallelism's parameter gathers, placed where the step reads the parameters. A
per-rank pass, after reduce_over_replicas (which reduce-scatters the gradients instead of all-reducing them).

Each replica holds a dim-0 shard of every parameter (`zero.param:fqn`, a program input: the Parameter, a
DTensor sharded as torch.chunk cuts it). The stage graphs read whole parameters, so the pass gathers them and
renames what the RUN ops read to the gathered values:

    [0F0] s0.mb0.act:h = stage0_f(param:w, mb0.data:0)        h:ag0 = dp_gather(zero.param:w; bucket 0 over 2: ...)
    ...                                                  ->   ag0.param:w = wait_gather(h:ag0; ...)
                                                              [0F0] s0.mb0.act:h = stage0_f(ag0.param:w, mb0.data:0)

The gathered value is dropped after its last reader, as any value is (the emitted code and the memory plan
both do so): with gather="step" the parameters a stage reads are gathered once, before its first action, and
live until its last (FSDP's reshard_after_forward=False), each gather posted one compute action before the
action that needs it, so that it overlaps that action; with gather="microbatch" every action gathers what it
reads right before it and drops it after (reshard after every action: no whole parameters held between
actions, one gather per action). Each gather is waited for right before its action. Parameters are bucketed by
dtype, at most `bucket_mb` per gather, in first-use order.

A forward saves views of the parameters for its backward (the transposed weight of a matmul, a LayerNorm's
weight): kept, each microbatch's would hold its own gathered copy until its backward. With gather="microbatch"
the pass makes the backward read the parameter again instead and redo the view there (`_views_read_again`), so
its gather for that action serves.

Besides the RUN ops, a COLLECTIVE may read a parameter: a vocabulary-parallel forward returning the logits
all-gathers the pipeline ranks' rows of the output layer (passes/lower/vocab.py); it reads the replicas'
gathered rows, as a RUN op would.

A 0-dim (or empty) parameter stays whole on every replica (`param:fqn` as before); its gradient is
all-reduced. Every SET_GRAD targets the Parameter itself (`zero.param:`), whose .grad is the replica's shard.
"""

from __future__ import annotations

from zbcompile.errors import LoweringError
from zbcompile.ir.program import RankProgram
from zbcompile.ir.program.ops import GatherArgs, Op, OpKind, TensorType
from zbcompile.ir.program.values import Role, handle, parse
from zbcompile.passes.lower.dp_reduce import DataParallel, capped_buckets, shardable

__all__ = ["gather_params", "GATHER_POLICIES"]

GATHER_POLICIES = ("step", "microbatch")


def gather_params(choice: DataParallel):
    """The per-rank pass (named gather_params) for a sharded `choice`."""
    if choice.gather not in GATHER_POLICIES:
        raise LoweringError(f"gather={choice.gather!r}: expected one of {GATHER_POLICIES}")

    def gather_params(program: RankProgram) -> RankProgram:
        return _gather(program, choice)
    return gather_params


def _gather(program: RankProgram, choice: DataParallel) -> RankProgram:
    types = _param_types(program)
    sharded = {fqn for fqn, t in types.items() if shardable(t)}
    per_action = choice.gather == "microbatch"
    if per_action:
        program = _views_read_again(program, sharded)
    posts, waits, plan = _place(program, _reads(program, sharded, once=not per_action), types, choice)
    ops: list[Op] = []
    renamed: dict[str, str] = {}   # param:fqn -> the gathered value the RUN ops from here on read
    for i, op in enumerate(program.ops):
        ops += posts.get(i, []) + waits.get(i, [])
        if op.kind in _READERS:
            renamed = plan.get(i, {}) if per_action else {**renamed, **plan.get(i, {})}
            op = op._replace(ins=tuple(renamed.get(v, v) for v in op.ins))
        elif any(parse(v).scope == "state" and parse(v).key in sharded for v in op.ins):
            raise LoweringError(f"rank {program.rank}: op {i} ({op}) reads a sharded parameter outside a stage "
                                "graph; gather_params knows only RUN ops and collectives as readers of the whole "
                                "parameters")
        ops.append(op)
    return program.replace(ops=tuple(ops), inputs=_inputs(program, sharded))


# the ops that may read a whole parameter: a stage graph's RUN, the all-gather of a vocabulary parameter's rows
_READERS = (OpKind.RUN, OpKind.COLLECTIVE)


def _reader(op: Op) -> str:
    return f"[{op.action}]" if op.kind is OpKind.RUN else op.spec.text


def _reads(program: RankProgram, sharded: set[str], once: bool) -> dict[int, list[str]]:
    """Per reading op (by index: RUN, COLLECTIVE): the sharded parameters it reads, in the order it reads them;
    with `once`, only those no earlier op reads."""
    seen: set[str] = set()
    out = {}
    for i, op in enumerate(program.ops):
        if op.kind in _READERS:
            read = dict.fromkeys(parse(v).key for v in op.ins if parse(v).scope == "state" and parse(v).key in sharded)
            out[i] = [fqn for fqn in read if not (once and fqn in seen)]
            seen.update(read)
    return out


def _place(program: RankProgram, reads: dict[int, list[str]], types, choice: DataParallel):
    """(op index -> the gathers posted before it, op index -> the waits before it, RUN index -> param:fqn -> the
    gathered value it reads). "step" posts a gather before the action before the one it serves, which it
    overlaps; "microbatch" right before its own action (overlapping the previous one would hold two gathered
    copies of the stage at once)."""
    posts: dict[int, list[Op]] = {}
    waits: dict[int, list[Op]] = {}
    plan: dict[int, dict[str, str]] = {}
    runs = list(reads)
    count = 0
    for j, i in enumerate(runs):
        for _, bucket in capped_buckets([(types[fqn].dtype, (fqn, types[fqn]), types[fqn].nbytes)
                                         for fqn in reads[i]], choice.bucket_bytes):
            args = GatherArgs(count, choice.shard, tuple(t for _, t in bucket))
            gathered = tuple(f"ag{count}.param:{fqn}" for fqn, _ in bucket)
            what = f"{len(bucket)} parameters" if len(bucket) > 1 else "1 parameter"
            at = runs[j - 1] if j and choice.gather == "step" else i
            posts.setdefault(at, []).append(Op(OpKind.DP_GATHER, tuple(f"zero.param:{fqn}" for fqn, _ in bucket),
                                               (handle(f"ag{count}"),), args,
                                               note=f"{what} for {_reader(program.ops[i])}"))
            waits.setdefault(i, []).append(Op(OpKind.WAIT_GATHER, (handle(f"ag{count}"),), gathered, args))
            plan.setdefault(i, {}).update((f"param:{fqn}", g) for (fqn, _), g in zip(bucket, gathered))
            count += 1
    return posts, waits, plan


def _inputs(program: RankProgram, sharded: set[str]) -> tuple[str, ...]:
    """The program's inputs with each sharded parameter's whole value replaced by its shard (which
    reduce_over_replicas may have added already, as SET_GRAD's target)."""
    out: dict[str, None] = {}
    for v in program.inputs:
        value = parse(v)
        if value.scope == "state" and value.role is Role.PARAM and value.key in sharded:
            v = f"zero.{v}"
        out.setdefault(v)
    return tuple(out)


def _param_types(program: RankProgram) -> dict[str, TensorType]:
    """fqn -> the whole parameter's type, from the placeholders of the stage graphs that read it."""
    out: dict[str, TensorType] = {}
    for op in program.ops:
        if op.kind is OpKind.COLLECTIVE:   # a collective's type is its input's: each pipeline rank's whole rows
            out.update((parse(v).key, op.args.type) for v in op.ins
                       if parse(v).scope == "state" and parse(v).role is Role.PARAM)
        if op.kind is not OpKind.RUN:
            continue
        g = program.graph(op)
        if g.gm is None:
            raise LoweringError(f"rank {program.rank}: gather_params needs graph {op.args.graph!r}'s GraphModule "
                                "(the parameters' shapes); a program read from text without graphs has none")
        for v, node in zip(op.ins, g.gm.graph.find_nodes(op="placeholder")):
            value = parse(v)
            if value.scope == "state" and value.role is Role.PARAM and value.key not in out:
                val = node.meta.get("val", node.meta.get("tensor_meta"))
                if val is None:
                    raise LoweringError(f"rank {program.rank}: graph {op.args.graph!r} placeholder {node.name} "
                                        f"({v}) carries no meta['val'], so its shard cannot be sized")
                out[value.key] = TensorType(tuple(val.shape), val.dtype)
    return out


# ---- the backward reads the parameter again instead of the forward's saved view of it ---------------------------
def _view_ops() -> frozenset:
    import torch

    aten = torch.ops.aten
    return frozenset({aten.t.default, aten.view.default, aten.permute.default, aten.transpose.int,
                      aten.expand.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
                      aten.slice.Tensor, aten.select.int, aten.alias.default, aten.detach.default,
                      aten._unsafe_view.default, aten.reshape.default})


def _param_views(g, op: Op, sharded: set[str], views) -> dict[str, tuple[str, list]]:
    """Of `op`'s outputs, those that are a sharded parameter input or a chain of view ops of one: value ->
    (fqn, the chain's nodes from the parameter out)."""
    from torch import fx

    placeholders = list(g.gm.graph.find_nodes(op="placeholder"))
    of_input = dict(zip(placeholders, op.ins))
    out = {}
    for value, node in zip(op.outs, g.gm.graph.output_node().args[0]):
        chain = []
        while isinstance(node, fx.Node) and node.op == "call_function" and node.target in views and \
                isinstance(node.args[0], fx.Node) and not any(isinstance(a, fx.Node) for a in node.args[1:]) \
                and not any(isinstance(a, fx.Node) for a in node.kwargs.values()):
            chain.append(node)
            node = node.args[0]
        v = of_input.get(node) if isinstance(node, fx.Node) and node.op == "placeholder" else None
        if v is not None and parse(v).scope == "state" and parse(v).role is Role.PARAM and parse(v).key in sharded:
            out[value] = (parse(v).key, chain[::-1])
    return out


def _views_read_again(program: RankProgram, sharded: set[str]) -> RankProgram:
    """Every RUN op that reads a forward's saved view of a sharded parameter reads the parameter instead (through
    a variant of its graph that redoes the view ops); the forward's output then has no reader and goes at once."""
    views = _view_ops()
    found: dict[str, tuple[str, list]] = {}
    graphs = dict(program.graphs)
    variants: dict[tuple, str] = {}
    ops = []
    for op in program.ops:
        if op.kind is OpKind.RUN:
            hit = tuple(k for k, v in enumerate(op.ins) if v in found)
            if hit:
                op = _read_again(op, hit, found, graphs, variants)
            found.update(_param_views(graphs[op.args.graph], op, sharded, views))
        ops.append(op)
    return program.replace(ops=tuple(ops), graphs=graphs)


def _read_again(op: Op, hit: tuple[int, ...], found, graphs, variants) -> Op:
    """`op` calling a variant of its graph whose inputs at positions `hit` (saved views of parameters) are the
    parameters themselves, the views redone inside: the other inputs in their order, then each parameter the
    graph did not read already."""
    key = op.args.graph
    replaced = {k: found[op.ins[k]] for k in hit}
    kept = [v for k, v in enumerate(op.ins) if k not in replaced]
    added = [p for p in dict.fromkeys(f"param:{fqn}" for fqn, _ in replaced.values()) if p not in kept]
    name = variants.get((key, hit, tuple(added)))
    if name is None:
        name = variants[key, hit, tuple(added)] = f"{key}_rv{sum(1 for k in variants if k[0] == key)}"
        graphs[name] = _variant(graphs[key], replaced, added)
    return op._replace(ins=tuple(kept + added), args=op.args._replace(graph=name))


def _variant(g, replaced: dict[int, tuple[str, list]], added: list[str]):
    """Graph `g` without its inputs at the positions of `replaced` (saved views of parameters), taking the
    parameters `added` after its other inputs, each view redone from its parameter."""
    import dataclasses

    from torch import fx

    old = g.gm.graph
    placeholders = list(old.find_nodes(op="placeholder"))
    new, env = fx.Graph(), {}
    names: list[str] = []
    by_name: dict[str, fx.Node] = {}
    for k, (ph, name) in enumerate(zip(placeholders, g.inputs)):
        if k not in replaced:
            env[ph] = by_name[name] = new.node_copy(ph)
            names.append(name)
    metas = {f"param:{fqn}": _param_meta(chain, placeholders[k]) for k, (fqn, chain) in replaced.items()}
    for name in added:
        node = by_name[name] = new.placeholder(name.replace(":", "_").replace(".", "_"))
        node.meta = dict(metas[name])
        names.append(name)
    for k, (fqn, chain) in replaced.items():
        x = by_name[f"param:{fqn}"]
        for n in chain:
            x = new.call_function(n.target, (x, *n.args[1:]), dict(n.kwargs))
            x.meta = dict(n.meta)
        env[placeholders[k]] = x
    for n in old.nodes:
        if n.op != "placeholder":
            env[n] = new.node_copy(n, lambda x: env[x])
    new.lint()
    gm = fx.GraphModule(g.gm, new, class_name=type(g.gm).__name__ + "ReadAgain")
    return dataclasses.replace(g, gm=gm, inputs=tuple(names))


def _param_meta(chain: list, placeholder) -> dict:
    """The meta of the parameter a view chain starts from (its first node's input), or the placeholder's own
    where the saved value is the parameter itself."""
    return chain[0].args[0].meta if chain else placeholder.meta
