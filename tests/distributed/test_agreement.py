"""Ranks that disagree are refused on every rank with one error naming the first difference (zbcompile/agreement.py):
a model of another depth or width, another schedule, other microbatches, split points or options, and another
batch at step(). Two processes (gloo), one launch of tests/distributed/workers/agreement_worker.py; no case may
hang (the launch's timeout would fail it) or abort inside gloo (the worker would die)."""

from __future__ import annotations

import os
import re

import pytest

from support.launch import launch

pytestmark = [pytest.mark.dist, pytest.mark.slow]

WORKER = os.path.join(os.path.dirname(__file__), "workers", "agreement_worker.py")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return launch(WORKER, 2, tmp_path_factory.mktemp("agreement"))


@pytest.mark.parametrize("case,names", [
    ("layers", ["parameters, blocks.4.", "rank 0: none; rank 1: [32]"]),
    ("width", ["parameters, ", "rank 0: [64, 32] float32; rank 1: [64, 48] float32"]),
    ("schedule", ["options, schedule: rank 0: '1f1b'; rank 1: 'zb-h1'"]),
    ("microbatches", ["options, microbatches: rank 0: 4; rank 1: 8"]),
    ("split_points", ["options, split_points: rank 0: ('blocks.2',); rank 1: ('blocks.1',)"]),
    ("vocab_parallel", ["options, vocab_parallel: rank 0: True; rank 1: False"]),
    ("check_batch", ["options, check_batch: rank 0: True; rank 1: 3"]),
    ("loss_weights", ["stages, stage 1: rank 0: "]),
])
def test_ranks_that_built_different_things_refuse_on_every_rank(ranks, case, names):
    for r, res in enumerate(ranks):
        got = res[case]
        assert "refused" in got, f"rank {r} {case}: {got}"
        assert got["refused"].startswith(f"rank {r}: the pipeline's ranks compiled different things"), got
        for name in names:
            assert name in got["refused"], (name, got["refused"])


def test_different_batches_are_refused_and_the_pipeline_trains_after(ranks):
    """Another batch per rank, the rows shuffled on one rank, or four tokens changed by +1, -1, -1, +1 (which a
    position-weighted sum missed): DisagreementError naming the argument and the
    ranks, on every rank; then the same batch trains, equal to eager. With check_batch=2 the second call is not
    checked (it trains on what each rank was given) and the third is."""
    for r, res in enumerate(ranks):
        got = res["batch"]
        for case in ("other", "shuffled", "pattern", "every_2nd"):
            assert "refused" in got[case], (r, case, got[case])
            assert "step() was handed different batches: argument 0 on rank(s) [1]" in got[case]["refused"], got
        assert abs(got["same"]["loss"] - got["same"]["want"]) <= 1e-5 * got["same"]["want"], got["same"]
        assert got["unchecked"] == {"ran": True}, got["unchecked"]


def test_one_pipes_call_paired_with_anothers_on_a_peer_is_refused_on_every_rank(ranks):
    """Pipes of one job share the process groups; a call refused on one rank left rank 0 in pipe B's step while
    rank 1 ran pipe A's: DisagreementError on both, naming each rank's pipe and call (each pipe's number is drawn
    at compile, the same on every rank)."""
    assert ranks[0]["two_pipes"]["refused_here"] == "UsageError", ranks[0]["two_pipes"]
    assert ranks[0]["two_pipes"]["first"] == ranks[1]["two_pipes"]["first"]
    for r, res in enumerate(ranks):
        got = res["two_pipes"]["paired"]
        assert "refused" in got, (r, got)
        assert "the ranks are out of step (rank 0: pipe " in got["refused"], got
        said = re.search(r"rank 0: pipe (\d+) call 2; rank 1: pipe (\d+) call 2", got["refused"])
        assert said and said[1] != said[2], got


def test_a_rank_that_never_compiles_fails_its_peers_compile_after_the_timeout(ranks):
    got = ranks[0]["absent"]
    assert "failure" in got, got
    assert "comparing what each rank compiled" in got["failure"] and "timeout of 3 s" in got["failure"], got
    assert got["waited"] < 60, got   # the compile itself takes seconds; torch's own wait was 30 minutes
