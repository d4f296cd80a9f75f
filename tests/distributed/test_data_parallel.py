"""Pipeline x data parallel on a 2-D DeviceMesh (zbcompile/data_parallel.py): four processes (gloo) as dp=2 x
pp=2, one launch of tests/distributed/workers/dp_worker.py, every case against eager single-process training on
the global batch (float64)."""

from __future__ import annotations

import os

import pytest

from support.launch import launch

pytestmark = [pytest.mark.dist, pytest.mark.slow]

WORKER = os.path.join(os.path.dirname(__file__), "workers", "dp_worker.py")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return launch(WORKER, 4, tmp_path_factory.mktemp("dp"))


def _case(ranks, tag):
    for r, res in enumerate(ranks):
        assert "error" not in res[tag], f"rank {r} {tag}:\n{res[tag]['error']}"
        yield r, res[tag]


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "zbv", "interleaved-1f1b", "1f1b-vocab", "zbv-end",
                                      "zb-h1-bucket0", "zbv-local", "dualpipev"])
def test_replicated_data_parallel_trains_equal_to_eager(ranks, schedule):
    """Three AdamW steps: the global mean loss of each, every gradient (averaged over the replicas by the
    program's placed reductions) and the parameters after the last step equal eager's on the global batch, on
    every rank of both replicas, float64 to 1e-9 (float32 to 1e-5: the sharded float32 case). The variants:
    reductions at the end of the step, one all-reduce per gradient, each replica handed its own rows, DualPipeV's
    mirrored stages."""
    _trains_equal_to_eager(ranks, schedule)
    for r, got in _case(ranks, f"train/{schedule}"):
        assert got["replicated"], (r, got)


def _trains_equal_to_eager(ranks, schedule):
    tol = 1e-5 if schedule.endswith("float32") else 1e-9
    for r, got in _case(ranks, f"train/{schedule}"):
        for a, b in zip(got["got"], got["want"], strict=True):
            assert abs(a - b) <= tol * abs(b), (r, got)
        assert got["grad_err"] <= tol and got["param_err"] <= tol, (r, got)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "zbv", "interleaved-1f1b", "1f1b-vocab", "zbv-microbatch",
                                      "zbv-float32"])
def test_sharded_data_parallel_trains_equal_to_eager(ranks, schedule):
    """dp_shard=True: every parameter a DTensor shard over dp, gathered by the program where its actions read it,
    each gradient reduce-scattered where final. Three AdamW steps (on the shards): the losses, every gradient and
    parameter gathered from the replicas equal eager's on the global batch."""
    _trains_equal_to_eager(ranks, f"sharded-{schedule}")
    for r, got in _case(ranks, f"train/sharded-{schedule}"):
        assert got["sharded"], (r, got)


@pytest.mark.parametrize("case", ["eval", "eval/vocab", "eval/sharded-vocab"])
def test_evaluate_and_outputs_cover_the_global_batch(ranks, case):
    """evaluate() is the global batch's mean loss on every rank, pipe(x) its whole outputs on the last stage's
    rank of each replica, both equal to eager's in eval mode: plain, and vocabulary-parallel with the replicas'
    parameters replicated and sharded (the output layer gathered whole for pipe(x)). The same for a smaller
    global batch (3 microbatches per replica instead of the compiled 4)."""
    holders = []
    for r, got in _case(ranks, case):
        assert abs(got["got"] - got["want"]) <= 1e-9 * got["want"], (r, got)
        small, want_small = got["small"]
        assert abs(small - want_small) <= 1e-9 * want_small, (r, got)
        if got["holds"]:
            holders.append(r)
            assert got["out_err"] <= 1e-9 and got["small_out_err"] <= 1e-9, (r, got)
    assert len(holders) == 2, holders   # the last stage's rank of each replica, both with the whole batch


