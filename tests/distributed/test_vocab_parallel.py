"""Vocabulary parallelism under torch.distributed (gloo, 2 and 4 ranks), against eager training in one process:
for 1f1b, zb-h1, zbv, v-half and interleaved-1f1b, on a GPT with tied embeddings, an untied one (a vocabulary
the ranks do not divide, ignored targets) and a HuggingFace GPT-2, the loss of 3 AdamW steps, the first step's
gradients (each rank's rows of the vocabulary parameters against the same rows of eager's) and the parameters
after the steps, in float64; in float32 (the default dtype) for 1f1b on the tied GPT. One launch of
tests/distributed/workers/vocab_worker.py per pipeline size."""

from __future__ import annotations

import os

import pytest

from support.launch import Launches, pipeline_fixtures

pytestmark = [pytest.mark.dist, pytest.mark.slow]

WORKER = os.path.join(os.path.dirname(__file__), "workers", "vocab_worker.py")
run, run_pp2 = pipeline_fixtures(Launches(WORKER))
SCHEDULES = ("1f1b", "zb-h1", "zbv", "v-half", "interleaved-1f1b")
TOL = 1e-5


CASES = [(m, s, "float64") for m in ("tied", "untied", "hf") for s in SCHEDULES] + [("tied", "1f1b", "float32")]
# (the float32 case: vocab_worker.FLOAT32)


@pytest.mark.parametrize("model,schedule,dtype", CASES)
def test_trains_equal_to_eager(run, model, schedule, dtype):
    """Losses of 3 steps, the first step's gradients and the eval-mode evaluate() after the steps within 1e-5
    relative (evaluate() writing no gradient); the parameters after 3 AdamW steps too in float64 (in float32 Adam turns summation-order noise in tiny gradients into ~1e-3 of a step, for
    eager against itself as well; tests/distributed/workers/vocab_worker.py)."""
    pp, ranks = run
    for r, res in enumerate(ranks):
        got = res[f"{model}/{schedule}/{dtype}"]
        assert "error" not in got, f"rank {r}:\n{got.get('error')}"
        for loss, ref in zip(got["losses"], got["ref_losses"], strict=True):
            assert abs(loss - ref) <= TOL * abs(ref), (r, got["losses"], got["ref_losses"])
        assert got["grad_err"] <= TOL, (r, got["where"], got["grad_err"])
        if dtype == "float64":
            assert got["param_err"] <= TOL, (r, got["param_err"])
        assert abs(got["evaluated"] - got["ref_evaluated"]) <= TOL * abs(got["ref_evaluated"]), \
            (r, got["evaluated"], got["ref_evaluated"])
        assert got["untouched"], f"rank {r}: evaluate() wrote a gradient"


@pytest.mark.parametrize("model", ["tied", "untied", "hf"])
def test_each_rank_holds_its_rows(run, model):
    """Every vocabulary parameter is [ceil(V/p), d] on every rank, under the parameter's own name."""
    pp, ranks = run
    for res in ranks:
        got = res[f"{model}/1f1b/float64"]
        assert got["shapes"], got
        for name, shape in got["shapes"].items():
            assert shape[0] == got["rows"] == -(-got["vocab"] // pp), (name, shape, got["rows"])


def test_parameter_bytes_balance_on_a_vocabulary_dominated_model(run):
    """With vocabulary parallelism the largest per-rank parameter bytes are within 10% of the smallest; without
    it the embedding and the head make the end ranks far heavier."""
    pp, ranks = run
    vocab = [res["bytes"]["vocab"] for res in ranks]
    plain = [res["bytes"]["plain"] for res in ranks]
    assert max(vocab) <= 1.10 * min(vocab), vocab
    assert max(plain) > 1.25 * min(plain), plain
