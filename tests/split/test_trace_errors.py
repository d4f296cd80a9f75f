"""Bad input raises our own exception types, saying where, what and how to fix; nothing is half-built."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from support import models
from zbcompile.errors import PartitionError, TraceError, ZBCompileError
from zbcompile.split import split_model

torch.set_num_threads(1)


class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data-dependent: cannot be one static graph
            return self.lin(x)
        return -x


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(4, 4), Gate(), nn.Linear(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _mlp_example():
    return torch.randn(2, 4), torch.randn(2, 4)


def test_data_dependent_control_flow_names_the_module():
    with pytest.raises(TraceError) as info:
        split_model(Branchy(), F.mse_loss, _mlp_example())
    text = str(info.value)
    assert "data-dependent control flow" in text
    assert "`layers.1`" in text and "Gate" in text
    assert "torch.where" in text and "plain Python value" not in text   # (an example argument must be a tensor)


class _Conditional(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers[0](x)
        x = torch.cond(x.sum() > 0, lambda t: t * 2, lambda t: t * 0.5, (x,))
        return self.layers[1](x)


def test_torch_cond_is_refused_saying_so():
    """torch.cond (which the data-dependent advice once suggested) reached the cost model, which raised a bare
    ZBCompileError about a subgraph's missing meta['val']."""
    with pytest.raises(TraceError, match=r"runs torch.cond, a branch .* select with torch.where"):
        split_model(_Conditional(), F.mse_loss, _mlp_example())



class _TwoLinears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)


class _ScalarRead(_TwoLinears):
    def forward(self, x):
        h = self.a(x)
        return self.b(h / h.abs().max().item())


class _DataSized(_TwoLinears):
    def forward(self, x):
        h = self.a(x)
        return self.b(h) + torch.nonzero(h > 0).shape[0]


class _ScaledBy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, scale):
        return self.b(self.a(x)) * scale


@pytest.mark.parametrize("model,loss_fn,example,match", [
    (_ScalarRead, F.mse_loss, _mlp_example, r"h / h.abs\(\).max\(\).item.*reads a Python number out of a tensor"),
    (_DataSized, F.mse_loss, _mlp_example, r"torch.nonzero\(h > 0\).*size depends on the data"),
    (lambda: nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), lambda o, t: F.mse_loss(o.detach(), t),
     _mlp_example, r"the loss does not depend on any trained parameter"),
    (lambda: nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).requires_grad_(False), F.mse_loss, _mlp_example,
     r"the loss does not depend on any trained parameter"),
    (lambda: nn.Linear(4, 4), F.mse_loss, lambda: (torch.randn(0, 4), torch.randn(0, 4)), r"data:0 has 0 rows"),
    (lambda: _ScaledBy(), F.mse_loss, lambda: ((torch.randn(2, 4), torch.tensor(2.0)), torch.randn(2, 4)),
     r"data:1 is a 0-dimensional tensor .* split into microbatches along its first dimension"),
    (lambda: nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), F.mse_loss,
     lambda: (torch.ones(2, 4, dtype=torch.long), torch.randn(2, 4)),
     r"module '0' multiplies tensors of different dtypes \(float32, int64\) in linear"),
    (lambda: nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), F.cross_entropy,
     lambda: (torch.randn(2, 4), torch.tensor([1, 3], dtype=torch.int32)),
     r"class targets of dtype int32 in cross_entropy_loss, which eager refuses"),
], ids=["item", "nonzero", "detached-loss", "all-frozen", "empty-example", "0-dim-example", "int-into-linear",
        "int32-targets"])
def test_a_step_no_pipeline_can_run_is_refused_by_the_trace(model, loss_fn, example, match):
    """Steps export accepts but no pipeline can run: each failed later, deep in the split, with torch's own
    exception (DataDependentOutputException, a sympy TypeError) or one about graph internals; now a TraceError
    naming the line of code and what to write instead."""
    with pytest.raises(TraceError, match=match):
        split_model(model(), loss_fn, example(), num_stages=2)


