"""`zbcompile inspect`, run as a user runs it (`python -m zbcompile inspect ...`, one process, forked from the test
process's warm interpreter: support/launch.run_python; tests/distributed/test_main_job.py runs the torchrun main
job)."""

from __future__ import annotations

import json
import subprocess

import pytest

from support.launch import run_python

pytestmark = pytest.mark.slow   # each test starts the CLI, which traces and lowers in a process of its own


def _run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return run_python(list(args), timeout=timeout)


def test_inspect_prints_every_rank_program_with_p2p_and_frees():
    out = _run("-m", "zbcompile", "inspect", "zbcompile.examples.train_gpt:tiny", "--pp", "2", "--schedule", "zbv",
               "--microbatches", "4")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "rank 0: stages [0, 3]" in text and "rank 1: stages [1, 2]" in text
    for op in ("zbcompile_runtime_abi_send", "zbcompile_runtime_abi_recv", "zbcompile_runtime_abi_wait_recv",
               "zbcompile_runtime_abi_free", "self.stage1_b", "self.stage3_w"):
        assert op in text, op
    assert "tied parameters" in text and "wte.weight" in text  # the stage report comes first
    # the stages are the ones zb.compile makes for this schedule: balanced per rank for the V placement
    from zbcompile.examples.train_gpt import tiny
    from zbcompile.passes.schedules import generate
    from zbcompile.split import report, split_model

    model, loss_fn, example = tiny()
    staged = split_model(model, loss_fn, example, placement=generate("zbv", 2, 4).stage_groups())
    assert report(staged) in text


def test_inspect_ops_view_and_bad_rank():
    out = _run("-m", "zbcompile", "inspect", "zbcompile.examples.train_gpt:tiny", "--pp", "2", "--schedule", "1f1b",
               "--rank", "1", "--ops")
    assert out.returncode == 0, out.stderr
    assert "# rank 1 of 1f1b" in out.stdout and "irecv(from 0" in out.stdout and "free(" in out.stdout
    bad = _run("-m", "zbcompile", "inspect", "zbcompile.examples.train_gpt:tiny", "--pp", "2", "--schedule", "zbv",
               "--rank", "5")
    # our error is a line of its own; torch may log warnings of its own before it (a CUDA build without triton)
    assert bad.returncode == 2 and "\nzbcompile: error:" in "\n" + bad.stderr and "Traceback" not in bad.stderr
    missing = _run("-m", "zbcompile", "inspect", "no_such_module:f", "--pp", "2", "--schedule", "zbv")
    assert missing.returncode == 2 and "cannot import module 'no_such_module'" in missing.stderr


@pytest.mark.parametrize("flags, named", [
    (("--pp", "0"), "argument --pp: expected a positive integer, got '0'"),
    (("--pp", "-1"), "argument --pp: expected a positive integer, got '-1'"),
    (("--pp", "2", "--microbatches", "0"), "argument --microbatches: expected a positive integer, got '0'"),
], ids=["pp-0", "pp-negative", "microbatches-0"])
def test_inspect_names_a_bad_count_as_zbcompile_plan_does(flags, named):
    """One line naming the argument (not the microbatches a bad --pp makes), status 2, before any tracing; a zero
    --microbatches is refused, not replaced by the default."""
    bad = _run("-m", "zbcompile", "inspect", "zbcompile.examples.train_gpt:tiny", *flags, "--schedule", "zbv")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr
    assert f"\nzbcompile: error: {named}" in "\n" + bad.stderr, bad.stderr


def test_inspect_vocab_parallel_shows_the_passes_and_the_collectives():
    out = _run("-m", "zbcompile", "inspect", "zbcompile.examples.train_gpt:tiny", "--pp", "2", "--schedule", "1f1b",
               "--vocab-parallel", "--ops")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "# vocabulary parallelism: embedding wte.weight[ids] ... linear wte.weight -> cross_entropy" in text
    for graph in ("vocab_if", "vocab_s", "vocab_t", "vocab_ib"):
        assert f"# ---- {graph} (" in text and (f"= {graph}(" in text or f"= {graph}_acc(" in text), graph
    for rank in (0, 1):   # every rank runs every microbatch's vocabulary passes, with their collectives
        for kind in ("IF", "S", "T", "IB"):
            assert f"[{rank}{kind}3]" in text, (rank, kind)
    for what in ("broadcast root 1", "all_gather root -1", "reduce root 1", "reduce root 0", "broadcast root 0"):
        assert what in text, what
    assert "wait_coll(" in text


