"""The shard_vocab split pass (passes/shard_vocab.py), in one process: the four vocabulary graphs, run shard by
shard with the collectives done by hand, reproduce eager cross-entropy (loss and every gradient, padded shards
and ignored targets included); the stage graphs read and return the vocabulary boundaries; the cut chooser
balances the blocks alone; what is not the pattern raises VocabError naming what was found."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from support.models import gpt
from zbcompile.errors import VocabError
from zbcompile.ir.names import VOCAB_EMB, VOCAB_X
from zbcompile.split import split_model

torch.set_num_threads(1)


def _shards(case, shards: int, num_stages: int = 2):
    return split_model(copy.deepcopy(case.model), case.loss_fn, case.example, num_stages=num_stages,
                       vocab_shards=shards)


def _run(g, **values):
    return g({**values})


@pytest.mark.parametrize("shards", [1, 2, 3, 5])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_shard_graphs_reproduce_cross_entropy(shards, reduction):
    """IF summed over shards = the lookup; S, all-gather, T = cross-entropy's loss and its gradients w.r.t. the
    head and its input; IB = the embedding's gradient; padded rows get nothing (V=61 over 2, 3 and 5 shards)."""
    torch.manual_seed(0)
    V, d, tokens = 61, 16, 12
    model = _Tiny(V, d)
    x = torch.randint(0, V, (3, 4))
    y = torch.randint(0, V, (3, 4))
    y[0, 1] = -100
    loss_fn = lambda logits, t: F.cross_entropy(logits.view(-1, V), t.view(-1), reduction=reduction)  # noqa: E731
    staged = split_model(copy.deepcopy(model), loss_fn, (x, y), num_stages=1, vocab_shards=shards)
    vocab = staged.vocab
    assert vocab.rows == -(-V // shards) and vocab.size == V
    emb_w = model.emb.weight.detach()
    head_w = model.head.weight.detach()
    hidden = torch.randn(tokens, d, dtype=torch.float64).float()
    demb = torch.randn(3, 4, d)
    seed = torch.tensor(0.5)

    def rows(w, r):
        part = w[r * vocab.rows:(r + 1) * vocab.rows]
        return torch.cat([part, part.new_zeros(vocab.rows - part.shape[0], *part.shape[1:])])

    g = vocab.graphs
    parts, stats, saved = [], [], []
    for r in range(shards):
        off = torch.tensor(r * vocab.rows)
        parts.append(g["if"]({"param:emb.weight": rows(emb_w, r), "vocab:offset": off, "data:0": x})["vocab:part"])
        out = g["s"]({"param:head.weight": rows(head_w, r), "vocab:x": hidden, "vocab:offset": off, "data:1": y})
        stats.append(out["vocab:stats"])
        saved.append((out["vocab:saved:0"], out["vocab:saved:1"]))
    gathered = torch.stack(stats)
    torch.testing.assert_close(sum(parts), F.embedding(x, emb_w), rtol=0, atol=0)
    # the independent reference: autograd through torch's cross-entropy
    h = hidden.clone().requires_grad_()
    w = head_w.clone().requires_grad_()
    ref = F.cross_entropy(F.linear(h, w), y.view(-1), reduction=reduction)
    (ref * seed).backward()
    dx, dw, losses = 0, [], []
    for r in range(shards):
        off = torch.tensor(r * vocab.rows)
        out = g["t"]({"vocab:gathered": gathered, "vocab:saved:0": saved[r][0], "vocab:saved:1": saved[r][1],
                      "vocab:x": hidden,
                      "param:head.weight": rows(head_w, r), "vocab:offset": off, "grad:loss": seed, "data:1": y})
        dx = dx + out["vocab:dx"]
        dw.append(out["grad:param:head.weight"])
        losses.append(out["loss"])
    for loss in losses:
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-6, atol=0)
    torch.testing.assert_close(dx, h.grad, rtol=1e-5, atol=1e-7)
    full = torch.cat(dw)
    torch.testing.assert_close(full[:V], w.grad, rtol=1e-5, atol=1e-7)
    assert not full[V:].any(), "a padded row got a gradient"
    # IB: the lookup's gradient, row by row
    e = emb_w.clone().requires_grad_()
    F.embedding(x, e).backward(demb)
    ib = torch.cat([g["ib"]({"vocab:demb": demb, "vocab:offset": torch.tensor(r * vocab.rows), "data:0": x})
                    ["grad:param:emb.weight"] for r in range(shards)])
    torch.testing.assert_close(ib[:V], e.grad, rtol=1e-6, atol=1e-7)
    assert not ib[V:].any()