def test_an_embedding_with_max_norm_is_refused_with_what_to_do_instead():
    """nn.Embedding(max_norm=...) renormalizes the rows it looks up in place, inside forward: refused, saying to
    renormalize after each step instead (the generic advice, a buffer, does not fit it)."""
    model = nn.Sequential(nn.Embedding(10, 4, max_norm=1.0), nn.Linear(4, 4))
    with pytest.raises(TraceError, match=r"embedding_renorm.*drop max_norm and renormalize the weight after each"):
        split_model(model, lambda o, t: F.mse_loss(o, t), (torch.randint(0, 10, (2, 3)), torch.randn(2, 3, 4)),
                    num_stages=2)


def test_non_scalar_loss():
    def per_sample(out, target):
        return ((out - target) ** 2).mean(dim=1)

    with pytest.raises(TraceError, match=r"scalar.*shape \(2,\)"):
        split_model(nn.Linear(4, 4), per_sample, _mlp_example())


def test_loss_returning_a_python_number():
    """loss_fn calling .item(): the message says a number came back, not a shape."""
    x, y = _mlp_example()
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    with pytest.raises(TraceError, match=r"Python number.*\.item\(\)"):
        split_model(model, lambda o, t: F.mse_loss(o, t).item(), ((x,), (y,)), num_stages=2)


class _Scaled(nn.Module):
    """A loss with a learned temperature (or a class-weight buffer: a constant, which is fine)."""

    def __init__(self, learned: bool) -> None:
        super().__init__()
        self.log_t = nn.Parameter(torch.tensor(0.3), requires_grad=learned)
        self.register_buffer("weight", torch.ones(4))

    def forward(self, out, target):
        return F.mse_loss(out * self.log_t.exp() * self.weight, target)


TEMPERATURE = nn.Parameter(torch.tensor(0.3))


def _loss_with_a_global(out, target):
    return F.mse_loss(out * TEMPERATURE, target)


def _holders():
    t = nn.Parameter(torch.tensor(0.3))
    return {"module": (_Scaled(True), "_Scaled.log_t"),
            "closure": (lambda out, target: F.mse_loss(out * t, target), "t"),
            "partial": (functools.partial(lambda out, target, s: F.mse_loss(out * s, target), s=t), "argument 0"),
            "global": (_loss_with_a_global, "TEMPERATURE")}


@pytest.mark.parametrize("holder", ["module", "closure", "partial", "global"])
def test_a_loss_holding_trainable_parameters_of_its_own_is_refused(holder):
    """Export lifts them as constants: no gradient, no update, a loss that drifts from eager's, silently."""
    loss_fn, name = _holders()[holder]
    with pytest.raises(TraceError, match=rf"loss_fn holds trainable parameters that are not the model's \({name}\)"):
        split_model(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), loss_fn, _mlp_example(), num_stages=2)


class _WithLoss(nn.Sequential):
    def loss(self, out, target):   # the model's own parameter in the loss: trained like any other
        return F.mse_loss(out * self[1].bias.sum(), target)


def test_a_loss_reading_the_models_own_or_frozen_parameters_traces():
    model = _WithLoss(nn.Linear(4, 4), nn.Linear(4, 4))
    split_model(model, model.loss, _mlp_example(), num_stages=2)
    split_model(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), _Scaled(False), _mlp_example(), num_stages=2)


def test_loss_returning_none_says_a_return_may_be_missing():
    """A loss_fn that forgot its `return` was told it returned "a NoneType (a Python number ...)"."""
    def forgot(out, target):
        F.mse_loss(out, target)

    with pytest.raises(TraceError, match=r"loss_fn returned None \(a `return` missing"):
        split_model(nn.Linear(4, 4), forgot, _mlp_example())


