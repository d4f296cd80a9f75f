"""The main job's --save / --resume, run as a user runs them: save after two steps with zb-h1, resume with
1f1b, and the resumed steps print the losses of an uninterrupted eager run of the same job."""

from __future__ import annotations

import json
import os
import runpy
import sys

import pytest
import torch

from support.launch import run_command, torchrun
from zbcompile.examples.gpt import GPT, GPTConfig, loss_fn
from zbcompile.examples.train_gpt import batches, corpus_tokens

pytestmark = [pytest.mark.dist, pytest.mark.slow]

JOB = ["--microbatches", "4", "--microbatch-size", "2", "--seq", "16", "--dim", "32", "--layers", "2", "--steps", "2"]


def _job(*args: str) -> list[float]:
    out = torchrun(["-m", "zbcompile.examples.train_gpt", *JOB, *args], timeout=300,
                   env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return [float(line.split("loss ")[1].split()[0]) for line in out.stdout.splitlines() if line.startswith("[")]


def _uninterrupted(steps: int) -> list[float]:
    """The job's model, data and AdamW in one process (the main job's defaults: seed 0, lr 3e-3)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=256, seq=16, d=32, heads=4, layers=2))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = batches(corpus_tokens(), 8, 16, seed=1)
    losses = []
    for _ in range(steps):
        x, y = next(data)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_main_job_resumes_from_its_checkpoint_at_another_schedule(tmp_path):
    want = _uninterrupted(4)
    first = _job("--schedule", "zb-h1", "--save", str(tmp_path / "ckpt"))
    second = _job("--schedule", "1f1b", "--resume", str(tmp_path / "ckpt"))
    printed = 1e-4   # the job prints losses with 4 decimals
    assert all(abs(g - w) <= printed for g, w in zip(first + second, want)) and len(first + second) == 4, \
        (first, second, want)


def test_a_job_whose_rank_dies_restarts_itself_and_ends_as_the_uninterrupted_one(tmp_path):
    """torchrun --max-restarts with --save-every 2 --resume auto: rank 1 kills itself (SIGKILL) after step 3 of
    the first attempt; rank 0 fails fast (the process group is unusable: it says so and exits 1), torchrun starts
    both again, they resume from the checkpoint of step 2 and run steps 3-6 on the data stream where it stopped:
    every step's loss equals the uninterrupted eager run's (float32, 1e-5). Rank 0 of that second attempt kills
    itself after its last save (a death in the teardown): the third attempt resumes after step 6, finds nothing
    left to train and ends the job with 0. --metrics holds each step once."""
    metrics = tmp_path / "metrics.jsonl"
    # --standalone: torchrun's own rendezvous on a free port (the restarted attempt registers with it again)
    out = run_command([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                       "--max-restarts", "2", "--monitor-interval", "0.2", "-m", "zbcompile.examples.train_gpt", *JOB[:-2], "--steps", "6",
                       "--save", str(tmp_path / "ckpt"), "--save-every", "2", "--resume", "auto",
                       "--kill-rank-at", "1:3", "--kill-rank-at", "0:6:1", "--metrics", str(metrics)],
                      timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-4000:]
    assert "the job must restart" in out.stderr, out.stderr[-3000:]
    assert "resumed from" in out.stdout and "after step 2" in out.stdout, out.stdout[-2000:]
    assert "nothing left to train: the checkpoint in" in out.stdout, out.stdout[-2000:]
    assert "is after step 6, and --steps 6 ends the job at step 6" in out.stdout, out.stdout[-2000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    # the first attempt's step 3 (trained after the checkpoint of step 2) is dropped when the second resumes
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6], rows
    want = _uninterrupted(6)
    for r in rows:
        assert abs(r["loss"] - want[r["step"] - 1]) <= 1e-5 * want[r["step"] - 1], (r, want)


def test_a_users_own_loop_restarted_by_torchrun_resumes_from_its_checkpoint(tmp_path):
    """A user's loop in which zb.compile starts the process group from torchrun's environment (not the main
    job's own start-up), saving a zbcompile.checkpoint every 2 steps; rank 1 dies after step 3. Under
    `torchrun --max-restarts 1` the restarted attempt's compile failed on every rank with gloo's raw
    "connectFullMesh failed": it read the dead attempt's addresses from torchrun's store. Each attempt keeps its
    own keys now: the second attempt resumes after step 2 and ends with eager's parameters after 4 SGD steps."""
    worker = os.path.join(os.path.dirname(__file__), "workers", "restart_worker.py")
    defined = runpy.run_path(worker)   # its model, batch and loss (not its main)
    steps, mse, model_and_batch = defined["STEPS"], defined["loss_fn"], defined["model_and_batch"]
    out = torchrun(["--max-restarts", "1", worker, str(tmp_path), str(tmp_path / "ckpt")], timeout=300,
                   env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    model, x, y = model_and_batch()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        sum(mse(model(a), b) / 4 for a, b in zip(x.chunk(4), y.chunk(4))).backward()
        opt.step()
        opt.zero_grad()
    want = {n: p.detach() for n, p in model.named_parameters()}
    for r in range(2):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert (got["attempt"], got["resumed_after"]) == (1, 2), got
        for n, value in got["params"].items():
            assert torch.allclose(torch.tensor(value, dtype=torch.float64), want[n], rtol=1e-12, atol=1e-14), (r, n)