def test_shard_graphs_under_autocast_compute_as_the_autocast_linear_does():
    """Compiled inside torch.autocast (bfloat16), the output layer's weight reaches the linear through a cast:
    S and T run the matmuls on the cast shard (as autocast's linear does), the softmax statistics in float32,
    and hand back the weight's gradient in the parameter's float32, the input's in bfloat16; against autograd
    through autocast's own linear and cross-entropy."""
    torch.manual_seed(0)
    V, d, shards = 61, 16, 2
    model, x, y = _Tiny(V, d), torch.randint(0, V, (3, 4)), torch.randint(0, V, (3, 4))
    loss_fn = lambda logits, t: F.cross_entropy(logits.view(-1, V), t.view(-1))  # noqa: E731
    with torch.autocast("cpu", dtype=torch.bfloat16):
        staged = split_model(copy.deepcopy(model), loss_fn, (x, y), num_stages=1, vocab_shards=shards)
    vocab, g = staged.vocab, staged.vocab.graphs
    head_w = model.head.weight.detach()
    hidden = torch.randn(12, d).to(torch.bfloat16)
    assert vocab.x.dtype == torch.bfloat16
    rows = [head_w[r * vocab.rows:(r + 1) * vocab.rows] for r in range(shards)]
    rows = [torch.cat([w, w.new_zeros(vocab.rows - w.shape[0], d)]) for w in rows]
    seed = torch.tensor(1.0)
    outs = [g["s"]({"param:head.weight": rows[r], "vocab:x": hidden, "vocab:offset": torch.tensor(r * vocab.rows),
                    "data:1": y}) for r in range(shards)]
    gathered = torch.stack([o["vocab:stats"] for o in outs])
    backs = [g["t"]({"vocab:gathered": gathered, "vocab:saved:0": o["vocab:saved:0"],
                     "vocab:saved:1": o["vocab:saved:1"], "vocab:x": hidden, "param:head.weight": rows[r],
                     "vocab:offset": torch.tensor(r * vocab.rows), "grad:loss": seed, "data:1": y})
             for r, o in enumerate(outs)]
    h, w = hidden.clone().requires_grad_(), head_w.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.cross_entropy(F.linear(h, w), y.view(-1))
    ref.backward()
    dw = torch.cat([b["grad:param:head.weight"] for b in backs])
    dx = sum(b["vocab:dx"] for b in backs)
    assert dw.dtype == torch.float32 and dx.dtype == torch.bfloat16
    torch.testing.assert_close(backs[0]["loss"], ref.detach(), rtol=1e-5, atol=0)
    torch.testing.assert_close(dw[:V], w.grad, rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(dx.float(), h.grad.float(), rtol=2e-2, atol=2e-3)


class _Capped(nn.Module):
    """Logits through ops on each logit alone: a scale, then Gemma 2's soft-cap, from a biased head."""

    def __init__(self, V: int, d: int) -> None:
        super().__init__()
        self.emb, self.mix, self.head = nn.Embedding(V, d), nn.Linear(d, d), nn.Linear(d, V)

    def forward(self, x):
        z = self.head(torch.tanh(self.mix(self.emb(x)))) * 2.0
        return torch.tanh(z / 3.0) * 3.0


@pytest.mark.parametrize("shards", [1, 2, 5])
def test_shard_graphs_take_the_gradient_through_ops_on_each_logit(shards):
    """A soft-capped, scaled head (V=61: padded over 2 and 5 shards): S applies the ops to the shard's logits,
    T takes the gradient back through them; loss, dx, dW and db equal autograd through the whole logits (float64,
    an ignored target, a float32 round trip in the loss) and padded rows get nothing."""
    torch.manual_seed(0)
    V, d = 61, 16
    model = _Capped(V, d).double()
    x, y = torch.randint(0, V, (3, 4)), torch.randint(0, V, (3, 4))
    y[0, 1] = -100
    loss_fn = lambda lg, t: F.cross_entropy(lg.float().double().view(-1, V), t.view(-1))  # noqa: E731
    vocab = split_model(copy.deepcopy(model), loss_fn, (x, y), num_stages=1, vocab_shards=shards).vocab
    assert "linear head.weight + head.bias -> mul -> div -> tanh -> mul -> cross_entropy" in vocab.pattern
    w, b = model.head.weight.detach(), model.head.bias.detach()
    hidden, seed = torch.randn(12, d, dtype=torch.float64), torch.tensor(0.5, dtype=torch.float64)

    def rows(t, r):
        part = t[r * vocab.rows:(r + 1) * vocab.rows]
        return torch.cat([part, part.new_zeros(vocab.rows - part.shape[0], *part.shape[1:])])

    def inputs(r):
        return {"param:head.weight": rows(w, r), "param:head.bias": rows(b, r), "vocab:x": hidden,
                "vocab:offset": torch.tensor(r * vocab.rows), "data:1": y}

    outs = [vocab.graphs["s"](inputs(r)) for r in range(shards)]
    gathered = torch.stack([o["vocab:stats"] for o in outs])
    backs = [vocab.graphs["t"]({**inputs(r), "vocab:gathered": gathered, "vocab:saved:0": o["vocab:saved:0"],
                                "vocab:saved:1": o["vocab:saved:1"], "grad:loss": seed}) for r, o in enumerate(outs)]
    h, hw, hb = (t.clone().requires_grad_() for t in (hidden, w, b))
    ref = loss_fn(torch.tanh(F.linear(h, hw, hb) * 2.0 / 3.0) * 3.0, y)
    (ref * seed).backward()
    torch.testing.assert_close(backs[0]["loss"], ref.detach(), rtol=1e-12, atol=0)
    torch.testing.assert_close(sum(o["vocab:dx"] for o in backs), h.grad, rtol=1e-10, atol=1e-14)
    for name, want in (("grad:param:head.weight", hw.grad), ("grad:param:head.bias", hb.grad)):
        got = torch.cat([o[name] for o in backs])
        torch.testing.assert_close(got[:V], want, rtol=1e-10, atol=1e-14)
        assert not got[V:].any(), f"a padded row got a gradient in {name}"


@pytest.mark.parametrize("logits,found", [
    (lambda z: z - z.logsumexp(-1, keepdim=True), "logsumexp"),            # reads the other logits
    (lambda z: torch.where(z > 0, z, z * 0.5), "where"),                   # a mask from the logits: a second reader
])
def test_ops_between_head_and_loss_that_are_not_per_logit_are_refused(logits, found):
    class _Mixed(_Tiny):
        def forward(self, x):
            return logits(self.head(torch.tanh(self.mix(self.emb(x)))))

    model, loss_fn, example = _case(model=_Mixed(32, 8))
    with pytest.raises(VocabError, match="vocab_parallel=True") as info:
        split_model(model, loss_fn, example, num_stages=1, vocab_shards=2)
    assert found in str(info.value), str(info.value)


class _Tiny(nn.Module):
    def __init__(self, V: int, d: int, tied: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, d)
        self.mix = nn.Linear(d, d)
        self.head = nn.Linear(d, V, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.emb(x))))


