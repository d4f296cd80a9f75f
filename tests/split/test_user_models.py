"""Models users bring that the split used to reject: each class reproduced by a small model, split, and
checked against eager autograd (loss, every gradient, updated buffers) stage graph by stage graph
(tests/support/reference.py, check_against_eager), most also as a threaded pipeline step
(tests/support/threaded.py). The classes: blocks in an nn.ModuleDict; split points users already wrote
(pipe_split() markers, torch's split_spec); stages returning their input or a view of it; non-contiguous
boundary tensors and SDPA's layout under autograd (an encoder-decoder, HF T5); slice assignment into
activations; parameters and buffers no stage reads; keyword-only inputs with a mask; and the in-place writes
that still cannot work, which get one clear error."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from support import models
from support.reference import check_against_eager
from support.threaded import (assert_graded_where_eager_is, distinct_microbatches, eager_microbatches, max_grad_error,
                              param_holders, run_threaded, threaded_step_matches_eager)
from zbcompile.compiler import split_for
from zbcompile.errors import PartitionError
from zbcompile.passes.schedules import generate
from zbcompile.split import split_model

torch.set_num_threads(1)


# (1) blocks in an nn.ModuleDict: the repeated units come from the traced graph, whatever holds them

def test_module_dict_blocks_are_the_cuttable_units():
    case = models.dict_lm(layers=6)
    staged = split_model(case.model, case.loss_fn, case.example, num_stages=4)
    points = staged.meta["split_points"]
    assert len(points) == 3 and all(p.startswith("layers.") for p in points), points
    check_against_eager(staged, case)


def test_module_dict_model_trains_equal_to_eager_pipelined():
    threaded_step_matches_eager(models.dict_lm(layers=4), "1f1b", 4)


# (2) split points users already wrote: pipe_split() markers, torch's split_spec of SplitPoints

def test_pipe_split_markers_are_the_automatic_split_points():
    case = models.marked_mlp(marks=(0, 2))
    staged = split_model(case.model, case.loss_fn, case.example)
    assert staged.meta["split_points"] == ("pipe_split:0", "pipe_split:1")
    assert [st.modules for st in staged.stages] == [("inp",), ("mid", "deep"), ("out",)]
    check_against_eager(staged, case)


def test_pipe_split_model_trains_equal_to_eager_pipelined():
    threaded_step_matches_eager(models.marked_mlp(marks=(1,)), "1f1b", 2)


def test_split_spec_of_split_points_cuts_like_the_markers():
    from torch.distributed.pipelining import SplitPoint

    case = models.marked_mlp(marks=())
    spec = {"out": SplitPoint.BEGINNING, "inp": SplitPoint.END}   # any order, as torch's pipeline() takes it
    staged = split_model(case.model, case.loss_fn, case.example, split_points=spec)
    assert staged.meta["split_points"] == ("after:inp", "out")
    assert [st.modules for st in staged.stages] == [("inp",), ("mid", "deep"), ("out",)]
    check_against_eager(staged, case)


def test_explicit_split_points_win_over_markers():
    case = models.marked_mlp(marks=(0, 2))
    staged = split_model(case.model, case.loss_fn, case.example, split_points=["out"])
    assert [st.modules for st in staged.stages] == [("inp", "mid", "deep"), ("out",)]
    check_against_eager(staged, case)


@pytest.mark.parametrize("points,text", [
    (["pipe_split:2"], r"split point `pipe_split:2`: marker 2, but the traced step has 2 pipe_split\(\) markers, "
                       r"pipe_split:0 to pipe_split:1"),
    (["pipe_split:one"], r"split point `pipe_split:one`: 'one' is no marker number, but the traced step has 2 "
                         r"pipe_split\(\) markers"),
    (["out", "after:inp"], r"split point `after:inp` runs before `out`: .* \['after:inp', 'out'\]"),
    (["after:nothing"], r"unknown split point `after:nothing`: the model has no module `nothing`"),
])
def test_wrong_split_points_say_which_and_how(points, text):
    case = models.marked_mlp(marks=(0, 2))
    with pytest.raises(PartitionError, match=text):
        split_model(case.model, case.loss_fn, case.example, split_points=points)


def test_markers_disagreeing_with_the_stage_count_say_so():
    case = models.marked_mlp(marks=(0, 2))
    with pytest.raises(PartitionError, match=r"calls pipe_split\(\) 2 times \(3 stages\) but 2 stages"):
        split_model(case.model, case.loss_fn, case.example, num_stages=2)


# (4) boundary tensors whose layout is not contiguous; layouts that change under autograd (SDPA)

def _boundary_layouts(staged, case):
    """Every sent activation and every gradient sent back, run on the example: (name, is_contiguous)."""
    from zbcompile.passes.trace import flatten_example

    flat, _, _ = flatten_example(case.example)
    state = {f"param:{k}": v.detach() for k, v in case.model.named_parameters()}
    state |= {f"buffer:{k}": v for k, v in case.model.named_buffers()}
    state |= {f"data:{i}": x for i, x in enumerate(flat)}
    acts, saved, seen = {}, {}, []
    for st in staged.stages:
        out = st.f({**state, **acts})
        acts = {k: v.contiguous() for k, v in out.items() if k.startswith("act:")}  # what a receive holds
        seen += [(k, v.is_contiguous()) for k, v in out.items() if k.startswith("act:")]
        saved[st.index] = out
    incoming = {"grad:loss": torch.ones_like(out["loss"])}
    for st in reversed(staged.stages):
        out = st.b({**saved[st.index], **incoming})
        incoming = {k: v.contiguous() for k, v in out.items() if k.startswith("grad:act:")}
        seen += [(k, v.is_contiguous()) for k, v in out.items() if k.startswith("grad:act:")]
    return seen


def test_permuted_boundary_is_sent_contiguous_and_matches_eager():
    case = models.seq2seq()
    staged = split_model(case.model, case.loss_fn, case.example, split_points=["encoder.2"])
    assert staged.stages[0].send[0].shape == (2, 32, 8)   # the permuted [b, d, t] view crosses the cut
    layouts = _boundary_layouts(staged, case)
    assert layouts and all(ok for _, ok in layouts), layouts
    check_against_eager(staged, case)


@pytest.mark.parametrize("point", ["encoder.1", "decoder.1"])
def test_sdpa_layout_under_autograd_splits_and_matches_eager(point):
    """Export records SDPA's no-grad output layout and drops the model's `.contiguous()`; the joint trace
    (inputs requiring grad) gets another layout, where the recorded `.view` cannot apply."""
    case = models.seq2seq()
    staged = split_model(case.model, case.loss_fn, case.example, split_points=[point])
    check_against_eager(staged, case)


@pytest.mark.slow
def test_encoder_decoder_with_a_permuted_boundary_trains_equal_to_eager_pipelined():
    threaded_step_matches_eager(models.seq2seq(), "1f1b", 2, split_points=["encoder.2"])


# (3) a stage graph that returns one of its inputs, or a view of one

@pytest.mark.parametrize("points", [["cast", "heads"], ["cast", "out"], ["heads", "out"]])
def test_stage_returning_its_input_or_a_view_of_it_matches_eager(points):
    case = models.cast_net()
    staged = split_model(case.model, case.loss_fn, case.example, split_points=points)
    check_against_eager(staged, case)
    check_against_eager(staged, case, fused=True)


def test_stage_returning_its_input_trains_equal_to_eager_pipelined():
    threaded_step_matches_eager(models.cast_net(), "1f1b", 3, split_points=["cast", "heads"])


# (5) in-place writes into slices of activations

@pytest.mark.parametrize("num_stages", [2, 4])
def test_slice_assignment_into_activations_matches_eager(num_stages):
    case = models.latent_net()
    staged = split_model(case.model, case.loss_fn, case.example, num_stages=num_stages)
    assert not any(n.target is torch.ops.aten.copy.default for st in staged.stages for n in st.f.gm.graph.nodes)
    check_against_eager(staged, case)


def test_slice_assignment_model_trains_equal_to_eager_pipelined():
    threaded_step_matches_eager(models.latent_net(), "1f1b", 2)


# (6) parameters and buffers no stage uses: real on exactly one rank

_UNUSED = ("blocks.0.spare", "blocks.0.freqs_saved", "blocks.3.spare", "blocks.3.freqs_saved", "step_count")


def test_unused_state_is_held_by_exactly_one_stage():
    case = models.rope_net()
    staged = split_model(case.model, case.loss_fn, case.example, split_points=["blocks.2"])
    held = [n for st in staged.stages for n in st.params + st.buffers]
    for name in _UNUSED:
        assert held.count(name) == 1, name
    first, last = staged.stages
    assert {"blocks.0.spare", "blocks.0.freqs_saved", "step_count"} <= set(first.params + first.buffers)
    assert {"blocks.3.spare", "blocks.3.freqs_saved"} <= set(last.params + last.buffers)
    check_against_eager(staged, case)


def test_unused_state_stays_real_on_exactly_one_rank():
    from zbcompile.distributed import keep_only

    case = models.rope_net()
    sched = generate("1f1b", 2, 4)
    staged = split_for(case.model, case.loss_fn, case.example, sched)
    state = case.model.state_dict()
    real: dict[str, list[int]] = {}
    for rank in range(2):   # what each rank keeps, as zbcompile.api builds it
        model = copy.deepcopy(case.model)
        mine = [staged.stages[sched.model_stage(s)] for s, r in enumerate(sched.placement) if r == rank]
        keep_only(model, [p for st in mine for p in st.params], [b for st in mine for b in st.buffers],
                  torch.device("cpu"), None)
        for name, value in model.state_dict().items():
            if not value.is_meta:
                assert torch.equal(value, state[name]), name
                real.setdefault(name, []).append(rank)
    assert set(real) == set(state), sorted(set(state) - set(real))
    assert all(len(real[name]) == 1 for name in _UNUSED), {n: real[n] for n in _UNUSED}


def test_model_with_unused_state_trains_equal_to_eager_pipelined():
    threaded_step_matches_eager(models.rope_net(), "1f1b", 2)


@pytest.mark.slow
def test_hf_t5_splits_automatically_and_matches_eager():
    """An encoder-decoder users bring: two inputs, blocks behind ModuleLists inside two stacks of one class,
    SDPA's layout under autograd; the automatic split cuts between blocks."""
    case = models.hf_t5()
    staged = split_model(case.model, case.loss_fn, case.example, num_stages=4)
    assert staged.meta["split_points"][0].startswith("hf.encoder.block."), staged.meta["split_points"]
    check_against_eager(staged, case)


