"""The test suite's split memo (tests/support/split_memo.py): a repeated request gets a copy of the same split,
whose programs equal a fresh split's; anything the trace reads that differs is a miss."""

from __future__ import annotations

import functools

import torch
from torch import nn

from support import split_memo
from support.models import gpt, mlp
from zbcompile.passes.lower import lower_all
from zbcompile.passes.schedules import generate
from zbcompile.split import split_model


def test_a_repeated_split_is_a_copy_whose_programs_equal_a_fresh_splits():
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return split_model(*args, **kwargs)

    once = split_memo.memoized(counted, split_memo.Memo())
    sched = generate("zbv", 2, 4)
    first, again = (once(c.model, c.loss_fn, c.example, num_stages=4, placement=(0, 1, 1, 0))
                    for c in (gpt(layers=4), gpt(layers=4)))
    case = gpt(layers=4)
    fresh = split_model(case.model, case.loss_fn, case.example, num_stages=4, placement=(0, 1, 1, 0))
    assert len(calls) == 1
    assert again is not first and again.stages[0].f.gm is not first.stages[0].f.gm
    texts = [[p.to_text() for p in lower_all(sched, s)] for s in (first, again, fresh)]
    assert texts[0] == texts[1] == texts[2]
    node = next(iter(again.stages[1].f.gm.graph.nodes))
    assert isinstance(node.meta["val"], torch.Tensor)   # the copy keeps the traced shapes


def test_a_split_at_another_stage_count_or_placement_reuses_the_trace_and_equals_a_fresh_one(monkeypatch):
    """The memo keeps the trace too (`zbcompile.split.trace`): splits of one step at pp=2, pp=4, in a V and with
    vocabulary shards trace it once, and each lowers to the programs of a split traced anew."""
    import zbcompile.split as split

    calls = []
    trace = split.trace.__wrapped__   # the session's memo (off here) wraps it

    def counted(*args, **kwargs):
        calls.append(1)
        return trace(*args, **kwargs)

    wanted = [(generate("1f1b", 2, 4), {}), (generate("1f1b", 4, 4), {}), (generate("zbv", 2, 4), {}),
              (generate("1f1b", 2, 4, vocab=True), {"vocab_shards": 2})]
    fresh = []
    for sched, more in wanted:
        case = gpt(layers=4)
        fresh.append(split_model(case.model, case.loss_fn, case.example, num_stages=sched.num_model_stages,
                                 placement=sched.stage_groups(), **more))
    monkeypatch.setattr(split, "trace", split_memo.memoized(counted, split_memo.Memo(), what="trace"))
    for (sched, more), made in zip(wanted, fresh):
        case = gpt(layers=4)
        staged = split_model(case.model, case.loss_fn, case.example, num_stages=sched.num_model_stages,
                             placement=sched.stage_groups(), **more)
        assert [p.to_text() for p in lower_all(sched, staged)] == [p.to_text() for p in lower_all(sched, made)]
    assert len(calls) == 1


def _key(case, **kwargs):
    return split_memo.fingerprint(case.model, case.loss_fn, case.example, kwargs)


