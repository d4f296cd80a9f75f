"""Models that apply their own torch.autograd.Function: the Function's backward is what the pipeline runs
(passes/functions.py), checked against eager autograd, which runs the user's backward itself. Each Function here
has a backward that is NOT the derivative of its forward's ops (a straight-through rounding, a gradient reversal,
a scaled identity), so a pipeline that differentiated the forward's ops instead would give other gradients.
Also: torch's own Functions still trace through, a random forward and an in-place one are refused by name, and
the ops survive the test suite's split memo into another process."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from support.launch import run_python
from support.models import Case
from support.threaded import threaded_step_matches_eager
from zbcompile.errors import TraceError
from zbcompile.split import split_model

torch.set_num_threads(1)


class RoundSTE(torch.autograd.Function):
    """Rounds to steps of `step`; the backward passes the gradient where |x| < clip (straight-through)."""

    @staticmethod
    def forward(ctx, x, step, clip=4.0):
        ctx.save_for_backward(x)
        ctx.clip = clip
        return torch.round(x / step) * step

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * (x.abs() < ctx.clip), None, None


class Reverse(torch.autograd.Function):
    """The new style (setup_context): identity forward, returning a view of its input; negated, scaled gradient."""

    @staticmethod
    def forward(x, scale):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.scale = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        return -ctx.scale * grad, None


class Gate(torch.autograd.Function):
    """Two tensor inputs, two outputs; the backward reads ctx.needs_input_grad and applies an inner Function."""

    @staticmethod
    def forward(ctx, x, gate):
        ctx.save_for_backward(x, gate)
        return x * torch.sigmoid(gate), Halve.apply(gate)

    @staticmethod
    def backward(ctx, grad_out, grad_half):
        x, gate = ctx.saved_tensors
        gx = grad_out * 2.0 if ctx.needs_input_grad[0] else None   # deliberately not the derivative
        return gx, grad_half + grad_out * x


class Halve(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 0.5

    @staticmethod
    def backward(ctx, grad):
        return grad * 3.0


class FunctionNet(nn.Module):
    def __init__(self, width: int = 8, layers: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(layers)])
        self.gates = nn.ModuleList([nn.Linear(width, width) for _ in range(layers)])

    def forward(self, x):
        for i, (layer, gate) in enumerate(zip(self.layers, self.gates)):
            h = layer(x)
            if i % 3 == 0:
                x = RoundSTE.apply(h * 3.0, 0.5)
            elif i % 3 == 1:
                x = torch.tanh(Reverse.apply(h, scale=0.5))
            else:
                out, half = Gate.apply(h, gate(x))
                x = out + half
        return x


def function_net(layers: int = 4) -> Case:
    torch.manual_seed(0)
    model = FunctionNet(layers=layers)
    return Case(model, F.mse_loss, (torch.randn(2, 8), torch.randn(2, 8)), layers)


@pytest.mark.parametrize("schedule,pp", [("1f1b", 2), ("zbv", 2), ("zb-h1", 4)])
def test_the_functions_backward_is_what_the_pipeline_runs(schedule, pp):
    threaded_step_matches_eager(function_net(layers=8 if pp == 4 else 4), schedule, pp)


def test_stage_graphs_call_the_function_as_one_op():
    case = function_net()
    staged = split_model(case.model, case.loss_fn, case.example, num_stages=2)
    ops = {str(n.target) for st in staged.stages for n in st.f.gm.graph.nodes if n.op == "call_function"}
    assert any(op.startswith("zbfn.RoundSTE_") for op in ops), ops
    assert any(op.startswith("zbfn.Reverse_") for op in ops), ops
    assert not any("round" in op for op in ops), "the forward's ops were traced into the stage graph"


class Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)   # reentrant checkpointing needs an input that requires grad (eager too)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(3)])

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=True)
        return x


def test_reentrant_checkpointing_trains_equal_to_eager():
    """Reentrant activation checkpointing is a torch Function whose forward runs its block under no_grad: traced
    as the plain call of the block (no op of ours), it gets the gradients eager gets."""
    torch.manual_seed(0)
    case = Case(Checkpointed(), F.mse_loss, (torch.randn(2, 8), torch.randn(2, 8)), 4)
    staged = split_model(case.model, case.loss_fn, case.example, num_stages=2)
    assert not any(str(n.target).startswith("zbfn.") for st in staged.stages for n in st.f.gm.graph.nodes)
    threaded_step_matches_eager(case, "1f1b", 2)


class NestedCheckpoints(nn.Module):
    """Blocks checkpointed non-reentrantly whose own forward checkpoints a submodule again (HF models under
    gradient_checkpointing_enable() with a checkpointed attention inside, for one): export recorded the whole step
    as a no_grad region, and the compile refused it as a loss reaching no trained parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)])
        self.outer = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])

    def block(self, k: int, x):
        return self.outer[k](checkpoint(self.inner[k], x, use_reentrant=False)) + x

    def forward(self, x):
        for k in range(4):
            x = checkpoint(self.block, k, x, use_reentrant=False)
        return x


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_nested_non_reentrant_checkpoints_train_equal_to_eager(schedule):
    torch.manual_seed(0)
    threaded_step_matches_eager(Case(NestedCheckpoints(), F.mse_loss, (torch.randn(2, 8), torch.randn(2, 8)), 4),
                                schedule, 2)


