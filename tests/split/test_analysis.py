"""The shared alias / view analysis (passes/analysis/aliases.py): pure, and one answer per question."""

from __future__ import annotations

import gc
import operator
import weakref

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from zbcompile.passes.analysis import aliases
from zbcompile.passes.analysis.aliases import (graph_output_aliases, graph_output_owned, may_alias_input,
                                               moves_no_data, view_base, written_inputs)


def _gm():
    def f(x, w):
        parts = torch.split(x, 2)
        return x.view(-1).view(3, 4), parts[0], x @ w, torch.ops.aten._unsafe_view(x, [-1])

    return make_fx(f)(torch.randn(4, 3), torch.randn(3, 3))


# _gm's outputs by hand: x.view(-1).view(3, 4) and split(x, 2)[0] are views of input 0; x @ w is fresh memory;
# _unsafe_view's schema declares a fresh result, but it returns x's memory (eager agrees): the whole-graph answer
# counts it as x's, as it does a sparse tensor built on given values (aliases._HOLDS_ARGUMENTS).
# Only the fresh ones are the caller's to keep and write into.
ALIASES = (frozenset({0}), frozenset({0}), frozenset(), frozenset({0}))
OWNED = (False, False, True, False)


def test_graph_answers_are_right_and_write_nothing_into_the_graph():
    """The answers equal the hand-derived ones, the first (walking the graph) and the second (from the memo)
    alike, and asking leaves the graph's meta and code as they were. Eager PyTorch agrees on every output: the
    views and _unsafe_view share x's storage, the product does not."""
    gm = _gm()
    before = dict(gm.meta)
    code = gm.code
    assert graph_output_aliases(gm) == ALIASES and graph_output_owned(gm) == OWNED
    assert graph_output_aliases(gm) == ALIASES and graph_output_owned(gm) == OWNED
    assert gm.meta == before and gm.code == code
    x, w = torch.randn(4, 3), torch.randn(3, 3)
    outs = gm(x, w)
    shares = tuple(o.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for o in outs)
    assert shares == tuple(bool(a) for a in ALIASES)


def test_written_inputs_are_those_an_op_writes_in_place_directly_or_through_a_view():
    """Input 0 written directly, input 2 through a slice of it; input 1 only read. Eager agrees: after a call
    the written inputs changed and the read one did not."""
    def f(a, b, c):
        a.mul_(0.9)
        c[0].zero_()
        return a + b

    x, y, z = torch.ones(3), torch.ones(3), torch.ones(2, 3)
    gm = make_fx(f, pre_dispatch=True)(x.clone(), y.clone(), z.clone())
    assert written_inputs(gm) == frozenset({0, 2})
    gm(x, y, z)
    assert (x != 1).any() and (y == 1).all() and (z[0] == 0).all()


def test_the_memo_does_not_keep_graphs_alive():
    gm = _gm()
    graph_output_aliases(gm)
    assert gm in aliases._ROOTS_MEMO
    ref = weakref.ref(gm)
    del gm
    gc.collect()
    assert ref() is None


def test_view_predicates():
    gm = _gm()
    x, w = gm.graph.find_nodes(op="placeholder")
    outs = gm.graph.output_node().args[0]
    flat, part, mm, unsafe = outs
    assert view_base(flat) is x and view_base(mm) is mm
    assert may_alias_input(x) and may_alias_input(flat) and may_alias_input(part) and not may_alias_input(mm)
    assert part.target is operator.getitem and moves_no_data(part)
    assert moves_no_data(flat) and moves_no_data(unsafe) and not moves_no_data(mm)
    assert not may_alias_input(unsafe)   # per node the schema alone: its result is fresh for aot's joint tracing