def test_what_the_trace_reads_is_in_the_fingerprint():
    base = _key(gpt(layers=2), num_stages=2)
    assert base is not None and base == _key(gpt(layers=2), num_stages=2)
    assert base != _key(gpt(layers=2), num_stages=3)
    assert base != _key(gpt(layers=2, dropout=0.1), num_stages=2)     # a hyperparameter of a child
    assert base != _key(gpt(layers=2, batch=1), num_stages=2)         # the example's shape
    assert base != _key(gpt(layers=3), num_stages=2)

    case = gpt(layers=2)
    case.model.eval()
    assert base != _key(case, num_stages=2)                           # training flags
    case = gpt(layers=2)
    case.model.blocks[0].register_forward_hook(lambda m, i, o: o * 2)
    assert base != _key(case, num_stages=2)                           # hooks
    case = gpt(layers=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert base != _key(case, num_stages=2)                       # autocast in force


def test_constants_closures_and_objects_without_a_repr_tell_splits_apart():
    class Scaled(nn.Module):
        def __init__(self, scale):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.scale = scale            # a tensor outside the parameters: export lifts it as a constant

        def forward(self, x):
            return self.lin(x) * self.scale

    example = ((torch.randn(2, 4),), (torch.randn(2, 4),))

    def key(model, loss_fn):
        return split_memo.fingerprint(model, loss_fn, example, {})

    mse = nn.functional.mse_loss
    assert key(Scaled(torch.ones(4)), mse) == key(Scaled(torch.ones(4)), mse)
    assert key(Scaled(torch.ones(4)), mse) != key(Scaled(torch.full((4,), 2.0)), mse)

    def loss_with(weight):
        return lambda out, y: (weight * (out - y) ** 2).mean()

    assert key(Scaled(torch.ones(4)), loss_with(1.0)) == key(Scaled(torch.ones(4)), loss_with(1.0))
    assert key(Scaled(torch.ones(4)), loss_with(1.0)) != key(Scaled(torch.ones(4)), loss_with(2.0))
    assert (key(Scaled(torch.ones(4)), functools.partial(nn.functional.huber_loss, delta=1.0))
            != key(Scaled(torch.ones(4)), functools.partial(nn.functional.huber_loss, delta=2.0)))

    class Opaque:   # no repr of its own: equal only to itself
        pass

    a, b = mlp(layers=2), mlp(layers=2)
    a.model.extra, b.model.extra = Opaque(), Opaque()
    assert split_memo.fingerprint(a.model, a.loss_fn, a.example, {}) != split_memo.fingerprint(
        b.model, b.loss_fn, b.example, {})


def test_a_failed_split_is_not_kept():
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        raise ValueError("bad split")

    once = split_memo.memoized(failing, split_memo.Memo())
    case = mlp(layers=2)
    for _ in range(2):
        try:
            once(case.model, case.loss_fn, case.example, num_stages=2)
        except ValueError:
            pass
    assert len(calls) == 2


def test_a_split_through_a_file_lowers_and_trains_as_the_split_itself(tmp_path):
    """The disk memo's pickle (fx graphs node by node with their meta, fake tensors as fake tensors): the loaded
    split lowers to the same programs, and one step on it gives the same loss and gradients, bit for bit."""
    import copy

    from support.threaded import run_threaded

    for case, name, pp in ((gpt(layers=4), "zbv", 2), (mlp(layers=4), "1f1b", 2)):
        sched = generate(name, pp, 4)
        staged = split_model(case.model, case.loss_fn, case.example, num_stages=sched.num_model_stages,
                             placement=sched.stage_groups())
        loaded = split_memo.loads(split_memo.dumps(staged))
        assert [p.to_text() for p in lower_all(sched, loaded)] == [p.to_text() for p in lower_all(sched, staged)]
        batch = tuple(torch.cat([t] * 4) for t in torch.utils._pytree.tree_leaves(case.example))
        runs = [run_threaded(copy.deepcopy(case.model), s, sched, batch) for s in (staged, loaded)]
        assert runs[0][0] == runs[1][0]
        for a, b in zip(runs[0][1], runs[1][1]):
            for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
                assert (p.grad is None) == (q.grad is None) and (p.grad is None or torch.equal(p.grad, q.grad)), n


def test_a_vocabulary_split_through_a_file_keeps_its_last_stage_whole():
    """A vocabulary-parallel split keeps the last stage as cut (for a forward returning the logits), whose targets
    export left with a symbolic storage size: the pickle stores the size's value (it pickled the shape
    environment, which did not load, and a launch's ranks that loaded the split fell out of step with the one that
    made it). The loaded split's training and forward programs equal the split's own."""
    from zbcompile.compiler import Compiled, compile_forward
    from zbcompile.options import CompileOptions

    case = gpt(layers=4)
    (x, y) = case.example
    sched = generate("1f1b", 2, 4, vocab=True)
    staged = split_model(case.model, case.loss_fn, ((x[:1],), (y[:1],)), num_stages=2, vocab_shards=2)
    loaded = split_memo.loads(split_memo.dumps(staged))
    options = CompileOptions(schedule=sched, microbatches=4)
    for training, outputs in ((False, False), (False, True), (True, True)):
        made = [compile_forward(Compiled(options, s, sched, ()), training, outputs) for s in (staged, loaded)]
        assert [p.to_text() for p in made[0]] == [p.to_text() for p in made[1]]
    assert [p.to_text() for p in lower_all(sched, loaded)] == [p.to_text() for p in lower_all(sched, staged)]


def test_the_disk_memo_is_shared_between_processes_and_never_names_a_local_object(tmp_path):
    shared = split_memo.OnDisk(str(tmp_path))
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return split_model(*args, **kwargs)

    case = mlp(layers=2)
    first = split_memo.memoized(counted, shared)(case.model, case.loss_fn, case.example, num_stages=2)
    assert len(list(tmp_path.glob("*.pkl"))) == 1
    other_process = split_memo.memoized(counted, split_memo.OnDisk(str(tmp_path)))
    again = other_process(case.model, case.loss_fn, case.example, num_stages=2)
    assert len(calls) == 1
    sched = generate("1f1b", 2, 2)
    assert [p.to_text() for p in lower_all(sched, again)] == [p.to_text() for p in lower_all(sched, first)]

    class Local(nn.Module):
        def forward(self, x):
            return x

    key = split_memo.fingerprint(Local(), case.loss_fn, case.example, {})
    assert key is not None and split_memo.digest(key) is None


def test_the_memo_is_off_here():
    """tests/conftest.py: under tests/split/ every split is made anew (the split is what these tests test)."""
    import zbcompile.split as split

    assert getattr(split.split_model, "__wrapped__", None) is not None   # installed for the session
    assert split_memo._state["enabled"] is False
