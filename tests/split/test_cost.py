"""Cost model against closed forms on real traced graphs, and balance against brute force."""

import itertools
import random

import pytest
import sympy
import torch
import torch.nn.functional as F
from torch import nn
from torch._functorch.aot_autograd import aot_export_joint_simple
from torch.utils.flop_counter import FlopCounterMode

from zbcompile.errors import PartitionError, ZBCompileError
from zbcompile.passes.balance import balance, group_weights
from zbcompile.passes.cost import (NodeCost, evaluate, format_bytes, format_cost, format_cost_table, format_flops,
                                   graph_cost, node_cost, size_hints, value_bytes)

aten = torch.ops.aten


def export(module, *args, dynamic_shapes=None):
    return torch.export.export(module, args, dynamic_shapes=dynamic_shapes).run_decompositions({}).graph_module


def joint(fn, *args):
    """Forward + backward graph of `fn` (returns a 1-tuple holding a scalar loss)."""
    return aot_export_joint_simple(fn, args, trace_joint=True)


def nodes(gm, target):
    return [n for n in gm.graph.nodes if n.target == target]


def flops_of(gm, target):
    return [node_cost(n).flops for n in nodes(gm, target)]


# --------------------------------------------------------------------------------------------------- matmuls


def test_mlp_forward_is_2_b_in_out_plus_bias():
    b, d_in, hidden, d_out = 4, 8, 16, 3
    mlp = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, d_out, bias=False))
    gm = export(mlp, torch.randn(b, d_in))
    assert flops_of(gm, aten.linear.default) == [2 * b * d_in * hidden + b * hidden, 2 * b * hidden * d_out]
    cost = graph_cost(gm)
    assert cost.by_op["aten.relu"].flops == b * hidden
    assert cost.flops == 2 * b * d_in * hidden + b * hidden + b * hidden + 2 * b * hidden * d_out
    assert list(cost.by_op)[0] == "aten.linear"  # largest first


def test_linear_joint_graph_dw_and_dx_matmuls():
    b, d_in, d_out = 5, 6, 7
    w, bias = torch.randn(d_out, d_in, requires_grad=True), torch.randn(d_out, requires_grad=True)
    x = torch.randn(b, d_in, requires_grad=True)
    gm = joint(lambda w, bias, x: (F.linear(x, w, bias).sum(),), w, bias, x)
    assert flops_of(gm, aten.addmm.default) == [2 * b * d_in * d_out + b * d_out]  # forward
    assert flops_of(gm, aten.mm.default) == [2 * b * d_in * d_out] * 2  # dW = dy^T x, dX = dy W


def test_bmm_and_baddbmm():
    a, m, k, n = 3, 4, 5, 6
    gm = export(_Bmm(), torch.randn(a, m, k), torch.randn(a, k, n), torch.randn(a, m, n))
    assert flops_of(gm, aten.bmm.default) == [2 * a * m * n * k]
    assert flops_of(gm, aten.baddbmm.default) == [2 * a * m * n * k + a * m * n]


class _Bmm(nn.Module):
    def forward(self, x, y, c):
        return torch.bmm(x, y), torch.baddbmm(c, x, y)


# ----------------------------------------------------------------------------------------------- convolution


def test_conv_forward_formula():
    b, c_in, c_out, h, w, k, groups = 2, 4, 6, 9, 7, 3, 2
    conv = nn.Conv2d(c_in, c_out, k, stride=2, padding=1, groups=groups)
    gm = export(conv, torch.randn(b, c_in, h, w))
    h_out, w_out = (h + 2 - k) // 2 + 1, (w + 2 - k) // 2 + 1
    out = b * c_out * h_out * w_out
    assert flops_of(gm, aten.conv2d.default) == [2 * out * (c_in // groups) * k * k + out]


def test_conv_joint_matches_flop_counter_and_honours_output_mask():
    conv_w = torch.randn(6, 4, 3, 3, requires_grad=True)
    convt_w = torch.randn(6, 2, 2, 2, requires_grad=True)  # transposed: (C_in, C_out / groups, kh, kw)
    x = torch.randn(2, 4, 8, 8)  # no grad: the first conv's backward asks for grad_weight only

    def fn(conv_w, convt_w, x):
        y = F.conv2d(x, conv_w, padding=1)
        return (F.conv_transpose2d(y, convt_w, stride=2).sum(),)

    gm = joint(fn, conv_w, convt_w, x)
    ours = sum(node_cost(n).flops for n in gm.graph.nodes
               if n.target in (aten.convolution.default, aten.convolution_backward.default))
    with FlopCounterMode(display=False) as counter:
        fn(conv_w, convt_w, x)[0].backward()
    assert ours == counter.get_total_flops()
    masks = [n.args[-1] for n in nodes(gm, aten.convolution_backward.default)]
    assert sorted(masks) == [[False, True, False], [True, True, False]]


# ------------------------------------------------------------------------------------------------- attention


@pytest.fixture(scope="module")
def attention_joint():
    b, h, s, d = 2, 3, 10, 8
    q, k, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))
    gm = joint(lambda q, k, v: (F.scaled_dot_product_attention(q, k, v, is_causal=True).sum(),), q, k, v)
    return gm, (b, h, s, d)


