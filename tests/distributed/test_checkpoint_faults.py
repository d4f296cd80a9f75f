"""Checkpoints survive a crash at any moment of a save, and a damaged one is refused by name with nothing changed
(zbcompile/checkpoint.py, checkpoint_files.py). Two processes (gloo) of tests/distributed/workers/ckpt_fault_worker.py:
one launch per crash point, in which one rank kills itself with SIGKILL while re-saving into a directory that
holds a complete checkpoint; then one launch loads every such directory and damaged copies of a good one."""

from __future__ import annotations

import os

import pytest

from support.launch import launch

pytestmark = [pytest.mark.dist, pytest.mark.slow]

WORKER = os.path.join(os.path.dirname(__file__), "workers", "ckpt_fault_worker.py")
# (where the victim dies, which rank dies, what the directory holds after the crash)
CRASHES = [("before_write", 1, "A"), ("during_write", 0, "A"), ("during_write", 1, "A"), ("after_write", 1, "A"),
           ("before_commit", 0, "A"), ("between_renames", 0, "A"), ("after_commit", 0, "B")]


@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    """Each crash point's checkpoint directory after the crash, and the verify launch's results."""
    dirs = []
    for point, victim, _ in CRASHES:
        out = tmp_path_factory.mktemp(f"crash_{point}_{victim}")
        d = out / "ckpt"
        with pytest.raises(AssertionError, match="wrote no results"):   # the victim never writes its results
            launch(WORKER, 2, out, "--crash", point, "--victim", str(victim), "--dir", str(d), timeout=600)
        assert (out / "killed").read_text() == point, f"rank {victim} did not die at {point}"
        dirs.append(str(d))
    out = tmp_path_factory.mktemp("verify")
    return dirs, launch(WORKER, 2, out, "--verify", ",".join(dirs), timeout=600)


@pytest.mark.parametrize("k", range(len(CRASHES)), ids=[f"{p}-rank{v}" for p, v, _ in CRASHES])
def test_a_crash_anywhere_in_a_save_leaves_a_complete_checkpoint(crashed, k):
    """The directory loads, holds the checkpoint from before the crashed save (or the new one, where the crash
    came after its commit), and the next step's loss equals eager training's from there."""
    dirs, ranks = crashed
    want = CRASHES[k][2]
    for r, res in enumerate(ranks):
        got = res[dirs[k]]
        assert "error" not in got, f"rank {r}:\n{got['error']}"
        assert got["holds"] == want, (r, got)
        assert abs(got["loss"] - got["want"]) <= 1e-6 * abs(got["want"]), (r, got)
    parent = os.path.dirname(dirs[k])
    assert not os.path.exists(os.path.join(parent, ".ckpt.previous")) or want == "A"


@pytest.mark.parametrize("case,message", [
    ("flipped", "checksum differs"),
    ("truncated", "bytes where"),
    ("missing_file", "is missing"),
    ("metadata", "damaged: .metadata"),
    ("manifest", "zbcompile-manifest.json cannot be read"),
    ("mistyped", "no checkpoint at"),
])
def test_a_damaged_checkpoint_is_refused_by_name_with_nothing_changed(crashed, case, message):
    _, ranks = crashed
    messages = set()
    for r, res in enumerate(ranks):
        got = res[case]
        assert "refused" in got, (r, case, got)
        assert message in got["refused"] and got["unchanged"], (r, got)
        messages.add(got["refused"])
    assert len(messages) == 1, messages   # every rank refused with the same findings
    if case == "flipped":
        assert "damaged: file __" in messages.pop()


def test_ranks_saving_to_other_directories_all_fail_at_once(crashed):
    """A relative path under other working directories: the ranks write two directories, and the rank that
    cannot read its share back failed alone while the other waited in the save's exchange for the group's
    timeout. Every rank now raises the same CheckpointError at once, saying to give a shared absolute path."""
    _, ranks = crashed
    got = [res["other_cwd"] for res in ranks]
    assert all("refused" in g for g in got), got
    assert all("every rank must see the same directory" in g["refused"] and g["seconds"] < 20 for g in got), got


def test_a_ctrl_c_during_a_save_stays_a_keyboard_interrupt_where_it_was_pressed(crashed):
    """Ctrl-C on rank 1 while the files are written: rank 1 raises KeyboardInterrupt (it was a CheckpointError,
    which a loop catching failed saves swallowed); rank 0 a CheckpointError naming rank 1's interrupt, without
    the advice to free disk space."""
    _, ranks = crashed
    got = [res["interrupted"] for res in ranks]
    assert [g.get("raised") for g in got] == ["CheckpointError", "KeyboardInterrupt"], got
    assert all("rank 1: KeyboardInterrupt" in g["message"] and "disk space" not in g["message"] for g in got), got
