"""Checkpoints of a vocabulary-parallel pipeline (each rank holds rows of the vocabulary tables): saved as
whole tables assembled from every rank's rows, they load into other layouts, with and without vocabulary
parallelism, and into the plain model. One launch of tests/distributed/workers/vocab_ckpt_worker.py at pp=2."""

from __future__ import annotations

import os

import pytest
import torch

from support.ckpt import vocab_case as case
from support.launch import launch
from zbcompile import checkpoint

pytestmark = [pytest.mark.dist, pytest.mark.slow]
WORKER = os.path.join(os.path.dirname(__file__), "workers", "vocab_ckpt_worker.py")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = tmp_path_factory.mktemp("vocab_ckpt")
    return out, launch(WORKER, 2, out)


@pytest.mark.parametrize("tag", ["zbv_vocab", "zbv_plain"])
def test_steps_after_loading_into_another_layout_equal_the_uninterrupted_run(saved, tag):
    _, ranks = saved
    for r, res in enumerate(ranks):
        assert "error" not in res, f"rank {r}:\n{res['error']}"
        for got, want in zip(res[tag], res["uninterrupted"], strict=True):
            assert abs(got - want) <= 1e-5 * abs(want), (r, tag, res[tag], res["uninterrupted"])


def test_the_plain_model_loads_the_whole_tables(saved):
    out, ranks = saved
    model, _, _ = case()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    checkpoint.load(out / "ckpt", model, opt)
    rows = ranks[0]["rows"]
    for r in range(2):
        for name, shard in torch.load(out / f"rows{r}.pt").items():
            table = model.get_parameter(name).detach()[r * rows:(r + 1) * rows]
            assert torch.equal(table, shard[: table.shape[0]]), (r, name)
