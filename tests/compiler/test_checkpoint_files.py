"""A checkpoint's failures in one process, into the plain model (zbcompile/checkpoint.py, checkpoint_files.py): a
failed write, a damaged checkpoint without a manifest, a malformed or edited manifest. Each is a CheckpointError
that says what is wrong, with the model, the optimizer and the previous checkpoint untouched.
tests/distributed/test_checkpoint_faults.py crashes and damages checkpoints across ranks."""

from __future__ import annotations

import errno
import json
import shutil
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.filesystem as dcp_files
from torch.distributed.checkpoint.state_dict import get_state_dict

from zbcompile import checkpoint
from zbcompile import checkpoint_files as files
from zbcompile.errors import CheckpointError, ZBCompileError
from zbcompile.examples.gpt import GPT, GPTConfig


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab=64, seq=8, d=16, heads=2, layers=2))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint of a model and its AdamW state after one step, saved with extra={"step": 2}."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.zeros(2, 8, dtype=torch.long)).sum().backward()
    opt.step()
    path = tmp_path_factory.mktemp("saved") / "ckpt"
    checkpoint.save(path, model, opt, extra={"step": 2})
    return path


def _copy(saved, tmp_path):
    return shutil.copytree(saved, tmp_path / "ckpt")


def _manifest(path) -> dict:
    return json.loads((path / files.MANIFEST).read_text())


def _load(path) -> dict:
    model = _model()
    return checkpoint.load(path, model, torch.optim.AdamW(model.parameters()))


