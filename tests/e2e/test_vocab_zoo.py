"""Vocabulary parallelism across the transformers zoo (tests/support/zoo.py), as threaded pp=2 pipelines: every causal
and masked LM (rotary, ALiBi, learned positions, tied and untied heads, a biased decoder, mixtures of experts, Gemma 2's soft-capped logits)
under 1f1b+vocab and zbv+vocab over 4 microbatches (and Llama under every other kind of schedule) gives eager microbatch accumulation's loss, and every
gradient (each rank's rows of the vocabulary parameters against eager's same rows) within 1e-5 relative.
Architectures outside the pattern raise VocabError naming what was found."""

from __future__ import annotations

import contextlib
import copy
import math
import types

import pytest
import torch

from support import zoo
from support.loops import rel
from support.models import gpt
from support.zoo import MICROBATCHES, batch
from support.threaded import loopback_pipes, run_pipes, run_threaded, vocab_rank_grads
from zbcompile.compiler import compile_staged
from zbcompile.errors import VocabError
from zbcompile.options import CompileOptions
from zbcompile.passes.schedules import generate
from zbcompile.split import split_model

torch.set_num_threads(1)

LMS = ["llama", "mistral", "qwen2", "bloom", "gpt2", "gpt_neox", "opt", "bert_mlm", "roberta_mlm", "mixtral",
       "qwen2_moe", "gemma2"]
REFUSED = {   # a logits bias buffer after the head, one table looked up twice (encoder and decoder), no lookup
    "bart": "logits come from .*final_logits_bias", "t5": "2 embedding lookups on a \\[64, d\\] parameter",
    "vit": "not from a linear layer|0 embedding lookups",
}


def _eager(case, inputs, targets):
    ref = copy.deepcopy(case.model)
    n, total = len(inputs), 0.0
    for mb in zip(*(x.chunk(MICROBATCHES) for x in inputs + targets)):
        loss = case.loss_fn(ref(*mb[:n]), *mb[n:]) / MICROBATCHES
        loss.backward()
        total += loss.item()
    return ref, total


@pytest.mark.slow
@pytest.mark.parametrize("arch,schedule", [(arch, s) for arch in LMS for s in ("1f1b", "zbv")]
                         + [("llama", s) for s in ("gpipe", "zb-h2", "zb-auto", "v-min", "dualpipev", "dualpipe")])
def test_zoo_with_vocabulary_parallelism_matches_eager(arch, schedule):
    sched = generate(schedule, 2, MICROBATCHES, vocab=True)
    case, staged = zoo.split(arch, sched)   # one trace per architecture, split for each schedule
    inputs, targets = batch(case)
    ref, want = _eager(case, inputs, targets)
    losses, ranks, _ = run_threaded(case.model, staged, sched, inputs + targets)
    assert all(abs(v - want) <= 1e-5 * abs(want) for v in losses), (losses, want)
    vocab, rows = staged.vocab, staged.vocab.rows
    # a gradient that is zero in exact arithmetic (OPT's key biases: softmax ignores a shift of every score)
    # is float noise in both runs; it is measured against 1e-4 of the model's largest gradient instead
    floor = 1e-4 * max(p.grad.abs().max().item() for p in ref.parameters() if p.grad is not None)
    for r, name, p, want_grad in vocab_rank_grads(ranks, staged, sched, ref):
        if want_grad is None:
            continue
        if name in vocab.params:
            assert p.shape[0] == rows and not p.grad[want_grad.shape[0]:].any(), (r, name)
        got = p.grad[:want_grad.shape[0]]
        err = ((got - want_grad).abs().max() / want_grad.abs().max().clamp_min(floor)).item()
        assert err <= 1e-5, (arch, r, name, err)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "gpt2", "bloom", "opt", "bert_mlm", "mixtral", "gemma2"])