def test_replicas_evaluating_their_own_rows_of_other_sizes_weigh_each_microbatch_alike(ranks):
    """dp_batch="local" with replica 1 on its set's last, smaller batch (3 and 1 microbatches): evaluate() is the
    mean over the 4 microbatches on every rank (it averaged the replicas' means: 2 of the 3 rows' weight went
    to replica 1's one microbatch). With dp_gather="microbatch", whose gathers pair the replicas microbatch by
    microbatch, it is refused on every rank (every rank waited for the timeout, and the job was lost)."""
    for r, got in _case(ranks, "eval/uneven-local"):
        assert abs(got["got"] - got["want"]) <= 1e-9 * got["want"], (r, got)
    for r, got in _case(ranks, "eval/uneven-local-microbatch"):
        assert "the replicas were handed [3, 1] microbatches" in got.get("refused", ""), (r, got)


@pytest.mark.parametrize("gather", ["step", "microbatch"])
def test_uneven_shards_and_a_0_dim_parameter_train_equal_to_eager(ranks, gather):
    """Rows that do not split evenly (7 and 5 over 2 replicas: 4 + 3, 3 + 2), a one-row parameter (the second
    replica holds 0 rows), a 0-dim one (whole on both): padded gathers and reduce-scatters, 3 AdamW steps equal
    to eager on the global batch."""
    for r, got in _case(ranks, f"odd/{gather}"):
        for a, b in zip(got["got"], got["want"], strict=True):
            assert abs(a - b) <= 1e-9 * abs(b), (r, got)
        assert got["param_err"] <= 1e-9, (r, got)
        rows = got["local_rows"]
        replica = r // 2   # mesh (dp, pp): ranks 0, 1 are replica 0
        assert any(k.endswith("temperature") for k in rows) and all(
            v is None for k, v in rows.items() if k.endswith("temperature"))
        gates = [v for k, v in rows.items() if k.endswith("gate")]
        assert gates and all(v == (1 if replica == 0 else 0) for v in gates), rows
        out_features = {"0": 5, "1": 7, "2": 5, "3": 3}   # torch.chunk: ceil(d / 2) rows, then the rest
        for k, v in rows.items():
            if k.endswith("lin.weight"):
                d = out_features[k.split(".")[0]]
                assert v == (-(-d // 2) if replica == 0 else d // 2), (k, rows)


@pytest.mark.parametrize("case", ["clip", "clip/sharded"])
def test_gradient_norms_and_the_finite_check_cover_both_axes(ranks, case):
    """Replicated, every replica holds the whole gradients; sharded, each its rows of them: the norms (2, inf,
    torch's 0, the count of nonzero gradients, and -inf, the min |g|) add the replicas' shards exactly once."""
    for r, got in _case(ranks, case):
        assert got["clean"], (r, got)
        for norm in ("2.0", "inf", "0.0", "-inf"):
            a, b = got[norm]
            assert abs(a - b) <= 1e-9 * b, (r, norm, got)
        assert got["clipped"][1] <= 1e-9, (r, got)
        assert got["finite_after_nan"] is False, (r, got)


def test_a_checkpoint_saved_at_dp2_pp2_loads_at_pp4_and_into_the_plain_model(ranks):
    """Before it, a save rank 0 cannot prepare fails on every rank at once, replica 1's included (it used to wait
    for replica 0 alone, and a retried save then paired its wait with another collective)."""
    for r, got in _case(ranks, "checkpoint"):
        assert "rank 0: NotADirectoryError" in got["refused"] and "before this save" in got["refused"], (r, got)
        assert abs(got["got_pp4"] - got["want"]) <= 1e-9 * got["want"], (r, got)
        if r == 0:
            assert abs(got["got"] - got["want"]) <= 1e-9 * got["want"], got


def test_an_inf_in_one_replicas_rows_skips_the_scaled_step_everywhere(ranks):
    for r, got in _case(ranks, "scaler/sharded"):
        assert got["unchanged"] and got["scale"] == 8.0, (r, got)


@pytest.mark.parametrize("vocab", [False, True], ids=["zb-h1", "1f1b-vocab"])
def test_a_sharded_checkpoint_loads_at_every_layout(ranks, vocab):
    """Saved at pp=2 x dp=2 sharded (each rank writes its rows; vocabulary rows through their own row shards),
    loaded sharded, replicated, at pp=4 x dp=1 and into the plain model: the two steps after it (the second
    reads the loaded optimizer state) equal the uninterrupted eager run. The plain model's state dict (whole
    tensors) loads into a sharded pipe as well."""
    for r, got in _case(ranks, "checkpoint/sharded-vocab" if vocab else "checkpoint/sharded"):
        for tag in ("sharded", "replicated", "pp4") + (("plain",) if r == 0 else ()):
            for a, b in zip(got[tag], got["want"], strict=True):
                assert abs(a - b) <= 1e-9 * b, (r, tag, got)
        # PipelineModule.load_state_dict of whole tensors: each replica keeps its rows (of a vocabulary table,
        # the rows of its pipeline rank's rows)
        assert got["load_state_dict"] == 0.0, (r, got)


def test_bad_meshes_and_batches_are_refused(ranks):
    """Meshes without a pipeline dimension, a batch that is not the global one, replicas compiled with other
    options: refused on every rank, the batch by its global size (the size of one replica's share was named,
    telling a caller who passed 8 of the 16 rows to pass 8), replicas compiled with other options or handed other
    batches by the option and the ranks' numbers in the job (a replica's index in its group was named as if it
    were a rank, and the option was not named)."""
    for r, got in _case(ranks, "errors"):
        peer = r + 2 if r < 2 else r - 2   # (mesh ("dp", "pp"): replica 1 is ranks 2 and 3)
        low, high = min(r, peer), max(r, peer)
        assert got["replicas"].startswith(f"rank {r}: the data-parallel replicas (the same stages) compiled "
                                          "different things; the first difference is options, dp_bucket_mb: "
                                          f"rank {low}: 25.0; rank {high}: 0.0."), got["replicas"]
        assert got["batches"].startswith(f"rank {r}: step() was handed different batches: argument 0 on rank(s) "
                                         f"[{high}] differs from rank {low}'s, a data-parallel replica"), got
        assert "dimensions named 'dp' and 'pp'" in got["no_pp"], got
        assert "3-D DeviceMesh" in got["three_d"], got
        # the global batch's size, not one replica's (the half batch was told to pass the 8 rows it passed)
        assert "do not split into 4 equal microbatches on each of dp=2 replicas" in got["rows"], got
        for tag in ("rows", "half"):
            assert "every rank handed the global batch: a batch of 16 rows" in got[tag], got[tag]
        assert "dp_shard=True" in got["shard_without_dp"] and "no 2-D" in got["shard_without_dp"], got


def test_a_replica_that_dies_makes_the_others_fail_instead_of_hanging(ranks):
    """Rank 3 exits inside its trailing W: its replica peer (rank 1) raises at the wait for its bucket's
    all-reduce, naming it, and the others raise too (the launch's timeout would fail the test on a hang)."""
    assert ranks[3]["die"] == {"victim": True}
    for r in range(3):
        die = ranks[r]["die"]
        assert die.get("raised"), (r, die)
        assert "restart the job" in die["message"], (r, die)
    assert "data-parallel" in ranks[1]["die"]["message"], ranks[1]["die"]


@pytest.mark.parametrize("case", ["zbv", "sharded-zb-h1"])
def test_post_validated_steps_equal_synchronous_ones_with_data_parallelism(ranks, case):
    """step(..., optimizer=, max_norm=, post_validate=True) at dp=2 x pp=2, replicated and sharded: six AdamW
    steps, some clipping (each then run again), losses and every parameter gathered from the replicas bit for bit
    the synchronous step's on every rank of both replicas."""
    for r, got in _case(ranks, f"postval/{case}"):
        assert got["post"] == got["sync"] and got["params_equal"], (r, got)
        assert 0 < got["clipped"] < 6 and got["redone"] == got["clipped"], (r, got)
        assert got["sharded"] == case.startswith("sharded"), (r, got)