# several inputs passed by keyword

def test_keyword_only_model_with_a_mask_matches_eager():
    from support.reference import assert_close, run_staged
    from zbcompile.passes.trace import flatten_example

    case = models.keyword_lm()
    staged = split_model(case.model, case.loss_fn, case.example, num_stages=4)
    assert all(1 in st.data for st in staged.stages)   # the mask, data:1, is read by every stage
    flat, _, _ = flatten_example(case.example)
    ref = copy.deepcopy(case.model)
    loss = case.loss_fn(ref(**case.example[0]), *case.example[1])
    loss.backward()
    s_loss, grads, _ = run_staged(staged, case.model, flat)
    assert_close(s_loss, loss.detach(), "loss")
    assert set(grads) == {n for n, p in ref.named_parameters() if p.grad is not None}
    for name, p in ref.named_parameters():
        assert_close(grads[name], p.grad, f"grad of {name}")


def test_keyword_only_model_trains_equal_to_eager_pipelined():
    case = models.keyword_lm()
    pp = 2
    sched = generate("1f1b", pp, 2 * pp)
    staged = split_model(case.model, case.loss_fn, case.example, num_stages=2)
    names = tuple(case.example[0])
    batch = distinct_microbatches((*case.example[0].values(), *case.example[1]), 2 * pp)  # flat, the dict's order
    ref, want = eager_microbatches(case.model, case.loss_fn, batch, len(names), 2 * pp, keywords=names)
    losses, ranks, _ = run_threaded(case.model, staged, sched, batch)
    assert all(abs(v - want) <= 1e-5 * want for v in losses), (losses, want)
    eager = {name for name, p in ref.named_parameters() if p.grad is not None}
    owned = assert_graded_where_eager_is(eager, param_holders(sched, staged),
                                         [{name for name, p in mdl.named_parameters() if p.grad is not None}
                                          for mdl in ranks])
    err, where = max_grad_error(ref, ranks, owned)
    assert err <= 1e-5, where