def test_zoo_evaluates_with_vocabulary_parallelism_as_eager_does(arch):
    """PipelineModule.evaluate() and pipe(x) in eval mode, on zbv+vocab: the mean loss and the whole logits
    eager's eval-mode model gives under no_grad (the loss on every rank, the logits on the last stage's), and no
    gradient written. (Positions: rotary, learned, ALiBi; tied and untied heads, a
    biased decoder, experts.)"""
    sched = generate("zbv", 2, MICROBATCHES, vocab=True)
    case, staged = zoo.split(arch, sched)
    inputs, targets = batch(case)
    n, ref = len(inputs), copy.deepcopy(case.model).eval()
    with torch.no_grad():
        want = sum(case.loss_fn(ref(*mb[:n]), *mb[n:]).item()
                   for mb in zip(*(t.chunk(MICROBATCHES) for t in inputs + targets))) / MICROBATCHES
    options = CompileOptions(schedule=sched, microbatches=MICROBATCHES)
    pipes = loopback_pipes(case.model, options, 2, compiled=compile_staged(staged, sched, options))
    with torch.no_grad():
        logits = ref(*inputs)
    got = run_pipes(lambda r: (pipes[r].eval().evaluate(*inputs, *targets), pipes[r](*inputs)), 2)
    assert all(abs(v - want) <= 1e-5 * abs(want) for v, _ in got), (arch, got, want)
    (held,) = [out for _, out in got if out is not None]
    assert held.shape == logits.shape and rel(held, logits) <= 1e-5, arch
    assert all(p.grad is None for pipe in pipes for p in pipe.parameters())


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_a_microbatch_of_ignored_targets_only_adds_no_gradient_with_vocabulary_parallelism(schedule):
    """A microbatch whose targets are all ignore_index (-100; prompt-only rows in SFT): eager's cross-entropy
    gives it loss 0/0 = NaN but zero gradient, so eager microbatch accumulation's loss is NaN and its gradients
    are the other microbatches'. The sharded loss (T) gives the same, in float64, instead of NaN in every
    gradient of the pipeline (its mean's 1 / count, with count 0, must not reach the gradient)."""
    case = gpt(layers=4, batch=2 * MICROBATCHES)
    model, loss_fn, (ids, targets) = case.model.double(), case.loss_fn, case.example
    targets = targets.clone()
    targets[:2] = -100    # microbatch 0 (rows 0-1): every target ignored
    sched = generate(schedule, 2, MICROBATCHES, vocab=True)
    staged = split_model(model, loss_fn, ((ids[:2],), (targets[2:4],)), num_stages=sched.num_model_stages,
                         vocab_shards=2)
    ref = copy.deepcopy(model)
    want = [loss_fn(ref(x), y).div(MICROBATCHES)
            for x, y in zip(ids.chunk(MICROBATCHES), targets.chunk(MICROBATCHES))]
    for loss in want:
        loss.backward()
    assert want[0].isnan() and all(loss.isfinite() for loss in want[1:])
    losses, ranks, _ = run_threaded(model, staged, sched, (ids, targets))
    assert all(math.isnan(v) for v in losses), losses   # as eager's sum, and as the pipeline without vocab_parallel
    for r, name, p, want_grad in vocab_rank_grads(ranks, staged, sched, ref):
        assert want_grad is not None and torch.isfinite(want_grad).all() and p.grad is not None, (r, name)
        assert torch.isfinite(p.grad).all(), (schedule, r, name)
        assert rel(p.grad[:want_grad.shape[0]], want_grad) <= 1e-10, (schedule, r, name)