def test_stage_graphs_read_and_return_the_vocabulary_boundaries():
    staged = _shards(gpt(layers=4), 2)
    first, last = staged.stages[0], staged.stages[-1]
    assert VOCAB_EMB in first.f.inputs and "param:wte.weight" not in first.f.inputs
    assert "grad:" + VOCAB_EMB in first.b.outputs
    assert VOCAB_X in last.f.outputs and "loss" not in last.f.outputs and not last.has_loss
    assert "grad:" + VOCAB_X in last.b.inputs
    assert staged.vocab.params == ("wte.weight",)          # tied: one parameter, sharded once
    assert all("wte.weight" not in st.params for st in staged.stages)


def test_the_forward_returning_the_logits_reads_the_output_layer_whole():
    """The split keeps the last stage as cut for pipe(x): its output layer reads vocab:whole:<fqn>, a [shards,
    rows, d] value of the trace's own fake tensors on the model's device (inductor refused a meta tensor there
    beside the CPU ones), viewed and sliced back to [V, d]; the forward reads no targets."""
    from torch._subclasses.fake_tensor import FakeTensor

    case = gpt(layers=4)
    staged = split_model(case.model, case.loss_fn, case.example, num_stages=2, vocab_shards=2)
    og = staged.meta["outputs"]
    assert og.stage == 1 and [s.name for s in og.whole] == ["vocab:whole:wte.weight"]
    assert og.whole[0].shape == (staged.vocab.rows, 32)
    nodes = dict(zip(og.graph.inputs, og.graph.gm.graph.find_nodes(op="placeholder")))
    val = nodes["vocab:whole:wte.weight"].meta["val"]
    assert isinstance(val, FakeTensor) and val.device == case.example[0].device and tuple(val.shape) == (2, 32, 32)
    assert not [n for n in og.graph.inputs if n.startswith("param:wte") or n.startswith("data:1")]


