"""The training loops people write, across processes (gloo, pp=2 and pp=4): every case of
tests/distributed/workers/loop_worker.py against eager single-process training, on every rank. The same user
calls run threaded, with more variants, in tests/e2e/test_training_loop.py.
"""

from __future__ import annotations

import math
import os

import pytest

from support.launch import Launches, pipeline_fixtures

pytestmark = [pytest.mark.dist, pytest.mark.slow]

WORKER = os.path.join(os.path.dirname(__file__), "workers", "loop_worker.py")
run, run_pp2 = pipeline_fixtures(Launches(WORKER))


def _case(results, tag: str):
    """Every rank's result of case `tag`, failing with the rank's traceback where it raised."""
    for r, res in enumerate(results):
        assert "error" not in res[tag], f"rank {r} {tag}:\n{res[tag]['error']}"
        yield r, res[tag]


def _close(a: float, b: float, tol: float) -> bool:
    return abs(a - b) <= tol * abs(b)


def test_evaluate_and_forward_outputs_in_eval_mode(run):
    """A GPT with dropout under zbv: evaluate() equals eager's eval-mode loss; pipe(x) returns eager's eval
    outputs on the last stage's rank only; step() in eval mode or under no_grad is refused, and the next step
    trains."""
    pp, results = run
    holders = []
    for r, got in _case(results, "eval"):
        assert _close(got["got"], got["want"], 1e-6), (r, got)
        if got["holds_outputs"]:
            holders.append(r)
            assert got["out_err"] <= 1e-6, (r, got)
        assert all(got["refusals"]), (r, got["refusals"])
        assert math.isfinite(got["step"]) and got["graded"], (r, got)
    assert holders == got["last_stage_ranks"], holders


@pytest.mark.parametrize("model", ["gpt", "mlp"])
def test_a_shuffling_data_loader_hands_every_rank_the_same_batches_under_dropout(run, model):
    """The same seed on every rank, dropout in the model, DataLoader(shuffle=True) drawing its order from the
    global generator: each rank runs only its own stages' dropout, and the ranks' generators drifted apart, so
    from the second epoch on each rank was handed another batch without a word. The stages now draw from a
    stream of their own (zbcompile/rng.py): every rank's batches and generator stay the same, and dropout still
    draws new masks every step; also where only the first stage has dropout (`mlp`: the other ranks draw their
    one number all the same)."""
    pp, results = run
    got = [res for _, res in _case(results, f"shuffle/{model}")]
    for r, res in enumerate(got):
        assert res["sums"] == got[0]["sums"], (r, res["sums"], got[0]["sums"])
        assert res["rng"] == got[0]["rng"], r
        assert res["masks_differ"], r
        # an eval-mode evaluate() and pipe(x) drew one number each from the global generator, where eager's
        # eval forward draws nothing; a train-mode evaluate() draws (its dropout runs)
        assert res["eval_kept"] and res["train_drew"], (r, res["eval_kept"], res["train_drew"])


@pytest.mark.parametrize("dtype,tol", [("float64", 1e-12), ("bfloat16", 3e-2), ("float16", 5e-3)])
def test_every_floating_dtype_trains_equal_to_eager(run, dtype, tol):
    pp, results = run
    for r, got in _case(results, f"dtype/{dtype}"):
        assert _close(got["got"], got["want"], tol), (r, got)
        assert got["grad_err"] <= 10 * tol and got["grad_dtypes"] == [f"torch.{dtype}"], (r, got)


def test_autocast_around_compile_and_step(run):
    pp, results = run
    for r, got in _case(results, "autocast"):
        assert _close(got["got"], got["want"], 1e-6) and got["grad_err"] <= 1e-5, (r, got)
        assert got["refused_outside"], r


def test_grad_scaler_skips_an_overflow_on_every_rank(run):
    """float16 with pipe.grad_scaler(): losses and scales follow eager's GradScaler (the overflowing batch
    halves the scale); an inf in the last rank's gradients skips the optimizer step on every rank."""
    pp, results = run
    for r, got in _case(results, "scaler"):
        assert got["got"][3] == got["want"][3] == 2.0 ** 9, (r, got)
        for a, b in zip(got["got"], got["want"]):
            assert _close(a, b, 1e-3) or (math.isnan(a) and math.isnan(b)), (r, got)
        assert got["param_err"] <= 1e-3, (r, got)
        assert not got["stepped_on_inf"] and got["scale_after_inf"] == got["scale_before"] / 2, (r, got)


