"""One rank of tests/distributed/test_vocab_parallel.py (torchrun environment): vocabulary parallelism against eager.

For each model (a GPT with tied embeddings, an untied one whose vocabulary does not divide by the ranks and whose
targets ignore some tokens, a HuggingFace GPT-2) and each schedule, compile with vocab_parallel=True (one split
per stage layout, shared by the schedules that use it), train 3 AdamW steps and compare with eager training of
a copy in one process (accumulating the microbatches' gradients, as the pipeline does): the loss of every step,
the first step's gradients (this rank's rows of each vocabulary parameter against the same rows of eager's),
the parameters after the 3 steps and the eval-mode evaluate() loss after them; in float64 for every schedule, and
in float32 (the default dtype) for 1f1b on the tied GPT without the parameters (Adam divides each gradient by its
running magnitude, so float32 summation-order noise in tiny gradients becomes ~1e-3 of a step in the parameters,
for eager against itself too). Writes `<out>/rank<r>.json`.
"""

from __future__ import annotations

import itertools
import copy
import traceback

import torch
from torch import nn

torch.set_num_threads(1)

from support.launch import worker_main  # noqa: E402
from support.models import gpt, hf_gpt2  # noqa: E402

from zbcompile.api import PipelineModule  # noqa: E402
from zbcompile.compiler import split_for  # noqa: E402
from zbcompile.passes.schedules import generate  # noqa: E402
from zbcompile.split import split_model  # noqa: E402

SCHEDULES = ("1f1b", "zb-h1", "zbv", "v-half", "interleaved-1f1b")
# float64 runs every schedule on every model and compares everything; float32 (the default dtype) once, 1f1b on
# the tied GPT, where its losses and gradients are compared: a float32 run of every schedule or model checked
# nothing the float64 runs do not (each is a split of its own, the launch's largest cost)
FLOAT32 = ("tied", "1f1b")
STEPS = 3


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def untied_gpt(layers: int, batch: int):
    """A GPT whose head is a Parameter of its own, over 61 tokens (no multiple of 2 or 4: the last shard is
    padded), with every fifth target ignored (-100)."""
    case = gpt(layers=layers, batch=batch)
    torch.manual_seed(3)
    cfg = case.model.cfg.__class__(vocab=61, seq=case.model.cfg.seq, d=case.model.cfg.d,
                                   heads=case.model.cfg.heads, layers=layers)
    model = type(case.model)(cfg)
    model.lm_head.weight = nn.Parameter(model.wte.weight.detach().clone() * 0.5)
    x, y = case.example
    x, y = x % 61, y % 61
    y = y.clone()
    y.view(-1)[::5] = -100
    return case._replace(model=model, example=(x, y))


def batch_of(case, m: int):
    """m microbatches like the example: ids and targets drawn from the vocabulary (ignored targets kept)."""
    x, y = case.example
    g = torch.Generator().manual_seed(11)
    vocab = case.model.get_input_embeddings().num_embeddings if hasattr(case.model, "get_input_embeddings") \
        else None
    vocab = vocab or next(mod.num_embeddings for mod in case.model.modules() if isinstance(mod, nn.Embedding))
    xb = torch.randint(0, vocab, (m * x.shape[0], *x.shape[1:]), generator=g)
    yb = torch.randint(0, vocab, (m * y.shape[0], *y.shape[1:]), generator=g)
    yb[torch.cat([y] * m) == -100] = -100
    return xb, yb


def eager(case, xb, yb, m: int):
    """Eager training with the pipeline's semantics, gradient accumulation over m microbatches (the step's loss
    is the mean of theirs): per step the loss, after the first step the gradients, the parameters after STEPS
    AdamW steps. (Against one full-batch backward the parameters differ by ~1e-3 after 3 AdamW steps by
    summation order alone: Adam divides by the gradient's running magnitude.)"""
    model = copy.deepcopy(case.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], None
    for step in range(STEPS):
        loss = 0.0
        for x, y in zip(xb.chunk(m), yb.chunk(m)):
            part = case.loss_fn(model(x), y) / m
            part.backward()
            loss += part.item()
        losses.append(loss)
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    model.eval()
    with torch.no_grad():   # the evaluation after the steps
        evaluated = sum(case.loss_fn(model(x), y).item() for x, y in zip(xb.chunk(m), yb.chunk(m))) / m
    return losses, grads, model.train(), evaluated