def test_cuts_balance_the_blocks_alone():
    """With the head's work on every rank, the automatic cuts split 4 blocks 2 / 2; without, the balancer
    gives the last stage fewer blocks to make up for the head."""
    case = gpt(layers=4)
    model = case.model
    big = type(model)(model.cfg.__class__(vocab=4096, seq=model.cfg.seq, d=model.cfg.d, heads=model.cfg.heads,
                                          layers=4))
    x, y = case.example
    with_vocab = split_model(copy.deepcopy(big), case.loss_fn, (x, y), num_stages=2, vocab_shards=2)
    plain = split_model(copy.deepcopy(big), case.loss_fn, (x, y), num_stages=2)
    assert with_vocab.meta["split_points"] == ("blocks.2",)
    assert plain.meta["split_points"] != ("blocks.2",)


def _case(loss_fn=None, model=None, V=32, d=8):
    model = model or _Tiny(V, d)
    x, y = torch.randint(0, V, (2, 4)), torch.randint(0, V, (2, 4))
    loss_fn = loss_fn or (lambda logits, t: F.cross_entropy(logits.view(-1, V), t.view(-1)))
    return model, loss_fn, (x, y)


@pytest.mark.parametrize("loss_fn,found", [
    (lambda lg, t: F.cross_entropy(lg.view(-1, 32), t.view(-1), label_smoothing=0.1), "label_smoothing=0.1"),
    (lambda lg, t: F.mse_loss(lg, torch.zeros_like(lg)), "the loss is computed by"),
    (lambda lg, t: 2 * F.cross_entropy(lg.view(-1, 32), t.view(-1)), "the loss is computed by"),
    (lambda lg, t: F.cross_entropy(lg.view(-1, 32), t.view(-1)) + lg.mean(), "the loss is computed by"),
    (lambda lg, t: F.cross_entropy(lg[..., :16].reshape(-1, 16), t.view(-1) % 16), "input as [tokens, V=32]; it is [8, 16]"),
    (lambda lg, t: F.cross_entropy(lg.view(-1, 32), F.one_hot(t.view(-1), 32).float()),
     "targets as class indices, one per token; these (torch.float32, [8, 32]) are not"),
])
def test_a_loss_that_is_not_plain_cross_entropy_says_what_was_found(loss_fn, found):
    model, loss_fn, example = _case(loss_fn)
    with pytest.raises(VocabError, match="vocab_parallel=True") as info:
        split_model(model, loss_fn, example, num_stages=1, vocab_shards=2)
    assert found in str(info.value) and "fix:" in str(info.value)


class _Reused(_Tiny):
    def forward(self, x):
        h = self.emb(x) * self.emb.weight[0, 0]   # the table read outside the lookup
        return self.head(torch.tanh(self.mix(h)))


class _NoEmbedding(nn.Module):
    def __init__(self, V=32, d=8):
        super().__init__()
        self.inp = nn.Linear(4, d)
        self.head = nn.Linear(d, V, bias=False)

    def forward(self, x):
        return self.head(self.inp(x))


def test_a_vocabulary_parameter_used_elsewhere_is_refused():
    model, loss_fn, example = _case(model=_Reused(32, 8))
    with pytest.raises(VocabError, match="emb.weight .*also reads it"):
        split_model(model, loss_fn, example, num_stages=1, vocab_shards=2)


