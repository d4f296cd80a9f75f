"""One rank of tests/distributed/test_agreement.py (torchrun environment): ranks that compile different things,
or are handed different batches, each refused with DisagreementError on every rank, before a tensor moves. Rank
r builds the variant `variant(r)` of each case; every case records the error each rank raised (or none), and
the launch goes on to the next case on the same process group (a refusal leaves it usable)."""

from __future__ import annotations

import copy
import traceback

import torch

torch.set_num_threads(1)

from support.launch import worker_main  # noqa: E402
from support.models import gpt  # noqa: E402

import zbcompile.api as zb  # noqa: E402
from zbcompile.errors import DisagreementError  # noqa: E402

M = 4


def compile_gpt(layers=4, d=None, schedule="1f1b", microbatches=M, **options):
    model, loss_fn, (x, y), _ = gpt(layers=layers, batch=2 * M)
    if d is not None:   # another width: the same GPT with d wider
        from zbcompile.examples.gpt import GPT, GPTConfig

        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab=64, seq=16, d=d, heads=2, layers=layers))
    return zb.compile(model, schedule=schedule, microbatches=microbatches, loss_fn=loss_fn,
                      example=((x[:2 * M // microbatches],), (y[:2 * M // microbatches],)), timeout=60, **options), x, y


CASES = {
    "layers": lambda r: compile_gpt(layers=4 if r == 0 else 6),
    "width": lambda r: compile_gpt(d=32 if r == 0 else 48),
    "schedule": lambda r: compile_gpt(schedule="1f1b" if r == 0 else "zb-h1"),
    "microbatches": lambda r: compile_gpt(microbatches=4 if r == 0 else 8),
    "split_points": lambda r: compile_gpt(split_points=["blocks.2"] if r == 0 else ["blocks.1"]),
    "vocab_parallel": lambda r: compile_gpt(vocab_parallel=r == 0),
    "check_batch": lambda r: compile_gpt(check_batch=True if r == 0 else 3),
    "loss_weights": lambda r: compile_weighted(r),
}


def compile_weighted(rank: int):
    """Class weights made on each rank, differing: the same graph code with other constants."""
    model, _, (x, y), _ = gpt(layers=4, batch=2 * M)
    weight = torch.ones(64) + rank * torch.arange(64) / 64

    def loss_fn(out, target):
        return torch.nn.functional.cross_entropy(out.flatten(0, 1), target.flatten(), weight=weight)

    return zb.compile(model, schedule="1f1b", microbatches=M, loss_fn=loss_fn, example=((x[:2],), (y[:2],)),
                      timeout=60)


def _pattern(x: torch.Tensor) -> torch.Tensor:
    """+1, -1, -1, +1 on four neighbouring tokens: the sum and any linearly weighted sum stay the same."""
    x = x.clone()
    x.view(-1)[4:8] += torch.tensor([1, -1, -1, 1])
    return x


def refusal(fn) -> dict:
    try:
        fn()
    except DisagreementError as e:
        return dict(refused=str(e))
    except Exception:
        return dict(other=traceback.format_exc())
    return dict(ran=True)


def batches(rank: int) -> dict:
    """One compile; a step on another batch per rank (refused), a step on rows shuffled on one rank (refused),
    then the same batch everywhere (trains, equal to eager), then with check_batch=2 a different batch on the
    second call is let through (unchecked) and on the third refused."""
    pipe, x, y = compile_gpt()
    ref = copy.deepcopy(gpt(layers=4, batch=2 * M).model)
    out = {"other": refusal(lambda: pipe.step(x + rank, y)),
           "shuffled": refusal(lambda: pipe.step(x.flip(0) if rank else x, y)),
           "pattern": refusal(lambda: pipe.step(_pattern(x) if rank else x, y))}
    loss = pipe.step(x, y)
    want = sum(torch.nn.functional.cross_entropy(ref(a).flatten(0, 1), b.flatten()).item()
               for a, b in zip(x.chunk(M), y.chunk(M))) / M
    out["same"] = dict(loss=loss, want=want)
    every, _, _ = compile_gpt(check_batch=2)
    every.step(x, y)
    out["unchecked"] = refusal(lambda: every.step(x + rank, y))   # the 2nd call: not checked
    out["every_2nd"] = refusal(lambda: every.step(x + rank, y))   # the 3rd: checked
    return out


def two_pipes(rank: int) -> dict:
    """Two pipes of one job share the process groups. Rank 0's A.step is refused (a batch of 3 rows there only)
    and rank 0 goes on to B.step while rank 1 runs A.step: the two steps pair message for message (the same
    model), so without the pipes' numbers in the call numbers both returned a loss, B's on rank 0 built from A's
    backward. Each must raise DisagreementError."""
    a, x, y = compile_gpt()
    b, _, _ = compile_gpt()
    out = {"first": [a.step(x, y), b.step(x, y)]}
    if rank == 0:
        try:
            a.step(x[:3], y[:3])
        except Exception as e:
            out["refused_here"] = type(e).__name__
        out["paired"] = refusal(lambda: b.step(x, y))
    else:
        out["paired"] = refusal(lambda: a.step(x, y))
    return out


def absent_peer(rank: int) -> dict:
    """Rank 1 never calls compile: rank 0's comparison of fingerprints waited the group's 30 minutes (torch's
    all_gather_object); it raises RuntimeFailure after compile's timeout. On a group of its own, so that the
    gather left pending there cannot pair with the next case's."""
    import time

    import torch.distributed as dist

    from zbcompile.errors import RuntimeFailure

    group = dist.new_group(backend="gloo")
    if rank != 0:
        return {"skipped": True}
    model, loss_fn, (x, y), _ = gpt(layers=4, batch=2 * M)
    start = time.perf_counter()
    try:
        zb.compile(model, schedule="1f1b", microbatches=M, loss_fn=loss_fn, example=((x[:2],), (y[:2],)),
                   timeout=3, group=group)
    except RuntimeFailure as e:
        return {"failure": str(e), "waited": time.perf_counter() - start}
    return {"ran": True}


def run(rank: int, pp: int, out: str) -> dict:
    results = {tag: refusal(lambda: case(rank)) for tag, case in CASES.items()}
    results["batch"] = batches(rank)
    results["two_pipes"] = two_pipes(rank)
    results["absent"] = absent_peer(rank)
    return results


if __name__ == "__main__":
    worker_main(run)
