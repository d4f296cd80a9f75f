"""The launcher of the multi-process tests (support/launch.py), with ranks forked from the test process's warm
interpreter (support/forked.py) and started cold (ZB_TEST_COLD_RANKS=1): a forked rank starts as `python worker.py`
would, its end is reported as Popen reports it, and a failure or a timeout ends every rank with what it started.
Ranks of tests/distributed/workers/launch_probe_worker.py, which imports no torch of its own (only its report
mode does, through `support`'s split memo), so that even a cold one starts in a fraction of a second."""

from __future__ import annotations

import os
import time

import pytest

from support import forked
from support.launch import _start_rank, child_env, launch, run_python

pytestmark = [pytest.mark.dist, pytest.mark.slow]

WORKER = os.path.join(os.path.dirname(__file__), "workers", "launch_probe_worker.py")


def _cold(monkeypatch, cold: bool) -> None:
    """Start ranks cold, or forked (the variable unset: a launch's environment is the warm interpreter's, which
    is not started anew)."""
    if cold:
        monkeypatch.setenv(forked.COLD, "1")
    else:
        monkeypatch.delenv(forked.COLD, raising=False)


@pytest.fixture(params=["forked", "cold"])
def start(request, monkeypatch):
    """How ranks start in this test."""
    _cold(monkeypatch, request.param == "cold")
    return request.param


def test_a_forked_rank_starts_as_a_cold_one(tmp_path, monkeypatch):
    """argv, sys.path[0], __main__, a session of its own, stdin from /dev/null, stdout into its log and the launch's
    environment: the same for both ways of starting."""
    seen = {}
    for how in ("forked", "cold"):
        _cold(monkeypatch, how == "cold")
        out = tmp_path / how
        out.mkdir()
        seen[how] = launch(WORKER, 2, out, "--mode", "report", timeout=120)
    for rank, (warm, cold) in enumerate(zip(seen["forked"], seen["cold"], strict=True)):
        assert warm["argv"][-2:] == cold["argv"][-2:] == ["--mode", "report"]
        assert warm["argv"][0] == cold["argv"][0] == WORKER
        assert {k: v for k, v in warm.items() if k != "argv"} == {k: v for k, v in cold.items() if k != "argv"}
        assert warm["env"]["RANK"] == str(rank) and warm["env"]["WORLD_SIZE"] == "2"
        assert warm["path0"] == os.path.dirname(WORKER) and warm["name"] == "__main__"
        assert warm["own_session"] and warm["stdin_is_null"] and warm["stdout_is_log"], warm


def test_the_first_rank_to_fail_is_named_with_its_traceback(tmp_path, start):
    """Rank 1 raises while rank 0 sleeps: the launch ends at once, names rank 1 and shows its traceback."""
    began = time.monotonic()
    with pytest.raises(AssertionError, match="rank 1 failed first") as err:
        launch(WORKER, 2, tmp_path, "--mode", "fail", timeout=120)
    assert "RuntimeError: rank 1 gives up on purpose" in str(err.value)
    assert time.monotonic() - began < 60   # rank 0 was killed, not waited for


def test_a_timeout_kills_every_rank_and_what_it_started(tmp_path, start):
    with pytest.raises(pytest.fail.Exception, match="ran past 10 s; every rank killed"):
        launch(WORKER, 2, tmp_path, "--mode", "hang", timeout=10)
    for r in range(2):
        pid = int((tmp_path / f"grandchild{r}").read_text())
        assert _gone(pid), f"rank {r}'s child {pid} outlived the launch"


@pytest.mark.parametrize("code,status,logged", [("0", 0, ""), ("3", 3, ""), ("kill", -9, ""),
                                                ("bad input", 1, "bad input")])
def test_an_ending_is_reported_as_popen_reports_it(tmp_path, start, code, status, logged):
    """sys.exit(0), sys.exit(3), SIGKILL and sys.exit("message") (the message on stderr, status 1)."""
    log = tmp_path / "rank0.log"
    env = child_env(RANK="0", WORLD_SIZE="1", OMP_NUM_THREADS="1")
    rank = _start_rank([WORKER, "--out", str(tmp_path), "--mode", "exit", "--code", code], env, log)
    assert rank.wait(timeout=60) == status and rank.returncode == status
    assert "rank 0 started" in log.read_text() and logged in log.read_text()


def _gone(pid: int, within: float = 10.0) -> bool:
    """Has process `pid` ended (and been reaped, by whoever is its parent now) within `within` seconds?"""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        with open(f"/proc/{pid}/stat") as fh:   # a zombie waiting for its new parent to reap it counts as gone
            if fh.read().split(") ")[-1].startswith("Z"):
                return True
        time.sleep(0.1)
    return False


def test_run_python_is_subprocess_run_of_the_same_command(tmp_path, start):
    """stdout, stderr, the exit status and the working directory as subprocess.run(capture_output=True) gives them,
    for a script and for `-m module` (the CLI tests run `python -m zbcompile ...` this way)."""
    out = run_python([WORKER, "--out", str(tmp_path), "--mode", "echo", "--echo", "a", "b c"], timeout=60,
                     cwd=tmp_path, RANK="0")
    assert (out.returncode, out.stdout, out.stderr) == (0, f"rank 0 started\na b c {tmp_path}\n", "to stderr\n")
    bad = run_python(["-m", "zbcompile", "plan", "--schedule", "no-such", "--pp", "2", "--microbatches", "4"],
                     timeout=120)
    assert bad.returncode == 2 and "unknown schedule 'no-such'" in bad.stderr and bad.stdout == "", bad