def test_a_model_without_an_embedding_lookup_is_refused():
    model = _NoEmbedding()
    x, y = torch.randn(2, 3, 4), torch.randint(0, 32, (2, 3))
    loss_fn = lambda logits, t: F.cross_entropy(logits.view(-1, 32), t.view(-1))  # noqa: E731
    with pytest.raises(VocabError, match="embedding lookups on a \\[32, d\\] parameter"):
        split_model(model, loss_fn, (x, y), num_stages=1, vocab_shards=2)


def test_one_rank_pipeline_with_one_shard_trains_equal_to_eager():
    """pp=1: the collectives have no group and exchange nothing; the loss and gradients are eager's."""
    from zbcompile.api import PipelineModule
    from zbcompile.ir.schedule import Schedule

    case = gpt(layers=2)
    schedule = Schedule.from_text("# zbcompile schedule one: microbatches=2 placement=0 pipelines=1\n"
                                  "rank 0: 0IF0 0IF1 0F0 0S0 0T0 0BW0 0IB0 0F1 0S1 0T1 0BW1 0IB1\n").validate()
    staged = _shards(case, 1, num_stages=1)
    pipe = PipelineModule.from_staged(copy.deepcopy(case.model), staged, schedule)
    x, y = case.example
    xb, yb = torch.cat([x, x.flip(0)]), torch.cat([y, y.flip(0)])
    ref = copy.deepcopy(case.model)
    want = sum((case.loss_fn(ref(a), b) / 2) for a, b in zip(xb.chunk(2), yb.chunk(2)))
    want.backward()
    assert abs(pipe.step(xb, yb) - want.item()) <= 1e-6 * want.item()
    grads = dict(ref.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("shards", [1, 2, 3])
def test_an_embedding_scaling_its_gradient_by_frequency_is_sharded_as_eager(shards):
    """nn.Embedding(scale_grad_by_freq=True) was refused. Each shard divides a token's gradient by its id's count
    over the whole batch: counted on the shard's own lookups, the other shards' ids (parked on row 0) would
    inflate row 0's count. The rows of every shard are the lookup's gradient (repeated ids, a padding id,
    an id on row 0 of a shard)."""
    torch.manual_seed(0)
    V, d = 13, 4
    model = _Tiny(V, d)
    model.emb = nn.Embedding(V, d, padding_idx=2, scale_grad_by_freq=True)
    x = torch.tensor([[0, 5, 5, 2], [7, 0, 0, 12], [5, 9, 2, 7]])
    loss_fn = lambda logits, t: F.cross_entropy(logits.view(-1, V), t.view(-1))  # noqa: E731
    staged = split_model(copy.deepcopy(model), loss_fn, (x, x), num_stages=1, vocab_shards=shards)
    rows = staged.vocab.rows
    demb = torch.randn(3, 4, d)
    e = model.emb.weight.detach().clone().requires_grad_()
    F.embedding(x, e, padding_idx=2, scale_grad_by_freq=True).backward(demb)
    ib = torch.cat([staged.vocab.graphs["ib"]({"vocab:demb": demb, "vocab:offset": torch.tensor(r * rows),
                                               "data:0": x})["grad:param:emb.weight"] for r in range(shards)])
    torch.testing.assert_close(ib[:V], e.grad, rtol=1e-6, atol=1e-7)


def test_a_schedule_and_a_split_that_disagree_on_vocabulary_parallelism_are_refused():
    from zbcompile.api import PipelineModule
    from zbcompile.errors import UsageError
    from zbcompile.passes.schedules import generate

    from zbcompile.runtime.loopback import LoopbackWorld

    case = gpt(layers=2)
    group = LoopbackWorld(2).group(0)   # refused before anything is exchanged
    with pytest.raises(UsageError, match="has no vocabulary actions but the model was split with .*insert_vocab"):
        PipelineModule.from_staged(copy.deepcopy(case.model), _shards(case, 2), generate("1f1b", 2, 2), group=group)
    plain = split_model(copy.deepcopy(case.model), case.loss_fn, case.example, num_stages=2)
    with pytest.raises(UsageError, match="has vocabulary actions but the model was split without"):
        PipelineModule.from_staged(copy.deepcopy(case.model), plain, generate("1f1b", 2, 2, vocab=True), group=group)