# (8) what a torch.no_grad() region computes carries no gradient, as in eager: a scale, a running average of
# activations read back in the same step, spectral_norm's power iteration; InstanceNorm's running statistics

class NoGradNet(nn.Module):
    """A scale computed under no_grad divides the activations; an EMA buffer of the activations is updated under
    no_grad and read back. Differentiating through either (as a trace without grad modes would) changes every
    gradient before it."""

    def __init__(self, width: int = 8, layers: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(layers)])
        self.register_buffer("ema", torch.zeros(width))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if i == 0:
                with torch.no_grad():
                    scale = x.abs().amax() + 1.0
                x = x / scale
            if i == 1:
                with torch.no_grad():
                    self.ema.mul_(0.9).add_(0.1 * x.mean(0))
                x = x + self.ema
        return x


def _case(model: nn.Module, example) -> models.Case:
    return models.Case(model, F.mse_loss if example[1].is_floating_point() else F.cross_entropy, example, 4)


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_values_computed_under_no_grad_carry_no_gradient(schedule):
    torch.manual_seed(0)
    threaded_step_matches_eager(_case(NoGradNet(), (torch.randn(2, 8), torch.randn(2, 8))), schedule, 2)


class ReassignedAverage(nn.Module):
    """A running average kept by reassigning its buffer (`self.avg = 0.9 * self.avg + ...`), read back in the
    same step and in the next stage."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])
        self.register_buffer("avg", torch.zeros(8))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if i == 1:
                self.avg = 0.9 * self.avg + 0.1 * x.detach().mean(0)
                x = x + self.avg
        return x + self.avg


def test_a_buffer_updated_by_reassignment_updates_as_in_eager():
    """Export drops a reassigned buffer from the step's updates: the average never moved after a step, silently.
    It is now the step's new value of the buffer, as an in-place update is."""
    torch.manual_seed(0)
    threaded_step_matches_eager(_case(ReassignedAverage(), (torch.randn(2, 8), torch.randn(2, 8))), "1f1b", 2,
                                split_points=["layers.2"])