class _Head(torch.nn.Module):
    """An LM whose head is written as a matmul or with its bias added after the product: `kind` says how."""

    def __init__(self, kind: str, v: int = 40, d: int = 16):
        super().__init__()
        self.kind, self.v = kind, v
        self.emb = torch.nn.Embedding(v, d)
        self.body = torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.Tanh(), torch.nn.Linear(d, d))
        self.w = torch.nn.Parameter(torch.randn(v, d) / 4)
        self.b = torch.nn.Parameter(torch.randn(v) / 4)

    def forward(self, ids):
        h = self.body(self.emb(ids))
        if self.kind == "tied matmul":   # h @ E.T: the head tied to the embedding table
            return h @ self.emb.weight.T
        if self.kind == "matmul + bias":
            return torch.matmul(h, self.w.transpose(0, 1)) + self.b
        if self.kind == "bias + linear":
            return self.b + torch.nn.functional.linear(h, self.w)
        if self.kind == "cast matmul":   # a cast written on the weight: export checks its metadata
            return h @ self.w.T.to(h.dtype)
        if self.kind == "cast linear":
            return torch.nn.functional.linear(h, self.w.to(h.dtype), self.b)
        if self.kind == "float32 head":   # autocast turned off for the head: its matmul in float32
            with torch.autocast("cpu", enabled=False):
                return torch.nn.functional.linear(h.float(), self.w, self.b)
        if self.kind == "linear + bias buffer":   # a bias that is no parameter (BART's final_logits_bias)
            return torch.nn.functional.linear(h, self.w) + self.b.detach()
        return h @ self.w.T * 1.0 + self.b   # a scale between: the bias is no longer linear's (still exact)


def _head_loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _head_step(model, autocast: torch.dtype | None = None) -> types.SimpleNamespace:
    """One 1f1b step of `model` with vocabulary parallelism at pp=2 (ranks as threads), and eager's microbatch
    accumulation on the same batch. Under `autocast` the split, the step and eager's forwards run in its region,
    eager's backward outside it, as torch advises. Returns ids, targets, sched, staged, losses, ranks, ref (the
    eager model after its backward) and want (eager's loss)."""
    ids, targets = torch.randint(0, 40, (2 * MICROBATCHES, 6)), torch.randint(0, 40, (2 * MICROBATCHES, 6))
    sched = generate("1f1b", 2, MICROBATCHES, vocab=True)

    def region():
        return torch.autocast("cpu", dtype=autocast) if autocast is not None else contextlib.nullcontext()

    ref, want = copy.deepcopy(model), 0.0
    with region():
        staged = split_model(model, _head_loss, ((ids[:2],), (targets[:2],)), num_stages=2, vocab_shards=2)
        losses, ranks, _ = run_threaded(model, staged, sched, (ids, targets))
    for x, y in zip(ids.chunk(MICROBATCHES), targets.chunk(MICROBATCHES)):
        with region():
            loss = _head_loss(ref(x), y) / MICROBATCHES
        loss.backward()
        want += loss.item()
    return types.SimpleNamespace(ids=ids, targets=targets, sched=sched, staged=staged, losses=losses, ranks=ranks,
                                 ref=ref, want=want)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tied matmul", "matmul + bias", "bias + linear", "cast matmul", "cast linear"])
def test_a_head_written_as_a_matmul_or_with_its_bias_added_after_is_sharded(kind):
    """A head written as `h @ W.T` (tied to the embedding table) or with its bias parameter added after the
    product was refused ("not from a linear layer"), and a cast written on the weight (`W.to(h.dtype)`, whose
    metadata check export adds) as "W read elsewhere". It is the one linear op the shards replace: the step's
    loss and every gradient (each rank's rows of W, b and E) equal eager's in float64, and in eval mode
    pipe(x) returns eager's logits and evaluate() its loss."""
    torch.manual_seed(0)
    model = _Head(kind).double()
    run = _head_step(model)
    ids, targets, sched, staged, ref = run.ids, run.targets, run.sched, run.staged, run.ref
    assert all(abs(v - run.want) <= 1e-10 * abs(run.want) for v in run.losses), (run.losses, run.want)
    graded = 0
    for r, name, p, want_grad in vocab_rank_grads(run.ranks, staged, sched, ref):
        assert (want_grad is None) == (p.grad is None), (kind, r, name)
        if want_grad is not None:
            assert rel(p.grad[:want_grad.shape[0]], want_grad) <= 1e-10, (kind, r, name)
            graded += name in staged.vocab.params
    heads = {"tied matmul": 1, "cast matmul": 2}.get(kind, 3)   # E, W, b
    assert graded == 2 * len(staged.vocab.params) == 2 * heads, graded
    options = CompileOptions(schedule=sched, microbatches=MICROBATCHES)
    pipes = loopback_pipes(model, options, 2, compiled=compile_staged(staged, sched, options))
    ref.eval()
    with torch.no_grad():
        logits = ref(ids)
        loss = sum(_head_loss(ref(x), y).item() for x, y in zip(ids.chunk(MICROBATCHES),
                                                                 targets.chunk(MICROBATCHES))) / MICROBATCHES
    got = run_pipes(lambda r: (pipes[r].eval().evaluate(ids, targets), pipes[r](ids)), 2)
    assert all(abs(v - loss) <= 1e-10 * abs(loss) for v, _ in got), (got, loss)
    (held,) = [out for _, out in got if out is not None]
    assert rel(held, logits) <= 1e-10, kind


