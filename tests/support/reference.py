"""The reference runner of the split tests: the smallest possible pipeline runtime (F for stages 0..S-1, then B
and W for stages S-1..0, wiring values by name only) against a plain `loss.backward()` on a copy of the model:
losses, parameter grads (tied aliases summed over stages) and updated buffers within RTOL."""

from __future__ import annotations

import copy

import torch

from zbcompile.ir.stages import StagedModel
from zbcompile.passes.trace import flatten_example

RTOL = 1e-6


def run_staged(staged: StagedModel, model: torch.nn.Module, flat, *, fused: bool = False):
    """One microbatch through the stage graphs; returns (loss, {param fqn: grad}, {buffer fqn: new value})."""
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    state = {f"param:{k}": v.detach() for k, v in params.items()}
    state |= {f"buffer:{k}": v for k, v in buffers.items()}
    state |= {f"data:{i}": x for i, x in enumerate(flat)}
    acts, saved, new_buffers = {}, {}, {}
    for st in staged.stages:
        out = st.f({**state, **acts})
        acts = {k: v for k, v in out.items() if k.startswith("act:")}
        saved[st.index] = {k: v for k, v in out.items() if k.startswith("saved:")}
        new_buffers |= {k[len("buffer:") :]: v for k, v in out.items() if k.startswith("buffer:")}
        loss = out.get("loss", None)
    incoming = {"grad:loss": torch.ones_like(loss)}
    grads: dict[str, torch.Tensor] = {}
    for st in reversed(staged.stages):
        env = {**saved[st.index], **incoming}
        if fused:
            out = st.bw(env)
        else:
            b_out = st.b(env)
            w_out = st.w({**env, **{k: v for k, v in b_out.items() if k.startswith("wsaved:")}})
            out = {**b_out, **w_out}
        for k, v in out.items():
            if k.startswith("grad:param:"):
                name = k[len("grad:param:") :]
                grads[name] = grads[name] + v if name in grads else v
        incoming = {k: v for k, v in out.items() if k.startswith("grad:act:")}
        expected = {f"grad:{s.name}" for s in st.recv if s.requires_grad}
        assert set(incoming) == expected, (st.index, sorted(incoming), sorted(expected))
    return loss, grads, new_buffers


def run_eager(model: torch.nn.Module, loss_fn, flat, num_inputs: int):
    model = copy.deepcopy(model)
    loss = loss_fn(model(*flat[:num_inputs]), *flat[num_inputs:])
    loss.backward()
    grads = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, dict(model.named_buffers())


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    scale = expected.abs().max().clamp_min(1e-30)
    err = (actual - expected).abs().max()
    assert err <= RTOL * scale, f"{what}: max abs err {err:.3g} vs max {scale:.3g}"


def check_against_eager(staged: StagedModel, case, *, seed: int = 0, fused: bool = False) -> None:
    flat, num_inputs, _ = flatten_example(case.example)
    torch.manual_seed(seed)
    e_loss, e_grads, e_buffers = run_eager(case.model, case.loss_fn, flat, num_inputs)
    torch.manual_seed(seed)
    s_loss, s_grads, s_buffers = run_staged(staged, case.model, flat, fused=fused)
    assert_close(s_loss, e_loss, "loss")
    assert set(s_grads) == set(e_grads)
    for name, g in e_grads.items():
        assert_close(s_grads[name], g, f"grad of {name}")
    for name, value in s_buffers.items():
        assert_close(value.float(), e_buffers[name].float(), f"buffer {name}")
    # every buffer the eager step changed comes back from exactly one F
    changed = {k for k, v in e_buffers.items() if not torch.equal(v, dict(case.model.named_buffers())[k])}
    assert changed <= set(s_buffers)