@pytest.mark.parametrize("norm", ["2", "inf"])
def test_clip_grad_norm_with_tied_weights_and_vocabulary_shards(run, norm):
    """zbv with vocab_parallel=True (the embedding tied to the sharded head): the total norm, the clipped
    gradients and the parameters after AdamW equal eager's on every rank."""
    pp, results = run
    for r, got in _case(results, f"clip/{norm}"):
        assert _close(got["got"], got["want"], 1e-12), (r, got)
        assert got["grad_err"] <= 1e-10 and got["param_err"] <= 1e-9, (r, got)


def test_a_nan_in_the_batch_skips_the_step_on_every_rank(run):
    pp, results = run
    for r, got in _case(results, "nan"):
        assert not got["finite"] and got["norm_is_nan"] and got["unchanged"] and got["clean_after"], (r, got)


def test_aux_loss_from_every_stage_matches_eager(run):
    """transformers' Mixtral with its router load-balancing loss (zbv at pp=2, 1f1b at pp=4)."""
    pp, results = run
    routers = 0
    for r, got in _case(results, "moe"):
        assert _close(got["got"], got["want"], 1e-5) and got["grad_err"] <= 1e-5, (r, got)
        routers += got["routers_graded"]
    assert routers == 4, routers   # one router per layer, each graded on the rank that holds it


def test_torchtitan_loss_with_vocabulary_parallelism(run):
    pp, results = run
    for r, got in _case(results, "titan"):
        assert _close(got["got"], got["want"], 1e-5) and got["grad_err"] <= 5e-5, (r, got)


@pytest.mark.parametrize("name", ["cnn_sequential", "three_linears", "few_ops"])
def test_models_with_few_modules_cut_into_four_stages(run, name):
    """A CNN whose layers sit in one Sequential (cut between its children), and models with fewer modules than
    stages (cut between ops): 4 stages, zbv at pp=2 and 1f1b at pp=4."""
    pp, results = run
    for r, got in _case(results, f"cut/{name}"):
        assert got["stages"] == 4, (r, got)
        if name != "cnn_sequential":
            assert any(c.startswith("node:") for c in got["cuts"]), (r, got["cuts"])
        assert _close(got["got"], got["want"], 1e-5) and got["grad_err"] <= 1e-5, (r, got)


def test_post_validated_steps_equal_synchronous_ones_across_processes(run):
    """zbv at pp=2 and pp=4: 20 AdamW steps (float64), max_norm at the median of eager's norms and a NaN batch.
    The synchronous step follows eager, and step(..., post_validate=True) over gloo equals it bit for bit on every
    rank (losses and parameters); the clipped steps and the skipped one are eager's, and exactly those were run
    again. A checkpoint saved right after the last post-validated step (still pending) loads as the synchronous
    run's state. (1f1b and zb-h1: below at pp=2; at pp=4 threaded, tests/e2e/test_post_validation.py.)"""
    _post_validated_equals_synchronous(*run, "zbv")


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_post_validated_1f1b_and_zb_h1_across_processes(run_pp2, schedule):
    """The same for 1F1B and ZB-H1 at pp=2."""
    _post_validated_equals_synchronous(*run_pp2, schedule)


def _post_validated_equals_synchronous(pp, results, schedule):
    for r, got in _case(results, f"postval/{schedule}"):
        for a, b in zip(got["sync"], got["want"]):
            assert _close(a, b, 1e-9) or (math.isnan(a) and math.isnan(b)), (r, got)
        assert [str(x) for x in got["post"]] == [str(x) for x in got["sync"]] and got["params_equal"], (r, got)
        assert got["loaded_equal"], (r, got)   # the checkpoint saved with a step pending holds its verdict
        assert got["clipped"] == got["want_clipped"] and got["skipped"] == [got["nan_step"]], (r, got)
        assert 0 < len(got["clipped"]) and got["redone"] == len(got["clipped"]) + 1, (r, got)