class CastCache(nn.Module):
    """A float32 table cast to the input's dtype by reassignment in forward, as some models keep a rotary cache."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.register_buffer("table", torch.linspace(0, 1, 8))

    def forward(self, x):
        self.table = self.table.to(x.dtype)
        return self.b(torch.tanh(self.a(x)) * self.table)


def test_a_buffer_cast_by_reassignment_is_no_update_and_trains_as_eager():
    """A reassignment of another dtype is a cast of the buffer as it is, which every step's graph makes again:
    not refused, not written back."""
    torch.manual_seed(0)
    model = CastCache().double()
    model.table = model.table.float()
    x, y = torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64)
    staged = split_model(model, F.mse_loss, ((x[:2],), (y[:2],)), split_points=["b"])
    assert not any(n.startswith("buffer:") for st in staged.stages for n in st.f.outputs)
    losses, _, _ = run_threaded(model, staged, generate("1f1b", 2, 4), (x, y))
    ref = copy.deepcopy(model)
    want = sum(F.mse_loss(ref(a), b).item() for a, b in zip(x.chunk(4), y.chunk(4))) / 4
    assert all(abs(v - want) <= 1e-12 * want for v in losses), (losses, want)


class FrozenBackbone(nn.Module):
    """A backbone run under torch.no_grad() (`detach`: its output detached instead), its parameters left
    requires_grad=True, as fine-tuning code often does; a trained head. Eager gives the backbone no gradient."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.backbone = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)])
        self.head = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))

    def forward(self, x):
        if self.how == "detach":
            return self.head(self.backbone(x).detach())
        with torch.no_grad():
            f = self.backbone(x)
        return self.head(f)


@pytest.mark.parametrize("how, split_points", [("no_grad", ["backbone.2"]), ("no_grad", ["head"]),
                                               ("detach", ["head"]), ("no_grad", None)])
def test_a_backbone_under_no_grad_gets_no_gradient_wherever_the_cut_falls(how, split_points):
    """A cut inside the no_grad region sent its first half's output with a gradient: the next stage sent back
    zeros, and the backbone's parameters got zero .grad where eager leaves None (AdamW's weight decay then moved
    them). A cut right after the region (or a `.detach()`) failed with an internal SplitError. The union check
    asserts a gradient exactly where eager has one."""
    torch.manual_seed(0)
    threaded_step_matches_eager(_case(FrozenBackbone(how), (torch.randn(2, 8), torch.randn(2, 8))), "1f1b", 2,
                                split_points=split_points)


