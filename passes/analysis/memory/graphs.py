"""What running one stage graph allocates and releases, node by node (graph_profile), from the alias roots of
its nodes (aliases.node_roots) and the sizes of their FakeTensors (tensor_bytes)."""

from __future__ import annotations

import operator
import weakref
from typing import Mapping, NamedTuple

import torch
from torch import fx

from zbcompile.ir.program.ops import allocated_bytes
from zbcompile.passes.analysis.aliases import node_roots

__all__ = ["GraphProfile", "graph_profile", "tensor_bytes"]


class GraphProfile(NamedTuple):
    """What running one stage graph allocates and releases, node by node (see graph_profile)."""

    outputs: tuple[frozenset, ...]              # per output, its roots: input positions and fresh root names
    fresh: Mapping[str, int]                    # fresh root -> bytes
    steps: tuple[tuple[int, tuple[str, ...], tuple[int, ...]], ...]
    # per node: (bytes born there, fresh roots dead after it, input positions whose last use it is)


_PROFILES: weakref.WeakKeyDictionary[fx.GraphModule, GraphProfile] = weakref.WeakKeyDictionary()


def graph_profile(gm: fx.GraphModule) -> GraphProfile:
    """The graph's memory profile, from the alias roots of its nodes and their FakeTensor sizes. A fresh
    root dies after the last user of the last node that may alias it; roots an output may alias outlive the
    graph. Memoized per graph (weakly, as aliases.py does)."""
    found = _PROFILES.get(gm)
    if found is None:
        found = _PROFILES[gm] = _profile(gm)
    return found


def _profile(gm: fx.GraphModule) -> GraphProfile:
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    roots = node_roots(gm)
    output = nodes[-1]
    outs = output.args[0]
    outs = tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)
    out_roots = tuple(roots.get(o, frozenset()) if isinstance(o, fx.Node) else frozenset() for o in outs)
    fresh = _fresh_bytes(nodes, roots)
    # a multi-result op's results (`name[i]`, taken out by getitem nodes later) exist from the op on, while its
    # inputs still do: born at the op, not at their getitem (a batch norm's backward held 2x its input)
    made_at = {n.name: index[n] for n in nodes}
    end: dict = {}           # fresh root -> index of the last node that may still reference it
    born: dict[int, int] = {}
    done: dict[int, list[int]] = {}
    for n in nodes[:-1]:
        last = max((index[u] for u in n.users if u is not output), default=index[n])
        if output in n.users:
            last = len(nodes)
        for r in roots.get(n, ()):
            if isinstance(r, int):
                if n.op == "placeholder":
                    done.setdefault(last, []).append(r)
            elif r in fresh:
                end[r] = max(end.get(r, -1), last)
                if r not in born:
                    born[r] = made_at.get(r.partition("[")[0], index[n]) if "[" in r else index[n]
    survivors = set().union(*out_roots) if out_roots else set()
    dies: dict[int, list[str]] = {}
    for r, i in end.items():
        if r not in survivors and i < len(nodes):
            dies.setdefault(i, []).append(r)
    alloc: dict[int, int] = {}
    for r, i in born.items():
        alloc[i] = alloc.get(i, 0) + fresh[r]
    steps = tuple((alloc.get(i, 0), tuple(dies.get(i, ())), tuple(done.get(i, ()))) for i in range(len(nodes) - 1))
    return GraphProfile(out_roots, fresh, steps)


def _fresh_bytes(nodes: list[fx.Node], roots: Mapping[fx.Node, frozenset]) -> dict[str, int]:
    """Bytes of each fresh root: a node's own result (its FakeTensor's storage) or the i-th result of a
    multi-result op (`name[i]`); a multi-result op's own root counts the results no getitem takes out.
    get_attr constants live in the module, not in the step."""
    by_name = {n.name: n for n in nodes}
    out: dict[str, int] = {}
    for n in nodes:
        for r in roots.get(n, ()):
            if isinstance(r, int) or r in out:
                continue
            base, bracket, idx = r.partition("[")
            owner = by_name.get(base)
            if owner is None or owner.op == "get_attr":
                out[r] = 0
                continue
            val = owner.meta.get("val")
            if bracket:
                k = int(idx.rstrip("]"))
                out[r] = tensor_bytes(val[k]) if isinstance(val, (tuple, list)) and k < len(val) else 0
            elif isinstance(val, (tuple, list)):
                taken = {u.args[1] for u in owner.users if u.target is operator.getitem}
                out[r] = sum(tensor_bytes(v) for k, v in enumerate(val) if k not in taken)
            else:
                out[r] = tensor_bytes(val)
    return out


def tensor_bytes(val) -> int:
    """Bytes the allocator gives the storage under a (fake) tensor (allocated_bytes); 0 for anything else."""
    if not isinstance(val, torch.Tensor):
        return 0
    try:
        nbytes = int(val.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):   # sparse or other storage-less layouts
        nbytes = val.numel() * val.element_size()
    return allocated_bytes(nbytes, val.device)