class FrozenEmbeddingCheckpointed(nn.Module):
    """Reentrant checkpoints after a frozen embedding: no input of any block requires grad, so eager's
    CheckpointFunction gives outputs without one, and the blocks' weights get no gradient (torch warns); only the
    head trains."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8).requires_grad_(False)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)])
        self.head = nn.Linear(8, 8)

    def forward(self, ids):
        x = self.emb(ids).mean(1)
        for block in self.blocks:
            x = x + checkpoint(block, x, use_reentrant=True)
        return self.head(x)


def test_a_reentrant_checkpoint_without_an_input_requiring_grad_trains_nothing_inside_as_eager():
    torch.manual_seed(0)
    case = Case(FrozenEmbeddingCheckpointed(), F.mse_loss, (torch.randint(0, 16, (2, 4)), torch.randn(2, 8)), 4)
    with pytest.warns(UserWarning, match="None of the inputs have requires_grad=True"):
        threaded_step_matches_eager(case, "1f1b", 2)   # (a gradient exactly where eager has one: the head's)


class RandomMask(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        mask = torch.rand_like(x) > 0.5
        ctx.save_for_backward(mask)
        return x * mask

    @staticmethod
    def backward(ctx, grad):
        (mask,) = ctx.saved_tensors
        return grad * mask


class DoubleInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.mark_dirty(x)
        return x.mul_(2)

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class RecomputeBlock(torch.autograd.Function):
    """A hand-written checkpoint: runs a module (a constant) under no_grad; its backward re-runs it and calls
    autograd.backward, which accumulates into the module's parameters behind autograd's back."""

    @staticmethod
    def forward(ctx, block, x):
        ctx.block = block
        ctx.save_for_backward(x)
        return block(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_()
        with torch.enable_grad():
            torch.autograd.backward(ctx.block(x), grad)
        return None, x.grad


class Applies(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        if self.fn is RecomputeBlock:
            return self.fn.apply(self.b, self.a(x))
        return self.b(self.fn.apply(self.a(x)))


@pytest.mark.parametrize("fn,text", [
    (RandomMask, "`RandomMask` draws random numbers in its forward (aten.rand_like"),
    (DoubleInPlace, "`DoubleInPlace` marks an input dirty"),
    (RecomputeBlock, "`RecomputeBlock` reads a tensor that requires grad without taking it as an argument"),
])
def test_functions_the_pipeline_cannot_run_are_refused_by_name(fn, text):
    with pytest.raises(TraceError, match=text.replace("(", r"\(")):
        split_model(Applies(fn), F.mse_loss, (torch.randn(2, 8), torch.randn(2, 8)), num_stages=2)


class Dropped(torch.autograd.Function):
    """Dropout in a Function's forward, as HF Reformer's reversible layers call it."""

    @staticmethod
    def forward(ctx, x, p, training):
        return F.dropout(x, p=p, training=training) * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2, None, None


class DroppedNet(nn.Module):
    def __init__(self, p: float, training: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])
        self.p, self.dropping = p, training

    def forward(self, x):
        for layer in self.layers:
            x = Dropped.apply(torch.tanh(layer(x)), self.p, self.dropping)
        return x


@pytest.mark.parametrize("p,training", [(0.0, True), (0.5, False)])
def test_a_dropout_that_draws_nothing_in_a_function_trains_as_eager(p, training):
    """F.dropout with p=0 or training=False in a Function's forward draws no random number (HF Reformer with its
    dropout off): it was refused as a random op. It trains as eager; a dropout that draws is still refused."""
    torch.manual_seed(0)
    case = Case(DroppedNet(p, training).double(), F.mse_loss,
                (torch.randn(2, 8, dtype=torch.float64), torch.randn(2, 8, dtype=torch.float64)), 4)
    threaded_step_matches_eager(case, "1f1b", 2)
    with pytest.raises(TraceError, match=r"`Dropped` draws random numbers in its forward \(aten\.dropout"):
        split_model(DroppedNet(0.5, True), F.mse_loss, (torch.randn(2, 8), torch.randn(2, 8)), num_stages=2)


def test_a_split_with_function_ops_loads_in_a_fresh_process(tmp_path):
    """The split memo pickles a split and loads it in another process, where the op does not exist yet: the
    pickle carries what makes it (the Function's class by reference), and the loaded graph runs."""
    from support import split_memo

    case = function_net()
    staged = split_model(case.model, case.loss_fn, case.example, num_stages=2)
    path = tmp_path / "split.pkl"
    path.write_bytes(split_memo.dumps(staged))
    want = staged.stages[0].f.gm(*_inputs(staged, case))[0]
    torch.save(want, tmp_path / "want.pt")
    script = (f"import sys, torch; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
              "from support import split_memo\n"
              "import test_autograd_functions as t\n"
              f"staged = split_memo.loads(open({str(path)!r}, 'rb').read())\n"
              "case = t.function_net()\n"
              "got = staged.stages[0].f.gm(*t._inputs(staged, case))[0]\n"
              f"assert torch.equal(got, torch.load({str(tmp_path / 'want.pt')!r})), 'different output'\n"
              "print('ok')\n")
    (tmp_path / "load.py").write_text(script)
    out = run_python([str(tmp_path / "load.py")], timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr


def _inputs(staged, case) -> list[torch.Tensor]:
    """Stage 0's forward arguments from the model's parameters and the example's input."""
    params = dict(case.model.named_parameters())
    return [params[v.removeprefix("param:")] if v.startswith("param:") else case.example[0]
            for v in staged.stages[0].f.inputs]


def test_pickle_refuses_a_function_op_with_objects_as_constants():
    from support import split_memo

    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, holder):
            return x * holder.k

        @staticmethod
        def backward(ctx, grad):
            return grad, None

    holder = type("Holder", (), {"k": 2.0})()
    model = nn.Sequential(nn.Linear(8, 8), _Apply(Scale, holder), nn.Linear(8, 8))
    staged = split_model(model, F.mse_loss, (torch.randn(2, 8), torch.randn(2, 8)), num_stages=2)
    with pytest.raises(pickle.PicklingError, match="only this process"):
        split_memo.dumps(staged)


class _Apply(nn.Module):
    def __init__(self, fn, *consts) -> None:
        super().__init__()
        self.fn, self.consts = fn, consts

    def forward(self, x):
        return self.fn.apply(x, *self.consts)