def test_loss_returning_a_tuple():
    def two(out, target):
        return F.mse_loss(out, target), out.sum()

    with pytest.raises(TraceError, match="one scalar"):
        split_model(nn.Linear(4, 4), two, _mlp_example())


def test_unknown_split_point_lists_close_names():
    case = models.gpt(layers=2)
    with pytest.raises(PartitionError) as info:
        split_model(case.model, case.loss_fn, case.example, split_points=["block.1"])
    assert "`block.1`" in str(info.value) and "blocks.1" in str(info.value)


def test_more_stages_than_ops():
    """Fewer modules than stages cut between ops (tests/split/test_cut_anywhere.py); fewer ops than stages is
    refused, naming the places a cut could go."""
    case = models.mlp(layers=2)  # Linear, Tanh, Linear, Tanh, then the loss
    with pytest.raises(PartitionError, match=r"only \d+ ops a cut can go before \(0, 1, 2, 3"):
        split_model(case.model, case.loss_fn, case.example, num_stages=20)


def test_split_points_out_of_order():
    case = models.mlp(layers=3)
    with pytest.raises(PartitionError, match="execution order"):
        split_model(case.model, case.loss_fn, case.example, split_points=["4", "2"])


def test_split_point_that_never_runs():
    case = models.skipnet()
    case.model.add_module("unused", nn.Linear(8, 8))
    with pytest.raises(PartitionError, match="never called"):
        split_model(case.model, case.loss_fn, case.example, split_points=["unused"])


def test_num_stages_and_split_points_disagree():
    case = models.mlp(layers=2)
    with pytest.raises(PartitionError, match="disagrees"):
        split_model(case.model, case.loss_fn, case.example, num_stages=3, split_points=["2"])


def test_bad_example_shape():
    with pytest.raises(TraceError, match=r"pair \(inputs, targets\)"):
        split_model(nn.Linear(4, 4), F.mse_loss, torch.randn(2, 4))


@pytest.mark.parametrize("part", [None, 3.0, "y"], ids=["none", "number", "string"])
def test_an_example_part_that_is_not_tensors_is_refused_naming_it(part):
    """example=(x, None) for a loss without targets (or a number) raised a raw TypeError from iterating it."""
    with pytest.raises(TraceError, match=r"example's targets are '(NoneType|float|str)'.*example=\(inputs, \(\)\)"):
        split_model(nn.Linear(4, 4), lambda out, *t: out.sum(), (torch.randn(2, 4), part))


def test_targets_given_as_a_dict_are_refused_instead_of_bound_by_position():
    """example=(x, {"w": w, "y": y}) with loss_fn(out, y, w): the dict's values were passed by position, in the
    dict's order, so the loss trained with y and w swapped, without a word."""
    x = torch.randn(2, 4)

    def loss_fn(out, y, w):
        return ((out - y) ** 2 * w).mean()

    with pytest.raises(TraceError, match=r"targets are a dict \(keys \['w', 'y'\]\).*by position"):
        split_model(nn.Linear(4, 4), loss_fn, (x, {"w": torch.ones(2, 4), "y": torch.randn(2, 4)}))


def test_all_errors_are_ours():
    assert issubclass(TraceError, ZBCompileError) and issubclass(PartitionError, ZBCompileError)


def test_an_example_of_the_wrong_shape_is_one_error_without_torchs_logged_tracebacks(capfd):
    """The TraceError names the module and the clash; fake_tensor's own ERROR log of the failed op (about 240
    lines of tracebacks on stderr before it) is held back."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    with pytest.raises(TraceError, match=r"module `0` \(Linear.*must have same reduction dim"):
        split_model(model, F.mse_loss, ((torch.randn(2, 3),), (torch.randn(2, 4),)), num_stages=2)
    err = capfd.readouterr().err
    assert "fake_tensor" not in err and "Traceback" not in err, err[:2000]


class _Grows(nn.Module):
    """State that takes another shape in the step: a buffer resized in place, or reassigned longer."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how, self.lin = how, nn.Linear(4, 4)
        self.register_buffer("seen", torch.zeros(0))

    def forward(self, x):
        y = self.lin(x)
        if self.how == "resize_":
            self.seen.resize_(4).copy_(y.detach().mean(0))
        else:
            self.seen = torch.cat([self.seen, y.detach().mean(0)])
        return y


