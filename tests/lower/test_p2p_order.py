"""P2P posting order per pair of ranks, the rule NCCL needs (it matches sends to receives by order, not tag).

Structure first: for every schedule at pp=2 and pp=4, after lowering, the receives rank b posts from rank a
come in the order rank a posts its sends to b, and the programs still validate. Then execution: every
rank's program runs as a thread against `FifoWorld`, a fake process group that matches like NCCL (the k-th
receive posted from a source gets the k-th tensor that source sent, whatever the tags) and checks each
arrival's tag against the receive's; loss and grads equal eager. Without order_p2p_by_pair, the V
schedules fail both ways: check_pair_order reports the pair, and FifoWorld delivers the wrong tensors.
"""

from __future__ import annotations

import copy
import functools
import threading
from collections import defaultdict
from datetime import timedelta

import pytest
import torch

from support.models import gpt, mlp
from support.threaded import max_grad_error, param_holders, run_ranks
from zbcompile.errors import LoweringError, RuntimeFailure
from zbcompile.passes.lower import check_pair_order, emit_fx, lower_all, order_p2p_by_pair, validate_programs
from zbcompile.passes.lower.order_p2p import pair_sequences

from zbcompile.passes.schedules import GENERATORS, generate
from zbcompile.ir.program.ops import OpKind
from zbcompile.runtime import RankRuntime
from zbcompile.runtime.loopback import LoopbackGroup, LoopbackWorld
from zbcompile.split import split_model

torch.set_num_threads(1)

SCHEDULES = list(GENERATORS)
V_MISMATCHED = ["zbv", "v-half", "v-zb"]  # receiver order differs from sender order already at pp=2


@functools.lru_cache(maxsize=None)
def _mlp(stages: int):
    model, loss_fn, (x, _), _ = mlp(layers=8)
    return model, loss_fn, split_model(model, loss_fn, ((x[:1],), (x[:1],)), num_stages=stages)


@functools.lru_cache(maxsize=None)
def _gpt(stages: int):
    model, loss_fn, (x, y), _ = gpt(layers=4)
    return model, loss_fn, split_model(model, loss_fn, ((x[:1],), (y[:1],)), num_stages=stages)


def _tags(seqs):
    return {pair: [p.tag for p in seq] for pair, seq in seqs.items()}


# ---- structure ------------------------------------------------------------------------------------
@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("name", SCHEDULES)
def test_receives_are_posted_in_the_senders_order(name, pp):
    sched = generate(name, pp, 2 * pp)
    *_, staged = _mlp(sched.num_model_stages)
    programs = lower_all(sched, staged)
    sends, recvs = pair_sequences(programs)
    assert _tags(sends) == _tags(recvs)
    validate_programs(programs)
    check_pair_order(programs)
    unordered = lower_all(sched, staged, pair_order=False)
    for before, after in zip(unordered, programs):
        assert "order_p2p_by_pair" in after.passes
        # only receives move, and only up: every other op keeps its order, every receive precedes its wait
        assert [op for op in before.ops if op.kind is not OpKind.RECV] == \
               [op for op in after.ops if op.kind is not OpKind.RECV]
        index = {op.outs[0]: i for i, op in enumerate(after.ops) if op.kind is OpKind.RECV}
        old = {op.outs[0]: i for i, op in enumerate(before.ops) if op.kind is OpKind.RECV}
        waits = {op.ins[0]: i for i, op in enumerate(after.ops) if op.kind is OpKind.WAIT_RECV}
        assert index.keys() == old.keys() == waits.keys()
        assert all(index[h] < waits[h] for h in index)
        assert all(_runs_before(after, index[h]) <= _runs_before(before, old[h]) for h in index)


def _runs_before(program, i: int) -> int:
    return sum(op.kind is OpKind.RUN for op in program.ops[:i])


def test_tied_weight_exchange_is_ordered_too():
    sched = generate("dualpipe", 4, 8)  # mirrored stages and a tied wte: reduce sends beside boundary sends
    *_, staged = _gpt(sched.num_model_stages)
    programs = lower_all(sched, staged)
    assert any(op.kind is OpKind.SUM for p in programs for op in p.ops)
    sends, recvs = pair_sequences(programs)
    assert _tags(sends) == _tags(recvs)


def test_the_pass_is_pure_and_idempotent():
    sched = generate("zbv", 2, 4)
    *_, staged = _mlp(4)
    unordered = lower_all(sched, staged, pair_order=False)
    snapshot = [p.ops for p in unordered]
    once = order_p2p_by_pair(unordered)
    assert [p.ops for p in unordered] == snapshot
    assert [p.ops for p in order_p2p_by_pair(once)] == [p.ops for p in once]
    assert [p.ops for p in once] != snapshot


@pytest.mark.parametrize("name", V_MISMATCHED)
def test_without_the_pass_v_schedules_mismatch_with_a_picture(name):
    sched = generate(name, 2, 4)
    *_, staged = _mlp(4)
    programs = lower_all(sched, staged, pair_order=False)
    validate_programs(programs)  # tag matching is content: gloo would run these
    with pytest.raises(LoweringError, match="rank 0 sends to rank 1") as info:
        check_pair_order(programs)
    text = str(info.value)
    assert ">>" in text and "receives from rank 0" in text and "order_p2p_by_pair" in text