class SharedUnderNoGrad(nn.Module):
    """`b` used in both stages, in one of them only under torch.no_grad() (`first`: the first stage's use)."""

    def __init__(self, first: bool) -> None:
        super().__init__()
        self.first = first
        self.a, self.b, self.c, self.d = (nn.Linear(8, 8) for _ in range(4))

    def forward(self, x):
        if self.first:
            with torch.no_grad():
                h = self.b(self.a(x))
            return self.d(self.b(self.c(h)))
        g = self.c(self.b(self.a(x)))
        with torch.no_grad():
            scale = self.b(g).norm()   # reads c's output: in the last stage
        return self.d(g) / scale


@pytest.mark.parametrize("first", [True, False], ids=["no_grad-first", "no_grad-last"])
def test_a_parameter_one_stage_reads_under_no_grad_gets_the_other_stages_gradient(first):
    """The rank whose stage reads `b` only under no_grad took no part in summing the copies' gradients: its
    `.grad` stayed None and its copy never moved while the other rank's did. Every holder now has eager's."""
    torch.manual_seed(0)
    threaded_step_matches_eager(_case(SharedUnderNoGrad(first), (torch.randn(2, 8), torch.randn(2, 8))), "1f1b", 2,
                                split_points=["c"])


class InferenceRegion(nn.Module):
    """A gate computed under torch.inference_mode() (`decorated`: a submodule whose forward is decorated)."""

    def __init__(self, decorated: bool) -> None:
        super().__init__()
        self.decorated = decorated
        self.a, self.b, self.c, self.d = (nn.Linear(8, 8) for _ in range(4))

    @torch.inference_mode()
    def _gate(self, h):
        return self.b(h).sigmoid()

    def forward(self, x):
        h = self.a(x)
        if self.decorated:
            s = self._gate(h)
        else:
            with torch.inference_mode():
                s = self.b(h).sigmoid()
        return self.d(self.c(h) * s.clone())


@pytest.mark.parametrize("decorated", [False, True], ids=["context", "decorator"])
def test_an_inference_mode_region_carries_no_gradient(decorated):
    """Export recorded no grad-mode switch for torch.inference_mode(): gradients flowed through the region (`b`
    got one where eager's is None, `a`'s was 14% off). The trace takes it as the no_grad region it is."""
    torch.manual_seed(0)
    threaded_step_matches_eager(_case(InferenceRegion(decorated), (torch.randn(2, 8), torch.randn(2, 8))), "1f1b",
                                2, split_points=["c"])


def test_a_split_point_on_a_torch_compiled_submodule_names_it_as_the_user_does():
    """`self.b = torch.compile(block)` runs as `b._orig_mod` in the trace: split_points=["b"] was refused as a
    module that computes nothing."""
    torch.manual_seed(0)
    block = torch.compile(nn.Sequential(nn.Linear(8, 8), nn.Tanh()), backend="eager")
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), block, nn.Linear(8, 8))
    threaded_step_matches_eager(_case(model, (torch.randn(2, 8), torch.randn(2, 8))), "1f1b", 2, split_points=["2"])


class LinalgBlock(nn.Module):
    """A block solving with its own weight matrix: linalg ops whose eager form checks for a singular matrix."""

    def __init__(self, op: str) -> None:
        super().__init__()
        self.op = op
        self.w = nn.Parameter(torch.randn(8, 8) * 0.3)

    def forward(self, x):
        a = self.w + 3 * torch.eye(8, dtype=self.w.dtype, device=self.w.device)
        y = {"inv": lambda: x @ torch.linalg.inv(a), "solve": lambda: torch.linalg.solve(a, x.T).T,
             "cholesky": lambda: x @ torch.linalg.cholesky(a @ a.T),
             "lu_factor": lambda: x @ torch.linalg.lu_factor(a)[0],
             "inv_ex_checked": lambda: x @ torch.linalg.inv_ex(a, check_errors=True)[0]}[self.op]()
        return torch.tanh(y)