@pytest.mark.slow
def test_a_tied_matmul_head_under_autocast_is_sharded():
    """`h @ E.T` traced under bfloat16 autocast casts the transposed table (`cast(E.T)`): the split makes it
    linear(h, cast(E)), as autocast's linear casts its weight; the step's loss and the table's gradient rows
    are eager autocast's (at bfloat16's tolerance)."""
    torch.manual_seed(0)
    run = _head_step(_Head("tied matmul"), torch.bfloat16)
    assert run.staged.vocab.params == ("emb.weight",)
    assert all(abs(v - run.want) <= 1e-2 * abs(run.want) for v in run.losses), (run.losses, run.want)
    for r, name, p, want_grad in vocab_rank_grads(run.ranks, run.staged, run.sched, run.ref):
        if name in run.staged.vocab.params:
            torch.testing.assert_close(p.grad[:want_grad.shape[0]], want_grad, rtol=5e-2, atol=5e-3)


@pytest.mark.slow
def test_a_float32_head_inside_bfloat16_autocast_is_sharded_in_float32():
    """The head under `torch.autocast(enabled=False)` (its matmul in float32, for stability) inside a bfloat16
    autocast step crashed with vocabulary parallelism ("index_add_(): self (BFloat16) and source (Float)"): the
    shard graphs were traced under the step's autocast, and every program ran under it again at the step. They
    are traced, and the programs run, outside it (the graphs hold the casts the trace made): loss and the
    head's gradient rows equal eager autocast's at float32's tolerance, the rest at bfloat16's."""
    torch.manual_seed(0)
    run = _head_step(_Head("float32 head"), torch.bfloat16)
    assert all(abs(v - run.want) <= 1e-5 * abs(run.want) for v in run.losses), (run.losses, run.want)
    for r, name, p, want_grad in vocab_rank_grads(run.ranks, run.staged, run.sched, run.ref):
        tol = 1e-5 if name in ("w", "b") else 2e-2
        assert rel(p.grad[:want_grad.shape[0]], want_grad) <= tol, (r, name)


@pytest.mark.parametrize("kind", ["linear + bias buffer", "scaled"])
def test_a_head_whose_added_bias_is_not_linears_is_still_refused(kind):
    """What is not one linear op stays refused, naming the op: a bias that is no parameter, a scale between."""
    torch.manual_seed(0)
    ids = torch.randint(0, 40, (2, 6))
    with pytest.raises(VocabError, match=r"logits come from `%add"):
        split_model(_Head(kind), _head_loss, ((ids,), (ids,)), num_stages=2, vocab_shards=2)


@pytest.mark.parametrize("arch", sorted(REFUSED))
def test_architectures_outside_the_pattern_say_why(arch):
    case = zoo.ZOO[arch]()
    with pytest.raises(VocabError, match=REFUSED[arch]):
        split_model(case.model, case.loss_fn, case.example, num_stages=2, vocab_shards=2)
