"""Checkpoints that move between pipeline layouts (zbcompile/checkpoint.py), against an uninterrupted eager run.

Two launches (gloo on 127.0.0.1, tests/distributed/workers/ckpt_worker.py): pp=2 trains the tied-embedding GPT
and a BatchNorm ConvNet two AdamW steps with zbv and saves them, then loads them at pp=2 with 1f1b and other
cuts; pp=4 loads them with 1f1b. This process loads them into the plain models. Every load resumes with steps
3 and 4, whose losses must equal the uninterrupted eager run's (step 4 also proves the AdamW state came back).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from support import ckpt as common
from support.launch import launch
from zbcompile import checkpoint
from zbcompile.errors import CheckpointError

pytestmark = [pytest.mark.dist, pytest.mark.slow]

WORKER = os.path.join(os.path.dirname(__file__), "workers", "ckpt_worker.py")
TOL = 1e-6


def _launch(pp: int, out, ckpt, *flags: str) -> list[dict]:
    results = launch(WORKER, pp, out, "--ckpt", str(ckpt), *flags, timeout=300)
    for r, res in enumerate(results):
        assert "error" not in res, f"rank {r}:\n{res['error']}"
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(checkpoint directory, pp=2 results, pp=4 results)."""
    ckpt = tmp_path_factory.mktemp("ckpt")
    saved = _launch(2, tmp_path_factory.mktemp("pp2"), ckpt, "--save")
    loaded = _launch(4, tmp_path_factory.mktemp("pp4"), ckpt)
    return ckpt, saved, loaded


def _uninterrupted(name: str):
    """Eager single-process training over all steps: its losses and the model at the end."""
    model, loss_fn, batches, m = common.case(name)
    return common.eager_train(model, common.adamw(model.parameters()), loss_fn, batches, m), model


def _close(got: list[float], want: list[float]) -> bool:
    return len(got) == len(want) and all(abs(g - w) <= TOL * abs(w) for g, w in zip(got, want))


@pytest.mark.parametrize("name", ["gpt", "cnn"])
def test_resumes_at_other_layouts_like_an_uninterrupted_run(runs, name):
    _, saved, loaded = runs
    want, model = _uninterrupted(name)
    assert all(_close(res[f"{name}/uninterrupted"]["losses"], want[2:]) for res in saved)
    buffers = dict(model.named_buffers())
    for layout, results in ((f"{name}/1f1b", saved), (f"{name}/pp4", loaded)):
        for r, res in enumerate(results):
            got = res[layout]
            assert _close(got["losses"], want[2:]), (layout, r, got["losses"], want[2:])
            for k, b in got["buffers"].items():   # BatchNorm statistics, as eager training left them
                ref = buffers[k]
                assert torch.allclose(torch.tensor(b, dtype=ref.dtype), ref, rtol=TOL, atol=TOL), (layout, r, k)
    held = {k for res in loaded for k in res[f"{name}/pp4"]["buffers"]}
    assert held == set(buffers)


@pytest.mark.parametrize("name", ["gpt", "cnn"])
def test_plain_model_loads_a_pipeline_checkpoint_and_resumes(runs, name):
    ckpt = runs[0]
    want, _ = _uninterrupted(name)
    model, loss_fn, batches, m = common.case(name)
    common.perturb(model)
    opt = common.adamw(model.parameters())
    checkpoint.load(ckpt / name, model, opt)
    assert _close(common.eager_train(model, opt, loss_fn, batches[2:], m), want[2:])


@pytest.mark.parametrize("name", ["gpt", "cnn"])
def test_checkpoint_holds_every_plain_key_once_under_user_names(runs, name):
    ckpt = runs[0] / name
    meta = dcp.FileSystemReader(str(ckpt)).read_metadata()
    model, _, _, _ = common.case(name)
    keys = set(meta.state_dict_metadata)
    assert {f"model.{k}" for k in model.state_dict()} == {k for k in keys if k.startswith("model.")}
    for fqn, p in model.named_parameters():   # AdamW's state, keyed by the same names
        assert {f"optim.state.{fqn}.{s}" for s in ("step", "exp_avg", "exp_avg_sq")} <= keys
        assert f"optim.param_groups.{fqn}.lr" in keys
    # each key is written by exactly one rank: the data files hold nothing but the bytes the metadata points to
    written = sum(os.path.getsize(ckpt / f) for f in os.listdir(ckpt) if f.endswith(".distcp"))
    assert written == sum(info.length for info in meta.storage_data.values())
    if name == "gpt":   # the tied embedding: one tensor under both of its names, like the plain model's
        assert "model.wte.weight" in keys and "model.lm_head.weight" in keys