def test_inspect_dp_shows_where_each_reduction_lands():
    out = _run("-m", "zbcompile", "inspect", "zbcompile.examples.train_gpt:tiny", "--pp", "2", "--schedule", "zbv",
               "--microbatches", "4", "--dp", "2", "--ops", "--rank", "1")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "data-parallel gradient reductions" in text and "actions left to hide it" in text
    assert "parameter all-gathers" not in text   # replicated
    table = text[text.index("data-parallel gradient reductions"):text.index("# ---- rank 1")]
    rows = [line.split() for line in table.splitlines()[3:] if line.strip()]
    assert rows and all(r[0] == "1" for r in rows)
    assert int(rows[0][-1]) > 0 and int(rows[-1][-1]) == 0   # the first bucket has compute left, the last none
    assert "dp_reduce(" in text and "wait_dp(h:dp0)" in text and "gradient group 1 of" in text
    bad = _run("-m", "zbcompile", "inspect", "zbcompile.examples.train_gpt:tiny", "--pp", "2", "--schedule", "zbv",
               "--dp", "0")
    assert bad.returncode == 2 and "argument --dp: expected a positive integer, got '0'" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_inspect_dp_shard_shows_where_each_gather_lands():
    """--dp-shard step: per rank, each parameter bucket's all-gather, the action it is posted after (one before
    the action it serves) and the action it is waited for before; the gradients are reduce-scattered."""
    out = _run("-m", "zbcompile", "inspect", "zbcompile.examples.train_gpt:tiny", "--pp", "2", "--schedule", "zbv",
               "--microbatches", "4", "--dp", "2", "--dp-shard", "step", "--ops", "--rank", "0")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    table = text[text.index("# parameter all-gathers"):text.index("# ---- rank 0")]
    rows = [line.split() for line in table.splitlines()[3:] if line.strip()]
    assert [r[-1] for r in rows] == ["0F0", "3F0"], table   # stage 0's parameters, then stage 3's
    assert rows[1][-2] == "0F1"   # posted one action before the one it serves
    assert "scatter over 2" in text and "wait_gather(h:ag1; bucket 1 over 2:" in text


def test_inspect_post_validate_shows_each_ranks_warm_up_and_the_validating_program():
    """--post-validate: per rank, the warm-up actions before its VALIDATE (zbv at pp=2 with 4 microbatches: rank
    0 runs chunk 0's first three forwards, rank 1 one) and the messages a rollback drains; then the validating
    programs, with the totals received, passed on and validated."""
    out = _run("-m", "zbcompile", "inspect", "zbcompile.examples.train_gpt:tiny", "--pp", "2", "--schedule", "zbv",
               "--microbatches", "4", "--post-validate", "--ops")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    table = text[text.index("# post-validation"):text.index("# ---- rank 0")]
    rows = [line.split() for line in table.splitlines()[3:] if line.strip()]
    parsed = [(r[0], r[2:2 + int(r[1])], r[2 + int(r[1])], " ".join(r[3 + int(r[1]):])) for r in rows]
    assert parsed == [("0", ["0F0", "0F1", "0F2"], "0", "-"), ("1", ["1F0"], "2", "from 0")], table
    assert "pv.totals = totals()" in text and "validate(pv.totals; drain 0 tag" in text
    assert "pv.totals = wait_recv(h:pv.totals)" in text and "pv.prefix = prefix(" in text


def test_inspect_refuses_a_factory_that_takes_arguments(capsys):
    """A factory is called with no arguments: one that needs some (here the schedule generator) is named with
    status 2, not a raw TypeError from the call."""
    from zbcompile.__main__ import main

    assert main(["inspect", "zbcompile.passes.schedules:generate", "--pp", "2", "--schedule", "1f1b"]) == 2
    err = capsys.readouterr().err
    assert "the factory is called with no arguments, but missing a required argument: 'name'" in err, err