def _refused(path, match: str) -> str:
    """Load `path` into a fresh model and optimizer: the CheckpointError's text, both left untouched."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=match) as err:
        checkpoint.load(path, model, opt)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()) and not opt.state
    return str(err.value)


def test_a_failed_write_is_a_checkpoint_error_and_the_previous_checkpoint_stays(saved, tmp_path, monkeypatch):
    """A full disk: DCP raises its CheckpointException, a BaseException that `except Exception` misses."""
    path = _copy(saved, tmp_path)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dcp_files, "_write_item", full)
    with pytest.raises(ZBCompileError) as err:
        checkpoint.save(path, _model(), extra={"step": 3})
    assert isinstance(err.value, CheckpointError)
    text = str(err.value)
    assert "failed (rank 0: OSError: [Errno 28] No space left on device)" in text and "is intact" in text, text
    monkeypatch.undo()
    assert _load(path) == {"step": 2}


def test_a_staging_directory_that_cannot_be_cleared_and_a_failed_commit_say_what_is_left(saved, tmp_path,
                                                                                          monkeypatch):
    """Rank 0 clears the last save's staging directory first: where it cannot, every rank fails at once, and the
    checkpoint before stays. A failure once every rank has written (here the commit's rename) cannot promise
    that: the message says the path holds one whole checkpoint, this save's or the one before."""
    path = _copy(saved, tmp_path)

    def stuck(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(files, "clear", stuck)
    with pytest.raises(CheckpointError, match=r"rank 0 could not prepare .*Permission denied.*is intact"):
        checkpoint.save(path, _model(), extra={"step": 3})
    monkeypatch.undo()
    monkeypatch.setattr(files, "commit", stuck)
    with pytest.raises(CheckpointError, match=r"the commit may have run: .* holds one whole checkpoint, this "
                                              r"save's or the one before it"):
        checkpoint.save(path, _model(), extra={"step": 3})
    monkeypatch.undo()
    assert _load(path) == {"step": 2}


def _written_by_dcp(path):
    """The saved model's state written by torch.distributed.checkpoint itself: no manifest, no marker."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    checkpoint.load(path_of_saved := path, model, opt)
    model_sd, optim_sd = get_state_dict(model, opt, options=checkpoint.OPTIONS)
    out = path_of_saved.parent / "by_dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # DCP's "assumes one process" warning
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=out, no_dist=True)
    return out, model


def test_a_checkpoint_dcp_wrote_loads_unverified_and_a_damaged_one_is_refused_unchanged(saved, tmp_path):
    """DCP's own format loads unverified, but a failed read is still our error, with nothing changed."""
    path, want = _written_by_dcp(_copy(saved, tmp_path))
    assert _load(path) == {}
    model = _model()
    checkpoint.load(path, model)
    assert all(torch.equal(v, want.state_dict()[k]) for k, v in model.state_dict().items())
    with open(next(path.glob("*.distcp")), "r+b") as fh:
        fh.truncate(100)
    text = _refused(path, "reading it failed")
    assert "rank 0: EOFError" in text and "it was not verified" in text, text


def test_a_checkpoint_of_ours_that_lost_its_manifest_is_damaged(saved, tmp_path):
    """Deleting one file must not turn every check off: save marks its checkpoints in DCP's own index, so one
    without its manifest (whose data and `extra` step can no longer be verified) is refused, not loaded as if
    DCP had written it (a resumed job would restart at step 0 on trained weights)."""
    path = _copy(saved, tmp_path)
    (path / files.MANIFEST).unlink()
    text = _refused(path, "damaged, nothing was loaded")
    assert f"{files.MANIFEST} is missing, which zbcompile's save writes with every checkpoint" in text, text


def _tree(path) -> dict:
    return {str(p.relative_to(path)): p.read_bytes() if p.is_file() else None for p in sorted(path.rglob("*"))}


@pytest.mark.parametrize("kind", ["file", "notes", "checkpoint+notes", "dot", "symlink"])
def test_a_save_refuses_a_path_it_would_destroy(saved, tmp_path, monkeypatch, kind):
    """The commit replaces the directory at the path whole. A user's file, a directory of their notes, notes put
    into a checkpoint directory, the current directory, a link: refused before anything is written, everything
    left as it was (before, a file was renamed away and the save failed half-way; a directory's other files were
    deleted with the old checkpoint)."""
    monkeypatch.chdir(tmp_path)
    target = {"dot": tmp_path / "."}.get(kind, tmp_path / "out")
    if kind == "file":
        target.write_text("my notes")
    elif kind == "notes":
        target.mkdir()
        (target / "notes.txt").write_text("my notes")
    elif kind == "checkpoint+notes":
        _copy(saved, tmp_path).rename(target)
        (target / "notes.txt").write_text("my notes")
    elif kind == "symlink":
        (tmp_path / "real").mkdir()
        target.symlink_to(tmp_path / "real")
    (tmp_path / "keep.txt").write_text("kept")
    before = _tree(tmp_path)
    problem = {"file": "is a file, not a checkpoint directory", "notes": "is a directory that is not a checkpoint, "
               "holding notes.txt", "checkpoint+notes": "is a checkpoint directory that also holds notes.txt",
               "dot": "names no directory of its own", "symlink": "is a symbolic link"}[kind]
    with pytest.raises(CheckpointError) as err:
        checkpoint.save("." if kind == "dot" else target, _model(), extra={"step": 3})
    assert problem in str(err.value) and "nothing was written" in str(err.value), str(err.value)
    assert _tree(tmp_path) == before


def test_a_save_into_an_empty_directory_and_over_a_checkpoint(saved, tmp_path):
    (tmp_path / "new").mkdir()
    checkpoint.save(tmp_path / "new", _model(), extra={"step": 1})
    checkpoint.save(tmp_path / "new", _model(), extra={"step": 2})
    assert checkpoint.load(tmp_path / "new", _model()) == {"step": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new"]


def test_a_load_blocked_by_a_stray_previous_file_is_a_checkpoint_error(saved, tmp_path):
    """`.<name>.previous` is where a commit parks the old checkpoint; a file of that name (not ours) cannot be put
    right: rank 0's failure is every rank's CheckpointError (it was a bare NotADirectoryError on rank 0 while
    the other ranks waited)."""
    path = _copy(saved, tmp_path)
    files.previous(path).write_text("not a checkpoint")
    text = _refused(path, "blocked, nothing was loaded")
    assert ".ckpt.previous' beside it cannot be put right (NotADirectoryError" in text, text


def test_a_checkpoint_of_another_optimizer_is_refused_by_name(saved, tmp_path):
    """AdamW's state loaded into SGD with momentum: DCP's own error was "Missing key", which load reported as a
    damaged checkpoint."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match="saved with another optimizer") as err:
        checkpoint.load(saved, model, opt)
    assert "missing: optim.state.wte.weight.momentum_buffer (the checkpoint holds exp_avg, exp_avg_sq, step for " \
           "wte.weight)" in str(err.value), str(err.value)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()) and not opt.state


@pytest.mark.parametrize("edit, problem", [
    (lambda m: {"format": 1}, '"metadata" is missing'),
    (lambda m: [1], "a JSON list, not an object"),
    (lambda m: {**m, "format": 3}, "format 3, where this zbcompile reads 1 and 2"),
    (lambda m: {**m, "format": True}, "format True"),
    (lambda m: {**m, "extra": [2]}, '"extra" is a list, not a JSON object'),
    (lambda m: {**m, "files": {f: "many" for f in m["files"]}}, "has no byte count"),
    (lambda m: {**m, "items": {k: v[:3] for k, v in m["items"].items()}}, 'is not [file of "files"'),
    (lambda m: {**m, "items": {k: ["other.distcp", *v[1:]] for k, v in m["items"].items()}},
     'is not [file of "files"'),
], ids=["format-only", "list", "newer-format", "bool-format", "extra-list", "sizes", "short-items",
        "unknown-file"])
def test_a_malformed_manifest_is_refused_by_name(saved, tmp_path, edit, problem):
    path = _copy(saved, tmp_path)
    (path / files.MANIFEST).write_text(json.dumps(edit(_manifest(path))))
    text = _refused(path, "damaged, nothing was loaded")
    assert f"damaged: {files.MANIFEST} is malformed" in text and problem in text, text


def test_the_saved_values_are_checksummed(saved, tmp_path):
    """The step the main job resumes from: edited, it would skip data silently."""
    path = _copy(saved, tmp_path)
    text = (path / files.MANIFEST).read_text()
    assert '"step": 2' in text   # readable JSON
    (path / files.MANIFEST).write_text(text.replace('"step": 2', '"step": 3'))
    assert "differs from its checksum" in _refused(path, "damaged, nothing was loaded")


def test_the_manifest_checksum_is_of_its_values_not_its_layout(saved, tmp_path):
    path = _copy(saved, tmp_path)
    (path / files.MANIFEST).write_text(json.dumps(_manifest(path), indent=4, sort_keys=True))
    assert _load(path) == {"step": 2}


def test_a_format_1_manifest_loads_with_its_values_unverified(saved, tmp_path):
    """Written before the manifest checksummed itself: it loads as it did (its tensors verified), while a
    checksum that is there is checked whatever the format says."""
    path = _copy(saved, tmp_path)
    old = {k: v for k, v in _manifest(path).items() if k != "checksum"} | {"format": 1}
    (path / files.MANIFEST).write_text(json.dumps(old | {"extra": {"step": 5}}))
    assert _load(path) == {"step": 5}
    (path / files.MANIFEST).write_text(json.dumps(_manifest(saved) | {"format": 1, "extra": {"step": 5}}))
    assert "differs from its checksum" in _refused(path, "damaged")


def test_values_that_are_not_json_are_refused_before_writing(tmp_path):
    with pytest.raises(CheckpointError, match="takes a dict of JSON values"):
        checkpoint.save(tmp_path / "ckpt", _model(), extra={"step": torch.tensor(2)})
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("stepped", [0, 1])
def test_parameters_saved_before_their_first_step_load_without_optimizer_state(tmp_path, stepped):
    """A checkpoint saved before the optimizer's first step (stepped=0), or after a step in which one layer got
    no gradient (stepped=1: AdamW keeps no state for it, as for a pooler the loss never reads or an expert never
    routed to): loading it must leave those parameters without state, as they were (torch's get_state_dict makes
    state by stepping once with lr 0, AdamW's step count 1, which changes every later update). The second kind
    was refused as "saved with another optimizer" (the checkpoint holds no state for them), on a pipe under
    torchrun too. Two more steps after the load equal two steps without the save and load."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).double()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)

    def step(m, o, first_layer_only: bool = False):
        o.zero_grad(set_to_none=True)
        out = m[0](x).sum() if first_layer_only else ((m(x) - y) ** 2).mean()
        out.backward()
        o.step()

    for _ in range(stepped):
        step(model, opt, first_layer_only=True)   # the last layer gets no gradient: no state yet
    checkpoint.save(tmp_path / "ckpt", model, opt)
    other = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).double()
    other_opt = torch.optim.AdamW(other.parameters(), lr=0.1)
    checkpoint.load(tmp_path / "ckpt", other, other_opt)
    assert len(other_opt.state) == len(opt.state) == 2 * stepped, (len(other_opt.state), len(opt.state))
    for m, o in ((model, opt), (other, other_opt)):
        step(m, o)
        step(m, o)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))


@pytest.mark.parametrize("before", ["partial state", "gradients"])
def test_a_load_gives_every_parameter_the_saved_optimizer_state(tmp_path, before):
    """A load into an optimizer that has state for some parameters only (it stepped while one layer got no
    gradient), or into a fresh one while the parameters hold gradients: torch's get_state_dict then makes no
    state to read into, and the saved state of those parameters was silently left out (the next step started
    them afresh). Every parameter now gets the saved state, the next step equals the saved run's, and the
    gradients held before the load are still there."""
    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).double()
        return model, torch.optim.AdamW(model.parameters(), lr=0.1)

    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
    model, opt = build()
    for _ in range(2):
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    checkpoint.save(tmp_path / "ckpt", model, opt)
    other, other_opt = build()
    if before == "partial state":   # a step in which the last layer got no gradient: no state for it
        other[0](x).sum().backward()
        other_opt.step()
        assert len(other_opt.state) == 2
    other_opt.zero_grad(set_to_none=True)
    other(x).sum().backward()
    held = [p.grad.clone() for p in other.parameters()]
    checkpoint.load(tmp_path / "ckpt", other, other_opt)
    assert all(torch.equal(p.grad, g) for p, g in zip(other.parameters(), held))
    for (p, q) in zip(model.parameters(), other.parameters()):
        saved, loaded = opt.state[p], other_opt.state[q]
        assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved), loaded
    for m, o in ((model, opt), (other, other_opt)):
        o.zero_grad()
        ((m(x) - y) ** 2).mean().backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))