@pytest.mark.parametrize("op", ["inv", "solve", "cholesky", "lu_factor", "inv_ex_checked"])
def test_linalg_ops_that_check_for_a_singular_matrix_train_equal_to_eager(op):
    """torch marks their check (`_linalg_check_errors`) an ordered side effect, which aot's joint trace threads
    through as an effect token: the split failed with an internal SplitError. They are now their `_ex` forms and
    an assert of the check."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), LinalgBlock(op), nn.Linear(8, 8), LinalgBlock(op), nn.Linear(8, 8))
    threaded_step_matches_eager(_case(model.double(), (torch.randn(2, 8, dtype=torch.float64),
                                                       torch.randn(2, 8, dtype=torch.float64))), "1f1b", 2,
                                split_points=["2"])


def test_a_singular_matrix_raises_in_the_pipeline_as_in_eager():
    """The assert that stands for linalg's check raises on a singular matrix, naming the op."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), LinalgBlock("inv"), nn.Linear(8, 8))
    with torch.no_grad():
        model[1].w.copy_(-3 * torch.eye(8))   # w + 3 I == 0
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    with pytest.raises(torch.linalg.LinAlgError, match="singular"):
        model(x)
    sched = generate("1f1b", 2, 2)
    staged = split_model(model, F.mse_loss, ((x[:2],), (y[:2],)), split_points=["2"])
    with pytest.raises(RuntimeError, match="linalg_inv: the matrix is singular"):
        run_threaded(model, staged, sched, (x, y))


class ReadForItsShape(nn.Module):
    """`x` crosses the cut with a gradient (the first stage computes it from a parameter) but the next stage
    reads it only where no gradient passes: a dtype, a mask, a shape, an argmax."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, h):
        from torch.distributed.pipelining import pipe_split

        x = self.a(h)
        h = h + x
        pipe_split()
        y = torch.tanh(self.b(h))
        y = {"type_as": lambda: y.type_as(x), "mask": lambda: y * (x > 0),
             "zeros_like": lambda: y + torch.zeros_like(x), "argmax": lambda: y + x.argmax(-1, keepdim=True)}[self.how]()
        return self.c(y)


@pytest.mark.parametrize("how", ["type_as", "mask", "zeros_like", "argmax"])
def test_an_activation_the_next_stage_reads_without_a_gradient_gets_a_zero_one(how):
    """Its sender's backward waits for a gradient the receiver's never made: the lowering failed, naming the
    schedule (Gemma2's automatic split at pp=4 cut where the attention output is read for its dtype alone)."""
    torch.manual_seed(0)
    threaded_step_matches_eager(_case(ReadForItsShape(how), (torch.randn(2, 8), torch.randn(2, 8))), "1f1b", 2)


def test_spectral_norm_trains_equal_to_eager():
    torch.manual_seed(0)
    sn = nn.utils.parametrizations.spectral_norm
    model = nn.Sequential(*[m for _ in range(4) for m in (sn(nn.Linear(8, 8)), nn.Tanh())])
    threaded_step_matches_eager(_case(model, (torch.randn(2, 8), torch.randn(2, 8))), "zb-h1", 2)


@pytest.mark.parametrize("affine", [True, False])
def test_instance_norm_running_statistics_update_as_in_eager(affine):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.InstanceNorm2d(4, affine=affine, track_running_stats=True),
                          nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1), nn.InstanceNorm2d(4, track_running_stats=True),
                          nn.Flatten(), nn.Linear(4 * 6 * 6, 5))
    case = _case(model, (torch.randn(2, 3, 6, 6), torch.randint(0, 5, (2,))))
    staged = split_model(case.model, case.loss_fn, case.example, num_stages=2)
    assert any(b.endswith("running_mean") for st in staged.stages for b in st.buffers)
    threaded_step_matches_eager(case, "1f1b", 2)


# what still cannot work: one clear error naming the module, the op and the fix

class _WritesInput(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return self.fc(x)


class _UpdatesWeight(_WritesInput):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.fc.weight.mul_(0.5)
        return self.fc(x)


class _Holder(torch.nn.Module):
    """Hands the model input straight to `layers.1`."""

    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4), block])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[1](x) + self.layers[0](x.detach())


@pytest.mark.parametrize("block,text", [
    (_WritesInput, r"writes into a model input in place \(`aten.mul.Tensor` in module `layers.1`\).*x.clone\(\)"),
    (_UpdatesWeight, r"updates parameter `layers.1.fc.weight` in place inside forward \(`aten.mul.Tensor` in "
                     r"module `layers.1`\).*fix: keep forward free of parameter updates"),
])
def test_in_place_writes_the_pipeline_cannot_carry_name_module_op_and_fix(block, text):
    from zbcompile.errors import TraceError

    model = _Holder(block())
    with pytest.raises(TraceError, match=text):
        split_model(model, torch.nn.functional.mse_loss, (torch.randn(2, 4), torch.randn(2, 4)), num_stages=2)