# ---- execution against NCCL's matching rule ------------------------------------------------------
class FifoWorld(LoopbackWorld):
    """Matches like NCCL: per (source, destination), the k-th receive posted takes the k-th tensor sent,
    tags ignored. `strict`: a receive whose tag differs from the arriving send's raises at its wait
    (else it takes the wrong tensor silently, as NCCL would). Each arrival is logged as
    (source, destination, k, receive tag, send tag)."""

    def __init__(self, size: int, strict: bool = True):
        super().__init__(size)
        self.strict = strict
        self.cond = threading.Condition()
        self.sent: dict[tuple[int, int], list] = defaultdict(list)
        self.posted: dict[tuple[int, int], int] = defaultdict(int)
        self.arrivals: list[tuple[int, int, int, int, int]] = []
        self.aborted = False

    def group(self, rank: int) -> FifoGroup:
        return FifoGroup(self, rank)

    def abort(self) -> None:
        with self.cond:
            self.aborted = True
            self.cond.notify_all()
        self.barrier.abort()


class _Done:
    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        return True


class _Arrival:
    def __init__(self, fill):
        self.fill = fill

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        self.fill(timeout.total_seconds() or None)
        return True


class FifoGroup(LoopbackGroup):
    world: FifoWorld

    def send(self, tensors, dst: int, tag: int):
        w = self.world
        with w.cond:
            w.sent[(self.rank_, dst)].append((tag, tensors[0].clone()))
            w.cond.notify_all()
        return _Done()

    def recv(self, tensors, src: int, tag: int):
        w, pair = self.world, (src, self.rank_)
        with w.cond:
            k = w.posted[pair]
            w.posted[pair] += 1

        def fill(seconds):
            with w.cond:
                if not w.cond.wait_for(lambda: len(w.sent[pair]) > k or w.aborted, seconds) or w.aborted:
                    raise RuntimeError(f"fifo group: receive #{k} from rank {src} never arrived")
                sent_tag, value = w.sent[pair][k]
                w.arrivals.append((src, self.rank_, k, tag, sent_tag))
            if w.strict and sent_tag != tag:
                raise RuntimeError(f"fifo group: rank {self.rank_}'s receive #{k} from rank {src} was posted for "
                                   f"tag {tag} but the tensor sent #{k} carries tag {sent_tag}")
            tensors[0].copy_(value)

        return _Arrival(fill)


def _run_fifo(programs, model, batch, world: FifoWorld, timeout: float = 20.0):
    """One step of every rank's program as threads on `world`; (losses, models per rank)."""
    pp, m = len(programs), programs[0].microbatches
    models = [copy.deepcopy(model) for _ in range(pp)]
    data = [t.chunk(m) for t in batch]
    losses, errors = [None] * pp, []

    def run(r: int) -> None:
        try:
            rt = RankRuntime(programs[r], emit_fx(programs[r]), pg=world.group(r), device=torch.device("cpu"),
                             params=dict(models[r].named_parameters()), buffers=dict(models[r].named_buffers()),
                             timeout=timeout, peers=programs)
            losses[r] = rt.step(data)
        except BaseException as e:  # reported in the main thread
            errors.append(e)
            world.abort()

    run_ranks(run, pp, errors)
    return losses, models


def _step_error(name: str, pp: int, factory, *, pair_order: bool = True, strict: bool = True):
    """(loss error, grad error, world) of one FIFO-matched step of `name` against eager autograd."""
    sched = generate(name, pp, 2 * pp)
    model, loss_fn, staged = factory(sched.num_model_stages)
    torch.manual_seed(1)
    if factory is _gpt:
        batch = tuple(torch.randint(0, 64, (2 * pp, 8)) for _ in range(2))
    else:
        batch = tuple(torch.randn(2 * pp, 16) for _ in range(2))
    ref = copy.deepcopy(model)
    loss = loss_fn(ref(batch[0]), batch[1])
    loss.backward()
    world = FifoWorld(pp, strict=strict)
    losses, models = _run_fifo(lower_all(sched, staged, pair_order=pair_order), model, batch, world)
    holders = param_holders(sched, staged)
    owned = [[f for f, rs in holders.items() if r in rs] for r in range(pp)]
    loss_err = max(abs(v - loss.item()) for v in losses) / abs(loss.item())
    return loss_err, max_grad_error(ref, models, owned)[0], world


@pytest.mark.parametrize("name,pp", [(n, 2) for n in SCHEDULES] + [(n, 4) for n in ("zbv", "v-half", "dualpipev")])
def test_fifo_matched_step_equals_eager(name, pp):
    loss_err, grad_err, world = _step_error(name, pp, _mlp)
    assert loss_err <= 1e-5 and grad_err <= 1e-5
    assert world.arrivals and all(want == got for *_, want, got in world.arrivals)


@pytest.mark.parametrize("name,pp", [("1f1b", 2), ("dualpipe", 4), ("zbv", 4)])
def test_fifo_matched_step_with_tied_weights_equals_eager(name, pp):
    loss_err, grad_err, _ = _step_error(name, pp, _gpt)
    assert loss_err <= 1e-5 and grad_err <= 1e-5


@pytest.mark.parametrize("name,pp", [(n, 2) for n in V_MISMATCHED] + [(n, 4) for n in ("zbv", "v-half", "dualpipev")])
def test_without_the_pass_fifo_matching_delivers_the_wrong_tensor(name, pp):
    with pytest.raises(RuntimeFailure, match="carries tag"):
        _step_error(name, pp, _mlp, pair_order=False)


def test_without_the_pass_fifo_matching_swaps_tensors_silently():
    with pytest.raises(RuntimeFailure, match="posted for tag 7 but the tensor sent #2 carries tag 16"):
        _step_error("zbv", 2, _mlp, pair_order=False)
    # the same shapes, so NCCL would not notice: the step finishes with wrong gradients
    _, grad_err, world = _step_error("zbv", 2, _mlp, pair_order=False, strict=False)
    assert any(want != got for *_, want, got in world.arrivals)
    assert grad_err > 1e-3