def test_sdpa_forward_is_4_b_h_s2_d():
    b, h, s, d = 2, 3, 10, 8
    gm = export(_Sdpa(), *(torch.randn(b, h, s, d) for _ in range(3)))
    assert flops_of(gm, aten.scaled_dot_product_attention.default) == [4 * b * h * s * s * d]


class _Sdpa(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v)


def test_sdpa_cpu_flash_forward_and_backward(attention_joint):
    gm, (b, h, s, d) = attention_joint
    assert flops_of(gm, aten._scaled_dot_product_flash_attention_for_cpu.default) == [4 * b * h * s * s * d]
    # backward: QK^T recomputed, dP, dV, dQ, dK
    assert flops_of(gm, aten._scaled_dot_product_flash_attention_for_cpu_backward.default) == [
        10 * b * h * s * s * d
    ]


def test_sdpa_cross_attention_with_different_value_dim():
    b, h, l, s, e, ev = 2, 2, 5, 7, 4, 6
    gm = export(_Sdpa(), torch.randn(b, h, l, e), torch.randn(b, h, s, e), torch.randn(b, h, s, ev))
    assert flops_of(gm, aten.scaled_dot_product_attention.default) == [2 * b * h * l * s * (e + ev)]


# ------------------------------------------------------------------------------- norms, embedding, bytes, misc


def test_embedding_moves_rows_not_table_and_backward_scatters():
    vocab, dim, b, s = 100, 8, 2, 5
    weight = torch.randn(vocab, dim, requires_grad=True)
    idx = torch.randint(0, vocab, (b, s))
    gm = joint(lambda weight, idx: (F.embedding(idx, weight).sum(),), weight, idx)
    (fwd,) = (node_cost(n) for n in nodes(gm, aten.embedding.default))
    rows = b * s * dim * 4
    assert fwd == NodeCost(flops=0, bytes_read=rows + b * s * 8, bytes_written=rows)
    (bwd,) = (node_cost(n) for n in nodes(gm, aten.embedding_dense_backward.default))
    assert bwd.flops == b * s * dim and bwd.bytes_written == vocab * dim * 4


def test_layer_norm_costs_a_few_flops_per_element_and_tuple_bytes():
    x, w, bias = torch.randn(4, 6, requires_grad=True), torch.randn(6, requires_grad=True), torch.randn(6)
    gm = joint(lambda x, w, bias: (F.layer_norm(x, (6,), w, bias).sum(),), x, w, bias)
    (ln,) = nodes(gm, aten.native_layer_norm.default)
    assert 0 < node_cost(ln).flops <= 10 * x.numel()
    assert value_bytes(ln) == (24 + 4 + 4) * 4  # output, mean and rstd (4, 1) each
    (ln_bwd,) = nodes(gm, aten.native_layer_norm_backward.default)
    assert ln_bwd.args[-1] == [True, True, False]  # no grad for the constant bias
    assert node_cost(ln_bwd).flops == (6 + 2) * x.numel()


def test_views_getitem_and_placeholders_are_free_and_unknown_ops_count_output_numel():
    gm = export(_Misc(), torch.randn(3, 4))
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target in (aten.view.default, aten.permute.default):
            assert node_cost(n) == NodeCost()
    (cat,) = nodes(gm, aten.cat.default)
    assert node_cost(cat).flops == 24  # fallback: numel of the output
    (amax,) = nodes(gm, aten.amax.default)
    assert node_cost(amax).flops == 12  # reduction: numel of the input


class _Misc(nn.Module):
    def forward(self, x):
        y = x.view(4, 3).permute(1, 0)
        return torch.cat([y, y]), x.amax(0)


def test_nested_graph_modules_cost_their_graph():
    from torch.fx.passes.split_module import split_module

    gm = export(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), torch.randn(3, 8))
    parts = split_module(gm, None, lambda n: 0 if n.name == "linear" else 1)
    assert graph_cost(parts).flops == graph_cost(gm).flops
    assert list(graph_cost(parts).by_op) == ["submod_0", "submod_1"]


def test_missing_meta_val_says_how_to_fix():
    gm = torch.fx.symbolic_trace(nn.Linear(2, 2))
    with pytest.raises(ZBCompileError, match="FakeTensorProp"):
        graph_cost(gm)


