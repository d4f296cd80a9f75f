"""Split passes: every model, cut into S stages and run F / B / W stage by stage, equals eager PyTorch.

The reference runner (tests/support/reference.py) is the smallest possible pipeline runtime: F for stages
0..S-1, then B and W for stages S-1..0, wiring values by name only. Losses, parameter grads (tied aliases summed
over stages) and updated buffers must match a plain `loss.backward()` on a copy of the model.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from support import models
from support.reference import check_against_eager, run_staged
from zbcompile.passes import cost
from zbcompile.passes.trace import flatten_example, trace
from zbcompile.split import report, split_model, split_traced

torch.set_num_threads(1)


@functools.lru_cache(maxsize=None)
def _traced(name: str):
    case = getattr(models, name)()
    return case, trace(case.model, case.loss_fn, case.example)


@functools.lru_cache(maxsize=None)
def _staged(name: str, num_stages: int):
    """(case, StagedModel), shared by the tests: splitting costs seconds, the graphs are never mutated."""
    case, traced = _traced(name)
    return case, split_traced(case.model, traced, num_stages=num_stages)


# skipnet has four layers, so it stops at four stages; the others are built with enough units for eight
CASES = [(name, s) for name in ("mlp", "convnet", "gpt", "hf_gpt2") for s in (1, 2, 4, 8)]
CASES += [("skipnet", s) for s in (1, 2, 4)]


@pytest.mark.parametrize("name,num_stages", CASES)
def test_stages_match_eager(name, num_stages):
    case, staged = _staged(name, num_stages)
    assert len(staged.stages) == num_stages
    assert staged.stages[-1].has_loss and not any(st.has_loss for st in staged.stages[:-1])
    check_against_eager(staged, case)
    if num_stages == 2:
        check_against_eager(staged, case, fused=True)


def test_tied_weights_are_one_name():
    _, staged = _staged("gpt", 4)
    assert staged.tied == (("wte.weight", "lm_head.weight"),)
    users = [st.index for st in staged.stages if "wte.weight" in st.params]
    assert users == [0, 3]
    assert not any("lm_head.weight" in st.params for st in staged.stages)


def test_auto_split_cuts_between_blocks_and_wires_boundaries():
    _, staged = _staged("gpt", 4)
    points = staged.meta["split_points"]
    assert all(p.startswith("blocks.") for p in points)
    assert staged.stages[0].modules[:3] == ("wte", "wpe", "drop")
    assert staged.stages[-1].modules[-2:] == ("ln_f", "lm_head")
    for a, b, point in zip(staged.stages, staged.stages[1:], points):
        assert b.recv == a.send
        # between blocks the residual stream; inside one (a refined cut) also the block's branch value
        assert len(a.send) == 1 if point.count(".") == 1 else 1 <= len(a.send) <= 2, (point, a.send)
        for send in a.send:
            assert send.shape == (2, 8, 32) and send.dtype == torch.float32 and send.requires_grad
    assert staged.stages[0].data == (0,) and staged.stages[-1].data == (1,)
    assert all(st.data == () for st in staged.stages[1:-1])


def test_explicit_split_points():
    case, traced = _traced("skipnet")
    staged = split_traced(case.model, traced, split_points=["layers.2"])
    assert [st.modules for st in staged.stages] == [("layers.0", "layers.1"), ("layers.2", "layers.3")]


def test_pass_through_activation():
    case, traced = _traced("skipnet")
    staged = split_traced(case.model, traced, split_points=["layers.1", "layers.2", "layers.3"])
    skip = {s.name for s in staged.stages[0].send} & {s.name for s in staged.stages[2].send}
    assert len(skip) == 1, "h0 travels through stages 1 and 2"
    check_against_eager(staged, case)


def test_batchnorm_buffers_update_once():
    _, staged = _staged("convnet", 4)
    outs = [n for st in staged.stages for n in st.f.outputs if n.startswith("buffer:")]
    assert len(outs) == len(set(outs)) == 24  # 8 BNs x (running_mean, running_var, num_batches_tracked)
    for st in staged.stages:
        for name in st.f.outputs:
            if name.startswith("buffer:"):
                assert name[len("buffer:") :] in st.buffers


def test_dropout_masks_follow_the_rng():
    case = models.gpt(layers=2, dropout=0.1)
    staged = split_model(case.model, case.loss_fn, case.example, num_stages=2)
    check_against_eager(staged, case, seed=1)
    flat, _, _ = flatten_example(case.example)
    torch.manual_seed(2)
    loss_a, _, _ = run_staged(staged, case.model, flat)
    loss_b, _, _ = run_staged(staged, case.model, flat)
    assert not torch.equal(loss_a, loss_b), "each microbatch draws fresh masks"


def test_meta_device_model_traces_and_runs_with_real_parameters():
    meta = models.gpt(layers=2, device="meta")
    staged = split_model(meta.model, meta.loss_fn, meta.example, num_stages=2)
    assert all(p.is_meta for p in meta.model.parameters())
    real = models.gpt(layers=2)
    check_against_eager(staged, real)


def test_a_huggingface_model_on_meta_with_its_cache_traces_and_runs_with_real_parameters():
    """transformers' Llama with use_cache=True (its default) built on meta: the key-value cache starts as an
    empty tensor constant made on the model's device, which the stages kept on meta, so the split failed with
    torch's device mismatch. An empty constant comes to the example's device; the stages equal eager's."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, max_position_embeddings=16)
    with torch.device("meta"):
        meta = models.HFLogits(LlamaForCausalLM(cfg))
    torch.manual_seed(0)
    real = models.HFLogits(LlamaForCausalLM(cfg))
    example = (torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8)))
    staged = split_model(meta, models.gpt_loss, example, num_stages=2)
    check_against_eager(staged, models.Case(real, models.gpt_loss, example, 2))


