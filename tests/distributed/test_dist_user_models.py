"""`zbcompile.compile` under torch.distributed (gloo, 2 ranks) with the automatic split, on user-model classes
that used to fail: blocks in an nn.ModuleDict, pipe_split() markers, state no stage reads. One launch of
tests/distributed/workers/dist_user_worker.py; each rank writes JSON that the tests read."""

from __future__ import annotations

import os

import pytest

from support.launch import launch

pytestmark = [pytest.mark.dist, pytest.mark.slow]

WORKER = os.path.join(os.path.dirname(__file__), "workers", "dist_user_worker.py")
PP = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return launch(WORKER, PP, tmp_path_factory.mktemp("user_models"))


@pytest.mark.parametrize("tag,points", [("dict", "layers."), ("marked", "pipe_split:0")])
def test_compiled_with_the_automatic_split_trains_equal_to_eager(ranks, tag, points):
    for r, res in enumerate(ranks):
        got = res[tag]
        assert "error" not in got, f"rank {r}: {got.get('error')}"
        assert got["split_points"] and got["split_points"][0].startswith(points), got["split_points"]
        assert abs(got["loss"] - got["loss_ref"]) <= 1e-5 * abs(got["loss_ref"]), (r, got)
        assert got["grad_err"] <= 1e-5, (r, got["where"], got["grad_err"])
        assert not got["ungraded_with_grad"], (r, got["ungraded_with_grad"])


def test_state_no_stage_reads_is_real_on_exactly_one_rank(ranks):
    held = [set(res["unused"]["real"]) for res in ranks]
    for name in ("blocks.0.spare", "blocks.0.freqs_saved", "blocks.3.spare", "blocks.3.freqs_saved", "step_count"):
        assert sum(name in h for h in held) == 1, (name, [sorted(h) for h in held])
