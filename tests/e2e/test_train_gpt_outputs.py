"""The example trainer's output files (--metrics, --trace), in process: a path that cannot be written is refused
before any training, and a write that fails while training (a full disk) is said once and training goes on. It
used to raise a raw OSError on rank 0 after a step, and the other ranks blamed a dead peer."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from zbcompile.examples.train_gpt import _append_metrics, parse_args


@pytest.mark.parametrize("flag", ["--metrics", "--trace"])
def test_an_output_path_that_cannot_be_written_is_refused_before_training(flag, tmp_path, capsys):
    for path, why in ((tmp_path / "no" / "m.jsonl", "no folder"), (tmp_path, "that is a folder")):
        with pytest.raises(SystemExit) as exit_:
            parse_args([flag, str(path)])
        assert exit_.value.code == 2 and why in capsys.readouterr().err
    assert getattr(parse_args([flag, str(tmp_path / "m.jsonl")]), flag[2:]) == tmp_path / "m.jsonl"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (a device that is always full)")
def test_metrics_on_a_full_disk_are_dropped_with_one_message(tmp_path, capsys):
    assert _append_metrics(Path("/dev/full"), 3, 1.5) is None
    assert "--metrics /dev/full: cannot write it (No space left on device)" in capsys.readouterr().err
    good = tmp_path / "m.jsonl"
    assert _append_metrics(good, 1, 2.0) == good and good.read_text() == '{"step": 1, "loss": 2.0}\n'
