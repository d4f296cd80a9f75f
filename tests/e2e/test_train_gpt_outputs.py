"""The example trainer's output files (--metrics, --trace), in process: a path that cannot be written is refused
before any training, and a write that fails while training (a full disk) is said once and training goes on. It
used to raise a raw OSError on rank 0 after a step, and the other ranks blamed a dead peer."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from zbcompile.examples.train_gpt import _append_metrics, _metrics_until, parse_args


@pytest.mark.parametrize("flag", ["--metrics", "--trace"])
def test_an_output_path_that_cannot_be_written_is_refused_before_training(flag, tmp_path, capsys):
    for path, why in ((tmp_path / "no" / "m.jsonl", "no folder"), (tmp_path, "that is a folder")):
        with pytest.raises(SystemExit) as exit_:
            parse_args([flag, str(path)])
        assert exit_.value.code == 2 and why in capsys.readouterr().err
    assert getattr(parse_args([flag, str(tmp_path / "m.jsonl")]), flag[2:]) == tmp_path / "m.jsonl"


def test_bad_numbers_and_a_save_folder_that_cannot_take_a_checkpoint_are_refused_before_training(
        tmp_path, capsys, monkeypatch):
    """--microbatches 0 and --seq beyond the corpus raised raw RuntimeErrors on every rank, --lr -1 a raw
    ValueError, --eval-every -1 and a --kill-rank-at rank the job does not have were accepted, and a --save
    folder holding other files (or a plain file) was refused only at the first save, after every step."""
    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    plain = tmp_path / "file"
    plain.write_text("x")
    monkeypatch.setenv("WORLD_SIZE", "2")
    cases = [(["--microbatches", "0"], "--microbatches 0: give a positive number"),
             (["--microbatch-size", "0"], "--microbatch-size 0"), (["--seq", "0"], "--seq 0"),
             (["--seq", "100000"], "--seq 100000: the shipped corpus has"), (["--lr", "-1"], "--lr -1.0"),
             (["--eval-every", "-1"], "--eval-every -1"), (["--kill-rank-at", "9:1"], "has ranks 0..1"),
             (["--clip-grad", "-1"], "--clip-grad -1.0: give a positive gradient norm"),   # (it flipped them)
             (["--save", str(foreign)], "not a checkpoint, holding keep.txt"),
             (["--save", str(plain)], "is a file, not a checkpoint directory")]
    for argv, says in cases:
        with pytest.raises(SystemExit) as exit_:
            parse_args(argv)
        assert exit_.value.code == 2 and says in capsys.readouterr().err, argv
    assert (foreign / "keep.txt").read_text() == "mine"
    assert parse_args(["--save", str(tmp_path / "new"), "--kill-rank-at", "1:2"]).save == tmp_path / "new"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (a device that is always full)")
def test_metrics_on_a_full_disk_are_dropped_with_one_message(tmp_path, capsys):
    assert _append_metrics(Path("/dev/full"), 3, 1.5) is None
    assert "--metrics /dev/full: cannot write it (No space left on device)" in capsys.readouterr().err
    good = tmp_path / "m.jsonl"
    assert _append_metrics(good, 1, 2.0) == good and good.read_text() == '{"step": 1, "loss": 2.0}\n'


def test_a_resumed_run_drops_the_metrics_of_the_steps_it_trains_again(tmp_path):
    """A restart from the checkpoint of step 2 trains step 3 again: its line from the killed attempt (and a line
    the kill cut short) go, so that --metrics holds each step once; the lines up to the checkpoint stay."""
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1, "loss": 5.0}\n{"step": 2, "loss": 4.5}\n{"step": 3, "loss": 4.2}\n{"step": 4, "lo')
    assert _metrics_until(path, 2) == path
    assert path.read_text() == '{"step": 1, "loss": 5.0}\n{"step": 2, "loss": 4.5}\n'
    assert _metrics_until(tmp_path / "new.jsonl", 2) == tmp_path / "new.jsonl"   # nothing there yet
