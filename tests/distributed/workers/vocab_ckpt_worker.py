"""One rank of tests/distributed/test_vocab_checkpoint.py (torchrun environment): a vocabulary-parallel checkpoint.

Train an untied GPT over 61 tokens (the last shard padded) two AdamW steps with 1f1b and vocab_parallel=True,
save with zbcompile.checkpoint, then load it into freshly initialized (perturbed) pipelines of other layouts
(zbv with vocabulary parallelism; zbv without it, whole tables on the end ranks) and run steps 3 and 4; the
saving pipeline runs steps 3 and 4 too (the uninterrupted run). Writes `<out>/rank<r>.json` and this rank's
vocabulary rows after step 2 (`<out>/rows<r>.pt`).
"""

from __future__ import annotations

import copy
import os
import traceback

import torch

torch.set_num_threads(1)

from ckpt_worker import train  # noqa: E402  (a sibling script: this one's folder is sys.path[0])
from support.ckpt import VOCAB_MICROBATCHES as M  # noqa: E402
from support.ckpt import vocab_case as case  # noqa: E402
from support.launch import worker_main  # noqa: E402

import zbcompile as zb  # noqa: E402
from zbcompile import checkpoint  # noqa: E402


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