def pipelined(case, staged, schedule, xb, yb, ref_grads, ref_model, rank: int) -> dict:
    pipe = PipelineModule.from_staged(copy.deepcopy(case.model), staged, schedule)
    rows, vocab = staged.vocab.rows, set(staged.vocab.params)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    losses, grad_err, where = [], 0.0, ""

    def mine(name: str, full: torch.Tensor) -> tuple[torch.Tensor, slice]:
        """Eager's rows of a vocabulary parameter that this rank's shard holds (the rest: padding)."""
        if name not in vocab:
            return full, slice(None)
        part = full[rank * rows:(rank + 1) * rows]
        return part, slice(0, part.shape[0])

    for step in range(STEPS):
        losses.append(pipe.step(xb, yb))
        if step == 0:
            for n, p in pipe.named_parameters():
                want, keep = mine(n, ref_grads[n])
                err = rel(p.grad[keep], want)
                if err > grad_err:
                    grad_err, where = err, n
                if n in vocab and keep.stop < rows:   # the padded rows never get a gradient
                    grad_err = max(grad_err, p.grad[keep.stop:].abs().max().item())
        opt.step()
        opt.zero_grad()
    evaluated = pipe.eval().evaluate(xb, yb)
    untouched = all(p.grad is None for p in pipe.parameters())
    param_err = max(rel(p.detach()[mine(n, ref_model.get_parameter(n))[1]], mine(n, ref_model.get_parameter(n))[0])
                    for n, p in pipe.named_parameters())
    shapes = {n: list(p.shape) for n, p in pipe.named_parameters() if n in vocab}
    param_bytes = sum(p.numel() * p.element_size() for p in pipe.parameters())
    return dict(losses=losses, grad_err=grad_err, where=where, param_err=param_err, shapes=shapes,
                param_bytes=param_bytes, evaluated=evaluated, untouched=untouched)


def held_bytes(pp: int, vocab_parallel: bool) -> int:
    """Parameter bytes this rank holds for a vocabulary-dominated GPT (V=4096, d=32, 2 blocks per rank) under
    1F1B, with or without vocabulary parallelism."""
    case = gpt(layers=2 * pp, batch=1)
    cfg = case.model.cfg.__class__(vocab=4096, seq=case.model.cfg.seq, d=case.model.cfg.d,
                                   heads=case.model.cfg.heads, layers=2 * pp)
    model = type(case.model)(cfg)
    model.lm_head.weight = nn.Parameter(model.wte.weight.detach().clone())   # untied: two [V, d] tables
    x, y = case.example
    schedule = generate("1f1b", pp, pp, vocab=vocab_parallel)
    staged = split_model(model, case.loss_fn, (x, y), num_stages=pp, vocab_shards=pp if vocab_parallel else None)
    pipe = PipelineModule.from_staged(model, staged, schedule)
    return sum(p.numel() * p.element_size() for p in pipe.parameters())


def run(rank: int, pp: int, out: str) -> dict:
    m = 2 * pp
    cases = {"tied": gpt(layers=2 * pp, batch=1), "untied": untied_gpt(2 * pp, 1), "hf": hf_gpt2(layers=2 * pp, batch=1)}
    results = {}
    for (tag, case), dtype in itertools.product(cases.items(), (torch.float32, torch.float64)):
        if dtype == torch.float32 and tag != FLOAT32[0]:
            continue
        case = case._replace(model=case.model.to(dtype))
        xb, yb = batch_of(case, m)
        ref_losses, ref_grads, ref_model, ref_evaluated = eager(case, xb, yb, m)
        splits = {}
        for name in SCHEDULES if dtype == torch.float64 else FLOAT32[1:]:
            key = f"{tag}/{name}/{str(dtype).removeprefix('torch.')}"
            try:
                schedule = generate(name, pp, m, vocab=True)
                layout = (schedule.num_model_stages, schedule.stage_groups())
                if layout not in splits:
                    splits[layout] = split_for(copy.deepcopy(case.model), case.loss_fn, case.example, schedule)
                got = pipelined(case, splits[layout], schedule, xb, yb, ref_grads, ref_model, rank)
                results[key] = dict(got, ref_losses=ref_losses, ref_evaluated=ref_evaluated,
                                    vocab=splits[layout].vocab.size, rows=splits[layout].vocab.rows)
            except Exception:
                results[key] = dict(error=traceback.format_exc())
    results["bytes"] = {"vocab": held_bytes(pp, True), "plain": held_bytes(pp, False)}
    return results


if __name__ == "__main__":
    worker_main(run)
