"""The main job, run as a user runs it: torchrun with 2 ranks (gloo) training the example GPT."""

from __future__ import annotations

import os

import pytest

from support.launch import torchrun

pytestmark = [pytest.mark.dist, pytest.mark.slow]

ENV = dict(os.environ, OMP_NUM_THREADS="1")


def test_main_job_trains_under_torchrun():
    out = torchrun(["-m", "zbcompile.examples.train_gpt", "--schedule", "zb-h1", "--steps", "6", "--dim", "64",
                    "--layers", "2", "--seq", "32", "--clip-grad", "1.0", "--eval-every", "3"],
                   timeout=300, env=ENV)
    # on failure show the ranks' own last words (a C++ abort message comes before torchrun's summary)
    assert out.returncode == 0, out.stdout[-2000:] + "\n".join(
        line for line in out.stderr.splitlines() if "torch/distributed/elastic" not in line)[-6000:]
    steps = [line for line in out.stdout.splitlines() if line.startswith("[")]
    assert len(steps) == 6 and "6/6" in steps[-1] and "tok/s" in steps[-1] and "r1=" in steps[-1]
    losses = [float(line.split("loss ")[1].split()[0]) for line in steps]
    assert losses[-1] < losses[0]  # it learns: six AdamW steps on the tiny corpus
    # --clip-grad: every step prints the pipeline's gradient norm; --eval-every 3: two eval losses
    assert all("grad norm" in line for line in steps), steps
    evals = [float(line.split("eval loss ")[1]) for line in out.stdout.splitlines() if "eval loss" in line]
    assert len(evals) == 2 and evals[1] < evals[0] + 0.5, out.stdout