def test_batch_norm_with_a_cumulative_average_says_to_give_it_a_momentum():
    from zbcompile.errors import TraceError

    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8, momentum=None), nn.Linear(8, 8))
    with pytest.raises(TraceError, match=r"`1` \(BatchNorm1d\) has momentum=None.*Give it a momentum"):
        split_model(model, F.mse_loss, (torch.randn(4, 8), torch.randn(4, 8)), num_stages=2)


def test_one_tensor_given_twice_in_the_example_is_two_arguments():
    """example=(x, x) (inputs and targets of one shape, one placeholder tensor): each batch argument of the step is
    its own, so the model reads the inputs and the loss the targets (export alone would merge the two)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(8, 8), nn.Tanh())])
    x = torch.randn(2, 8)
    threaded_step_matches_eager(models.Case(model, F.mse_loss, (x, x), 4), "1f1b", 2)


class ArgmaxRelay(nn.Module):
    """A middle stage that reads its input only through argmax (no gradient) and sends on the indices alone:
    nothing upstream of it gets a gradient (eager: None); `skip` also sends the first stage's output around it,
    so the first stage does get one through the last."""

    def __init__(self, skip: bool) -> None:
        super().__init__()
        self.skip = skip
        self.a = nn.Linear(8, 8)
        self.relay = nn.Tanh()
        self.emb = nn.Embedding(8, 8)
        self.d = nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        idx = self.relay(h).argmax(-1)
        out = self.d(self.emb(idx))
        return out + h if self.skip else out


@pytest.mark.parametrize("skip", [False, True], ids=["relay", "relay+skip"])
def test_a_stage_sending_on_only_what_has_no_gradient_ends_the_backward_there(skip):
    """The first stage waited for the gradient of `h`, which the middle stage (argmax alone) never sends:
    lowering failed with "no rank's program produces it". The first stage now knows no gradient comes back."""
    torch.manual_seed(0)
    threaded_step_matches_eager(_case(ArgmaxRelay(skip), (torch.randn(2, 8), torch.randn(2, 8))), "1f1b", 3,
                                split_points=["relay", "emb"])


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_an_activation_read_only_through_argmax_sends_no_zero_gradient_back(schedule):
    """The stage reading `h` only through argmax also trains (the embedding, `d`): its backward sent zeros back
    for `h`, and the first stage's `a` got a zero .grad where eager's is None (AdamW's weight decay then moved
    it). No gradient goes back now, and `a.grad` stays None."""
    torch.manual_seed(0)
    threaded_step_matches_eager(_case(ArgmaxRelay(False), (torch.randn(2, 8), torch.randn(2, 8))), schedule, 2,
                                split_points=["relay"] if schedule == "1f1b" else ["relay", "emb", "d"])


class SummedScales(nn.Module):
    """Parameters read only through a sum (`p.sum()`, `p.sum(0)`): each one's gradient is its output gradient
    expanded, a view whose elements share memory; `shared` is read in the first and the last layer."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])
        self.scale = nn.Parameter(torch.randn(8))
        self.rows = nn.Parameter(torch.randn(3, 8))
        self.shared = nn.Parameter(torch.randn(8))

    def forward(self, x):
        x = torch.tanh(self.layers[0](x)) * self.shared.sum()
        for layer in self.layers[1:]:
            x = torch.tanh(layer(x))
        return (x * self.scale.sum() + self.rows.sum(0)) * self.shared.sum()


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "zbv"])
def test_a_gradient_that_is_an_expanded_view_accumulates_over_microbatches_as_eager(schedule):
    """The first microbatch's gradient was kept as the running sum and the next added into it in place, which
    raised torch's "more than one element of the written-to tensor refers to a single memory location" (probe
    37). An output whose elements overlap is no sum to add into: the sum starts out of place."""
    torch.manual_seed(0)
    threaded_step_matches_eager(_case(SummedScales(), (torch.randn(2, 8), torch.randn(2, 8))), schedule, 2)