def test_inspect_refuses_data_parallel_flags_without_dp(capsys):
    """--dp-shard and --dp-bucket-mb tune the data-parallel lowering: without --dp they would change nothing."""
    from zbcompile.__main__ import main

    for flag, value in (("--dp-shard", "step"), ("--dp-bucket-mb", "1")):
        assert main(["inspect", "zbcompile.examples.train_gpt:tiny", "--pp", "2", "--schedule", "1f1b", flag,
                     value]) == 2
        assert f"{flag} applies only with --dp N" in capsys.readouterr().err


def test_inspect_names_a_failing_factory_module_or_output_path_with_status_2(tmp_path, monkeypatch, capsys):
    """A factory that raises, a module whose own code fails at import, a factory returning no module, and an
    --svg / --json path that cannot be written (checked before anything compiles): each named with status 2 (they
    were raw tracebacks with status 1, the paths only after the whole compile)."""
    from zbcompile.__main__ import main

    (tmp_path / "zb_cli_factories.py").write_text(
        "def raises():\n    raise RuntimeError('factory boom')\n\n"
        "def not_module():\n    return 'abc', None, None\n")
    (tmp_path / "zb_cli_broken.py").write_text("raise RuntimeError('import boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    common = ["--pp", "2", "--schedule", "1f1b"]
    cases = [(["zb_cli_factories:raises"], "the factory raised RuntimeError: factory boom"),
             (["zb_cli_broken:anything"], "importing module 'zb_cli_broken' failed: RuntimeError: import boom"),
             (["zb_cli_factories:not_module"], "with an nn.Module model; its first item is a str"),
             (["zbcompile.examples.train_gpt:tiny", "--svg", str(tmp_path)], "cannot write --svg"),
             (["zbcompile.examples.train_gpt:tiny", "--memory", "--json", str(tmp_path / "no" / "x.json")],
              "does not exist; give a file path"),
             # a name the filesystem refuses raised OSError from the check itself
             (["zbcompile.examples.train_gpt:tiny", "--svg", str(tmp_path / ("a" * 300 + ".svg"))], "cannot write")]
    for args, said in cases:
        assert main(["inspect", args[0], *common, *args[1:]]) == 2, args
        err = capsys.readouterr().err
        assert said in err, (args, err)


def test_inspect_refuses_flags_its_view_would_drop_and_memory_follows_rank(tmp_path, capsys):
    """--capture-check --svg wrote nothing, --memory --post-validate printed the plain plan (without the
    snapshot and held gradients of a post-validated step), --memory --ops or --capture-check with a view dropped
    one of the views, --device without --offload changed nothing, --memory --rank 1 printed every rank: all but
    the last are refused before compiling, and the plan is that rank's alone."""
    from zbcompile.__main__ import main

    common = ["inspect", "zbcompile.examples.train_gpt:tiny", "--pp", "2", "--schedule", "1f1b"]
    cases = [(["--capture-check", "--svg", str(tmp_path / "c.svg")], "--svg writes the memory plan"),
             (["--memory", "--post-validate"], "--post-validate with --memory"),
             # --memory --ops printed the plan alone, --capture-check --ops the capture lines alone, --device
             # without --offload changed nothing
             (["--memory", "--ops"], "instead of the programs that --ops prints"),
             (["--capture-check", "--ops"], "not what --ops shows"),
             (["--capture-check", "--memory"], "not what --memory shows"),
             (["--device", "a100"], "--device a100 is the time model of activation offload's plan"),
             # (the capture check ran and printed first; "," was read as two split points)
             (["--replay-check", "2"], "--replay-check 2: give at least 3 steps"),
             (["--split-points", ","], "--split-points ',' holds an empty name")]
    for more, said in cases:
        assert main([*common, *more]) == 2, more
        assert said in capsys.readouterr().err, more
    assert not list(tmp_path.iterdir())
    out = tmp_path / "m.json"
    assert main([*common, "--memory", "--rank", "1", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert [r["rank"] for r in json.loads(out.read_text())["ranks"]] == [1], table