def test_a_checkpoint_of_another_model_is_refused_on_every_rank_before_anything_changes(runs):
    _, saved, _ = runs
    messages = {res["refused"]["load"] for res in saved}
    assert len(messages) == 1, messages   # every rank raised, with the same findings
    msg = messages.pop()
    assert "does not fit this model, nothing was loaded" in msg, msg
    assert "shape: model.wte.weight is [64, 32] there, [64, 48] in the model" in msg, msg
    assert "missing: model.blocks.4." in msg or "more" in msg, msg
    for res in saved:
        assert "shape: " in res["refused"]["state_dict"] and "[3]" in res["refused"]["state_dict"]
        assert res["refused"]["unchanged"] and res["refused"]["optimizer_untouched"]


def test_plain_model_refuses_missing_extra_and_reshaped_keys(runs, tmp_path):
    ckpt = runs[0] / "gpt"
    from zbcompile.examples.gpt import GPT, GPTConfig

    for cfg, expect in ((GPTConfig(vocab=64, seq=16, d=32, heads=2, layers=3), "unexpected: model.blocks.3."),
                        (GPTConfig(vocab=64, seq=16, d=32, heads=2, layers=5), "missing: model.blocks.4."),
                        (GPTConfig(vocab=64, seq=32, d=32, heads=2, layers=4), "shape: model.wpe.weight")):
        model = GPT(cfg)
        opt = common.adamw(model.parameters())
        before = copy.deepcopy(model.state_dict())
        with pytest.raises(CheckpointError, match=expect):
            checkpoint.load(ckpt, model, opt)
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()) and not opt.state
    model, _, _, _ = common.case("gpt")
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        checkpoint.load(tmp_path / "nothing here", model)
    checkpoint.save(tmp_path / "model only", model)
    with pytest.raises(CheckpointError, match="no optimizer state"):
        checkpoint.load(tmp_path / "model only", model, common.adamw(model.parameters()))


def test_another_modules_optimizer_is_refused_before_writing_or_reading(tmp_path):
    """An optimizer of another model (a README that renamed `opt`, two pipes' optimizers swapped): the save says
    so and writes nothing; the load says so (it raised torch's bare KeyError: 0) and changes nothing."""
    model, _, _, _ = common.case("gpt")
    other, _, _, _ = common.case("gpt")
    wrong = common.adamw(other.parameters())
    with pytest.raises(CheckpointError, match=r"not parameters of the module \(rank 0: \d+ of them\).*written"):
        checkpoint.save(tmp_path / "ckpt", model, wrong)
    assert not checkpoint.exists(tmp_path / "ckpt") and not list(tmp_path.iterdir())
    checkpoint.save(tmp_path / "ckpt", model, common.adamw(model.parameters()))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"not parameters of the module \(rank 0: \d+ of them\).*loaded"):
        checkpoint.load(tmp_path / "ckpt", model, wrong)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()) and not wrong.state


@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_a_save_before_the_first_step_changes_nothing_and_resumes_fresh(tmp_path, opt):
    """torch's get_state_dict makes a fresh optimizer's state by stepping it with lr 0 (AdamW's step count 1,
    SGD's dampened momentum buffer of zeros): a save at step 0 changed all the training after it, and a load of
    that checkpoint resumed from that state. Both now train as if no save had happened."""
    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 6)).double()
        make_opt = (lambda ps: torch.optim.AdamW(ps, lr=0.01)) if opt == "adamw" else (
            lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.5))
        return model, make_opt(model.parameters())

    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 6, dtype=torch.float64, generator=g), torch.randn(4, 6, dtype=torch.float64,
                                                                                 generator=g)) for _ in range(3)]

    def train(model, optimizer):
        for x, y in batches:
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
        return [p.detach().clone() for p in model.parameters()]

    want = train(*make())
    model, optimizer = make()
    checkpoint.save(tmp_path / "ckpt", model, optimizer)
    assert not optimizer.state
    assert all(torch.equal(a, b) for a, b in zip(train(model, optimizer), want))
    model, optimizer = make()
    train(model, optimizer)   # a run that has stepped, loading the checkpoint from before its first step
    checkpoint.load(tmp_path / "ckpt", model, optimizer)
    assert not optimizer.state
    assert all(torch.equal(a, b) for a, b in zip(train(model, optimizer), want))