def _mm_flops(graph) -> int:
    return sum(cost.node_cost(n).flops for n in graph.gm.graph.nodes if n.target is torch.ops.aten.mm.default)


def test_w_holds_the_weight_gradient_matmuls():
    _, staged = _staged("gpt", 8)
    block = next(st for st in staged.stages if st.modules == ("blocks.2",))
    b, w, bw = (cost.graph_cost(g.gm).flops for g in (block.b, block.w, block.bw))
    assert abs(b + w - bw) <= 0.02 * bw  # the split adds no work
    assert 0.35 * bw < w < 0.65 * bw and 0.35 * bw < b < 0.65 * bw
    # a Linear-dominated block: the matmuls split evenly (dx in B, dW in W)
    assert _mm_flops(block.b) == _mm_flops(block.w) > 0
    assert all(n.startswith("grad:param:") for n in block.w.outputs)
    assert all(n.startswith(("grad:act:", "wsaved:")) for n in block.b.outputs)


def test_conv_backward_split_into_dx_and_dw():
    _, staged = _staged("convnet", 2)
    conv_bw = torch.ops.aten.convolution_backward.default
    b_masks = [n.args[10] for n in staged.stages[1].b.gm.graph.nodes if n.target is conv_bw]
    w_masks = [n.args[10] for n in staged.stages[1].w.gm.graph.nodes if n.target is conv_bw]
    assert b_masks and all(list(m) == [True, False, False] for m in b_masks)
    assert w_masks and all(not m[0] and m[1] for m in w_masks)


def test_report_and_printable_graphs():
    _, staged = _staged("gpt", 2)
    text = report(staged)
    for word in ("stage", "F flops", "B flops", "W flops", "act:", "wte.weight = lm_head.weight"):
        assert word in text
    for st in staged.stages:
        for g in (st.f, st.b, st.w, st.bw):
            assert "def forward" in g.code
            g.gm.graph.lint()


def test_the_report_names_a_module_called_in_two_stages():
    """A module called before and after the cut runs in both stages (its weights in each, gradients summed): the
    report listed it in neither stage's modules nor among the tied parameters, as if it were not there."""
    class Net(torch.nn.Module):
        def __init__(self, d: int = 8):
            super().__init__()
            self.a, self.b, self.shared, self.c = (torch.nn.Linear(d, d) for _ in range(4))

        def forward(self, x):
            h = self.shared(torch.tanh(self.a(x)))
            return self.c(self.shared(torch.tanh(self.b(h))))   # `shared` again, after the cut

    torch.manual_seed(0)
    staged = split_model(Net(), F.mse_loss, (torch.randn(2, 8), torch.randn(2, 8)), split_points=["node:tanh_1"])
    assert all("shared.weight" in st.params for st in staged.stages)
    assert "  shared.weight, shared.bias  (stages [0, 1])" in report(staged).splitlines()


def test_frozen_parameters_get_no_grads():
    case = models.mlp()
    for p in case.model[:8].parameters():  # the whole first stage is frozen: nothing flows back into it
        p.requires_grad_(False)
    staged = split_model(case.model, case.loss_fn, case.example, split_points=["8"])
    first, second = staged.stages
    assert first.b.outputs == first.w.outputs == first.bw.outputs == ()
    assert not second.recv[0].requires_grad and second.b.outputs == ()
    check_against_eager(staged, case)


def test_non_differentiable_boundary_value():
    case = models.masknet()
    staged = split_model(case.model, case.loss_fn, case.example, split_points=["layers.1", "layers.2"])
    mask = [s for s in staged.stages[0].send if s.dtype == torch.bool]
    assert len(mask) == 1 and not mask[0].requires_grad
    assert mask[0] in staged.stages[1].send  # passed through the middle stage
    assert all(f"grad:{mask[0].name}" not in st.b.outputs + st.b.inputs for st in staged.stages)
    check_against_eager(staged, case)
