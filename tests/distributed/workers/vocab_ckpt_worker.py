"""One rank of tests/test_vocab_checkpoint.py (torchrun environment): a vocabulary-parallel checkpoint.

Train an untied GPT over 61 tokens (the last shard padded) two AdamW steps with 1f1b and vocab_parallel=True,
save with zbcompile.checkpoint, then load it into freshly initialized (perturbed) pipelines of other layouts
(zbv with vocabulary parallelism; zbv without it, whole tables on the end ranks) and run steps 3 and 4; the
saving pipeline runs steps 3 and 4 too (the uninterrupted run). Writes `<out>/rank<r>.json` and this rank's
vocabulary rows after step 2 (`<out>/rows<r>.pt`).
"""

from __future__ import annotations

import copy
import os
import sys
import traceback

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(1)

from ckpt_worker import train  # noqa: E402
from launch import worker_main  # noqa: E402
from models import gpt  # noqa: E402

import zbcompile as zb  # noqa: E402
from zbcompile import checkpoint  # noqa: E402

M = 4


def case():
    base = gpt(layers=4, batch=1)
    torch.manual_seed(5)
    cfg = base.model.cfg.__class__(vocab=61, seq=base.model.cfg.seq, d=base.model.cfg.d,
                                   heads=base.model.cfg.heads, layers=4)
    model = type(base.model)(cfg)
    model.lm_head.weight = nn.Parameter(model.wte.weight.detach().clone() * 0.5)
    g = torch.Generator().manual_seed(9)
    x0, _ = base.example
    batches = [(torch.randint(0, 61, (M * x0.shape[0], x0.shape[1]), generator=g),
                torch.randint(0, 61, (M * x0.shape[0], x0.shape[1]), generator=g)) for _ in range(4)]
    return model, base.loss_fn, batches


def pipeline(model, loss_fn, batches, schedule: str, vocab: bool, perturb: bool = False):
    model = copy.deepcopy(model)
    if perturb:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1)
    x, y = batches[0]
    pipe = zb.compile(model, schedule=schedule, microbatches=M, loss_fn=loss_fn,
                      example=(x[: x.shape[0] // M], y[: y.shape[0] // M]), vocab_parallel=vocab)
    return pipe, torch.optim.AdamW(pipe.parameters(), lr=1e-2)


def run(rank: int, pp: int, out: str) -> dict:
    results = {}
    try:
        model, loss_fn, batches = case()
        pipe, opt = pipeline(model, loss_fn, batches, "1f1b", True)
        results["first"] = train(pipe, opt, batches[:2])
        ckpt = os.path.join(out, "ckpt")
        checkpoint.save(ckpt, pipe, opt)
        torch.save({n: p.detach() for n, p in pipe.named_parameters() if n in pipe.staged.vocab.params},
                   os.path.join(out, f"rows{rank}.pt"))
        results["rows"] = pipe.staged.vocab.rows
        results["uninterrupted"] = train(pipe, opt, batches[2:])
        for tag, schedule, vocab in (("zbv_vocab", "zbv", True), ("zbv_plain", "zbv", False)):
            other, other_opt = pipeline(model, loss_fn, batches, schedule, vocab, perturb=True)
            checkpoint.load(ckpt, other, other_opt)
            results[tag] = train(other, other_opt, batches[2:])
    except Exception:
        results["error"] = traceback.format_exc()
    return results


if __name__ == "__main__":
    worker_main(run)