def _qat(calibrated: bool) -> nn.Module:
    import torch.ao.quantization as q

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)).train()
    model.qconfig = q.get_default_qat_qconfig("fbgemm")
    with pytest.warns(Warning):   # torch.ao's deprecation and observer warnings
        q.prepare_qat(model, inplace=True)
    if calibrated:
        model(torch.randn(8, 4))
    return model


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
@pytest.mark.parametrize("make, match", [
    (lambda: _Grows("resize_"), r"in the model: `aten.resize_.default` resizes a tensor of shape \(0,\) to \(4,\)"),
    (lambda: _Grows("cat"), r"reassigns buffer `seen` of _Grows with a tensor of shape \(4,\) where it holds "
                            r"\(0,\)"),
    (lambda: _qat(False), r"module `0.weight_fake_quant`: .* holds 0 running minima for 4 channels .* calibration"),
])
def test_state_that_changes_shape_in_the_step_is_refused(make, match):
    """The graphs are traced for one shape: the step crashed in copy_buffer (an uncalibrated QAT observer,
    whose fused kernel resizes its statistics unseen by the trace), or would have traced a stale shape."""
    with pytest.raises(TraceError, match=match):
        split_model(make(), F.mse_loss, _mlp_example(), num_stages=2)


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
def test_a_calibrated_qat_model_splits():
    assert len(split_model(_qat(True), F.mse_loss, _mlp_example(), num_stages=2).stages) == 2


class _HookInForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        h.register_hook(lambda g: g * 2)   # gradient scaling, as a gradient-reversal layer writes it
        return self.b(h)


def test_a_gradient_hook_registered_in_forward_is_refused():
    """Export does not record a tensor hook: the gradients before it silently differed from eager's (halved)."""
    with pytest.raises(TraceError, match=r"gradient hook on a tensor inside forward .*torch.autograd.Function"):
        split_model(_HookInForward(), F.mse_loss, _mlp_example(), num_stages=2)
    x = torch.randn(2, 4, requires_grad=True)
    x.register_hook(lambda g: g)   # outside a trace, torch's own method is back
    _HookInForward()(x).sum().backward()


class _GradInForward(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        if self.how == "autograd.grad":   # an input-gradient feature
            (g,) = torch.autograd.grad((self.b(h) ** 2).sum(), h, create_graph=True)
            return h + g
        return self.b(h) * h.data


@pytest.mark.parametrize("how, match", [
    ("autograd.grad", r"calls torch.autograd.grad inside forward"),
    (".data", r"the usual cause `tensor.data` in forward \(write `.detach\(\)`"),
])
def test_a_gradient_or_data_taken_inside_forward_is_refused_naming_it(how, match):
    """Both gave only torch.export's internal text ("a fake tensor in the exported program constant's list ...
    Please file an issue"), naming neither the construct nor the fix."""
    with pytest.raises(TraceError, match=match):
        split_model(_GradInForward(how), F.mse_loss, _mlp_example(), num_stages=2)


def test_a_model_built_under_inference_mode_is_refused_naming_its_tensors():
    """Parameters made under torch.inference_mode() cannot be trained (eager's backward refuses them); the trace
    failed with export's opaque "AssertionError: True != False". It names the tensor and the way out."""
    with torch.inference_mode():
        model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    x, y = torch.randn(2, 4), torch.randn(2, 2)
    with pytest.raises(TraceError, match=r"parameter 0\.weight \(and 3 more\) is an inference tensor: the model was "
                                         r"built under torch\.inference_mode\(\)"):
        split_model(model, F.mse_loss, ((x,), (y,)), num_stages=2)