# ----------------------------------------------------------------------------------------- symbolic shapes


def test_dynamic_batch_gives_sympy_cost_that_evaluates_to_the_static_one():
    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(6, 8)
    static = graph_cost(export(mlp, x))
    gm = export(mlp, x, dynamic_shapes=({0: torch.export.Dim("batch")},))
    dynamic = graph_cost(gm)
    assert isinstance(dynamic.flops, sympy.Expr) and len(dynamic.flops.free_symbols) == 1
    hints = size_hints(gm)
    assert list(hints.values()) == [6]
    assert dynamic.subs(hints) == static
    (name,) = hints
    assert evaluate(dynamic.flops, {name: 12}) == 2 * static.flops
    with pytest.raises(ZBCompileError, match=name):
        evaluate(dynamic.flops, {})
    assert name in format_cost(dynamic)


def test_size_code_and_asserts_are_free():
    gm = export(_SizeCode(), torch.randn(4, 6), torch.tensor(3), dynamic_shapes=({0: torch.export.Dim("b")}, None))
    asserts = nodes(gm, aten._assert_scalar.default)
    assert asserts and all(node_cost(n) == NodeCost() for n in asserts)
    (mul,) = nodes(gm, aten.mul.Tensor)
    assert list(graph_cost(gm).by_op) == ["aten.mul"]  # sym_size, item, SymInt arithmetic are free


class _SizeCode(nn.Module):
    def forward(self, x, n):
        k = n.item()
        torch._check(k > 0)
        torch._check(k < 5)
        return x.reshape(x.shape[0] * 2, -1) * k


def test_human_units():
    assert format_flops(1_234_567_890) == "1.2 GFLOP"
    assert format_flops(999) == "999 FLOP"
    assert format_bytes(int(3.4 * 2**20)) == "3.4 MiB"
    assert format_bytes(0) == "0 B"
    assert format_cost(NodeCost(2_000_000, 1024, 1024)) == "2.0 MFLOP, 2.0 KiB"


def test_cost_table_lists_ops_and_total():
    table = format_cost_table(graph_cost(export(nn.Linear(4, 4), torch.randn(2, 4))))
    assert "aten.linear" in table and "total" in table


# ------------------------------------------------------------------------------------------------- balance


def brute_force(weights, parts):
    """The optimal max group weight over all cuttings into `parts` non-empty contiguous groups."""
    n = len(weights)
    return min(max(group_weights(weights, cuts)) for cuts in itertools.combinations(range(1, n), parts - 1))


def check_cuts(cuts, n, parts):
    """parts - 1 strictly increasing cuts strictly inside 0..n: every group non-empty."""
    bounds = (0, *cuts, n)
    assert len(cuts) == parts - 1 and all(a < b for a, b in itertools.pairwise(bounds))


def test_balance_is_optimal_on_random_integer_instances():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 9)
        parts = rng.randint(1, n)
        weights = [rng.choice([0, 1, 2, 3, 5, 8, 13, 100]) for _ in range(n)]
        cuts = balance(weights, parts)
        check_cuts(cuts, n, parts)
        assert max(group_weights(weights, cuts)) == brute_force(weights, parts), (weights, parts, cuts)


def test_balance_is_optimal_on_random_float_instances():
    rng = random.Random(1)
    for _ in range(200):
        n = rng.randint(2, 10)
        parts = rng.randint(2, n)
        weights = [rng.random() * 10 for _ in range(n)]
        cuts = balance(weights, parts)
        check_cuts(cuts, n, parts)
        assert max(group_weights(weights, cuts)) == pytest.approx(brute_force(weights, parts), rel=1e-12)


def test_balance_edge_cases_and_a_large_instance():
    assert balance([1.0, 2.0, 3.0], 1) == ()
    assert balance([1.0, 2.0, 3.0], 3) == (1, 2)
    assert balance([3, 1, 4, 1, 5, 9, 2, 6], 3) == (4, 6)
    weights = [float((i * 7919) % 97) for i in range(3000)]
    cuts = balance(weights, 16)
    check_cuts(cuts, len(weights), 16)
    assert max(group_weights(weights, cuts)) <= sum(weights) / 16 + max(weights)


def test_balance_rejects_too_many_parts_and_bad_weights():
    with pytest.raises(PartitionError, match=r"3 unit\(s\) into 4 .*at most 3"):
        balance([1, 2, 3], 4)
    with pytest.raises(PartitionError, match="at least 1"):
        balance([1, 2, 3], 0)
    with pytest.raises(PartitionError, match="unit 1"):
        balance([1, -2, 3], 2)
