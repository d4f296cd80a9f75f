"""The rank-program IR's op kinds: every kind has a complete spec, every op prints and parses back, and every
lowered program round-trips through its text."""

from __future__ import annotations

import dataclasses
import functools
import pkgutil
import typing

import pytest
import torch

from support.models import gpt
from zbcompile.passes.lower import emit_fx, lower_all
from zbcompile.passes.lower.emit import Emitter
from zbcompile.passes.schedules import GENERATORS, generate
from zbcompile.ir.program import RankProgram
from zbcompile.ir.program import ops
from zbcompile.ir.program.ops import (Coll, CollArgs, DPArgs, GatherArgs, FAMILIES, SAFE, SPECS, AccumArgs, AccumMode, HostArgs, Message,
                                      Op, OpKind, RecvArgs, RunArgs, SendArgs, SetGradArgs, StampArgs, Stream, Sync,
                                      TensorType, ValidateArgs, View, ViewArgs)
from zbcompile.runtime import abi
from zbcompile.ir.schedule import Action, Schedule
from zbcompile.split import split_model
from zbcompile.ir.stages import StagedModel

torch.set_num_threads(1)

_T = TensorType((2, 8), torch.float32)
# one op of every kind, as a pass would build it
SAMPLES = {
    OpKind.RUN: Op(OpKind.RUN, ("param:w", "s0.mb1.act:h"), ("s1.mb1.loss",), RunArgs(Action.parse("1F1"), "stage1_f")),
    OpKind.RECV: Op(OpKind.RECV, (), ("h:s0.mb1.act:h",), RecvArgs(0, 8, _T, 3), note="for 1F1"),
    OpKind.WAIT_RECV: Op(OpKind.WAIT_RECV, ("h:s0.mb1.act:h",), ("s0.mb1.act:h",)),
    OpKind.SEND: Op(OpKind.SEND, ("s1.mb0.grad:act:h", "s1.mb0.grad:act:g"), ("h:send0",),
                    SendArgs((Message(0, 1, _T), Message(2, 5, TensorType((), torch.bfloat16))))),
    OpKind.WAIT_SEND: Op(OpKind.WAIT_SEND, ("h:send0",)),
    OpKind.FREE: Op(OpKind.FREE, ("s1.mb0.saved:0", "s1.mb0.saved:1"), note="last use by 1B0"),
    OpKind.ACCUM: Op(OpKind.ACCUM, ("acc0.grad:param:w", "s1.mb1.grad:param:w"), ("acc1.grad:param:w",),
                     AccumArgs(AccumMode.ADD_)),
    OpKind.SUM: Op(OpKind.SUM, ("acc3.grad:param:w", "r1.grad:param:w"), ("sum.grad:param:w",)),
    OpKind.SET_GRAD: Op(OpKind.SET_GRAD, ("param:w", "sum.grad:param:w"), args=SetGradArgs(True)),
    OpKind.ADD_LOSS: Op(OpKind.ADD_LOSS, ("s1.mb0.loss", "s1.mb1.loss"), ("loss",)),
    OpKind.KEEP_OUTPUTS: Op(OpKind.KEEP_OUTPUTS, ("s1.mb0.out:0", "s1.mb0.out:1", "s1.mb1.out:0", "s1.mb1.out:1"),
                            ("outputs",)),
    OpKind.COPY_BUFFER: Op(OpKind.COPY_BUFFER, ("buffer:bn.mean", "s1.mb0.buffer:bn.mean")),
    OpKind.STAMP: Op(OpKind.STAMP, args=StampArgs(7)),
    OpKind.COLLECTIVE: Op(OpKind.COLLECTIVE, ("v.mb1.vocab:dx",), ("h:c3",), CollArgs(Coll.REDUCE, 1, 3, _T),
                          note="microbatch 1"),
    OpKind.WAIT_COLL: Op(OpKind.WAIT_COLL, ("h:c3",), ("v.mb1.vocab:gx",)),
    OpKind.DP_REDUCE: Op(OpKind.DP_REDUCE, ("acc3.grad:param:w", "sum.grad:param:b"), ("h:dp2",), DPArgs(2),
                         note="2 gradients, 96 bytes"),
    OpKind.WAIT_DP: Op(OpKind.WAIT_DP, ("h:dp2",), ("dp.grad:param:w", "dp.grad:param:b")),
    OpKind.DP_GATHER: Op(OpKind.DP_GATHER, ("zero.param:w", "zero.param:b"), ("h:ag1",),
                         GatherArgs(1, 2, (TensorType((5, 3), torch.float32), TensorType((3,), torch.float32))),
                         note="2 parameters for [0F0]"),
    OpKind.WAIT_GATHER: Op(OpKind.WAIT_GATHER, ("h:ag1",), ("ag1.param:w", "ag1.param:b"),
                           GatherArgs(1, 2, (TensorType((5, 3), torch.float32), TensorType((3,), torch.float32)))),
    # one storage of 96 bytes holding two saved views, copied out and back as bytes
    OpKind.OFFLOAD: Op(OpKind.OFFLOAD, ("s0.mb1.saved:3", "s0.mb1.saved:4"), ("h:off.s0.mb1.saved:3",),
                       HostArgs(2, TensorType((96,), torch.uint8)), note="for 0B1"),
    OpKind.WAIT_OFFLOAD: Op(OpKind.WAIT_OFFLOAD, ("h:off.s0.mb1.saved:3",)),
    OpKind.RELOAD: Op(OpKind.RELOAD, (), ("h:re.s0.mb1.saved:3",), HostArgs(2, TensorType((96,), torch.uint8))),
    OpKind.WAIT_RELOAD: Op(OpKind.WAIT_RELOAD, ("h:re.s0.mb1.saved:3",), ("re.s0.mb1.saved:3", "re.s0.mb1.saved:4"),
                           ViewArgs((View(TensorType((2, 8), torch.float32, (1, 2)), 0),
                                     View(TensorType((8,), torch.float32, (1,)), 16)))),
    OpKind.PREFIX: Op(OpKind.PREFIX, ("pv.up", "loss"), ("pv.prefix",)),
    OpKind.TOTALS: Op(OpKind.TOTALS, (), ("pv.totals",)),
    OpKind.VALIDATE: Op(OpKind.VALIDATE, ("pv.totals",), (), ValidateArgs((Message(0, 4, _T), Message(0, 8, _T))),
                        note="after 2 warm-up action(s)"),
}


@pytest.mark.parametrize("kind", list(OpKind), ids=lambda k: k.name)
def test_every_op_kind_has_a_complete_spec(kind):
    spec = SPECS.get(kind)
    assert spec is not None, f"{kind} has no OpSpec in SPECS"
    assert spec.kind is kind and spec.meaning.strip() and spec.text.strip()
    assert spec.args is None or (isinstance(spec.args, type) and hasattr(spec.args, "_fields")), \
        "args must be a NamedTuple record (or None)"
    for part in ("format", "parse", "aliases", "keeps", "posts"):
        assert callable(getattr(spec, part)), f"{kind}: {part} is not callable"
    assert isinstance(spec.sync, Sync) and isinstance(spec.stream, Stream)
    assert callable(getattr(Emitter, spec.emit, None)), f"{kind}: Emitter has no method {spec.emit!r}"
    for name in spec.runtime:
        assert callable(getattr(abi, name, None)), f"{kind}: runtime ABI has no function {name!r}"
    assert kind in SAMPLES, f"{kind}: add a sample op to SAMPLES (it tests the text round trip)"
    sample = SAMPLES[kind]
    assert (sample.args is None) == (spec.args is None) and (spec.args is None or isinstance(sample.args, spec.args))
    # exactly the posting kinds put messages on the wire, and the checks can read them
    assert bool(spec.posts(sample, 1)) == (spec.sync is Sync.POST)


def test_every_package_module_but_the_machinery_is_a_registered_family():
    modules = {m.name for m in pkgutil.iter_modules(ops.__path__)} - {"_spec"}
    assert modules == {f.__name__.rpartition(".")[2] for f in FAMILIES}, \
        "a module of zbcompile/ir/program/ops/ that is not in ops.FAMILIES: its rows never reach SPECS"


@pytest.mark.parametrize("kind", list(OpKind), ids=lambda k: k.name)
def test_every_op_kind_is_declared_once_in_one_family(kind):
    """One row per kind, in exactly one family module, next to its args record; it prints and parses back;
    where capture can refuse it, the row says how to fix that (passes/analysis/capture.py prints it)."""
    declared = [(f, row) for f in FAMILIES for row in f.ROWS if row.kind is kind]
    assert len(declared) == 1, f"{kind}: declared by {[f.__name__ for f, _ in declared]}; declare it in one family"
    family, row = declared[0]
    assert SPECS[kind] is row
    assert row.args is None or row.args.__module__ == family.__name__, \
        f"{kind}: its args record {row.args.__name__} lives in {row.args.__module__}, not beside its row"
    op = SAMPLES[kind]
    ins, args = row.parse(row.format(op), op.outs)
    assert ins == op.ins and (args == op.args or kind is OpKind.RUN)   # RUN's args: from the line's head
    assert row.capture is not None, f"{kind}: decide OpSpec.capture"
    if row.capture != SAFE:
        assert isinstance(row.fix, str) and row.fix.strip(), f"{kind}: capture may refuse it, so give OpSpec.fix"


@pytest.mark.parametrize("kind", list(OpKind), ids=lambda k: k.name)
def test_copy_stream_kinds_say_what_they_copy(kind):
    """The offload planner times ops by their spec: a copy-stream op either queues copy_bytes on the copy stream
    (and returns the handles its waits read) or waits for the copies whose handles it reads."""
    spec, op = SPECS[kind], SAMPLES[kind]
    if spec.stream is not Stream.COPY:
        assert spec.copy_bytes is None
    elif spec.copy_bytes is not None:
        assert spec.copy_bytes(op) > 0 and op.outs
    else:
        assert op.ins and all(v.startswith("h:") for v in op.ins)


def test_spec_texts_are_unique():
    texts = [s.text for s in SPECS.values()]
    assert len(texts) == len(set(texts))


@pytest.mark.parametrize("kind", list(OpKind), ids=lambda k: k.name)
def test_every_op_prints_and_parses_back(kind):
    op = SAMPLES[kind]
    program = RankProgram("test", 1, 2, inputs=("param:w",), ops=(op,), graphs={})
    text = program.to_text()
    back = RankProgram.from_text(text)
    assert back.ops == (op,) and back.to_text() == text


def test_aliases_and_keeps_follow_the_specs():
    """What buffers.py relies on, read off the specs: which outputs may share memory with inputs."""
    no_graphs = lambda key: ()  # noqa: E731
    assert SAMPLES[OpKind.WAIT_RECV].spec.aliases(SAMPLES[OpKind.WAIT_RECV], no_graphs) == \
        [("h:s0.mb1.act:h", "s0.mb1.act:h")]
    send = SAMPLES[OpKind.SEND]
    assert send.spec.aliases(send, no_graphs) == [(v, "h:send0") for v in send.ins]
    accum = SAMPLES[OpKind.ACCUM]
    assert accum.spec.aliases(accum, no_graphs) == [("acc0.grad:param:w", "acc1.grad:param:w")]
    # the offload's handle holds every view of the storage; every reloaded view aliases the reload's handle
    off, back = SAMPLES[OpKind.OFFLOAD], SAMPLES[OpKind.WAIT_RELOAD]
    assert off.spec.aliases(off, no_graphs) == [(v, "h:off.s0.mb1.saved:3") for v in off.ins]
    assert back.spec.aliases(back, no_graphs) == [("h:re.s0.mb1.saved:3", v) for v in back.outs]
    # the reload allocates the storage once; its views allocate nothing
    assert SPECS[OpKind.RELOAD].fresh(SAMPLES[OpKind.RELOAD], None, 1) == (96,)
    assert back.spec.fresh(back, None, 1) == (0, 0)
    assert SAMPLES[OpKind.SET_GRAD].spec.keeps(SAMPLES[OpKind.SET_GRAD])
    assert not any(SPECS[k].keeps(SAMPLES[k]) for k in OpKind if k is not OpKind.SET_GRAD)


def test_bad_program_text_says_where():
    text = RankProgram("test", 0, 2, ops=(SAMPLES[OpKind.RECV],)).to_text()
    with pytest.raises(Exception, match="line 3 .*irecv"):
        RankProgram.from_text(text.replace("from 0 tag 8", "from zero tag 8"))
    with pytest.raises(Exception, match="unknown op 'frob'"):
        RankProgram.from_text(text.replace("irecv(", "frob("))


@functools.lru_cache(maxsize=None)
def _gpt_split(stages: int) -> StagedModel:
    model, loss_fn, (x, y), _ = gpt(layers=4, batch=4)
    return split_model(model, loss_fn, ((x[:1],), (y[:1],)), num_stages=stages)


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("name", [n for n in GENERATORS])
def test_every_lowered_program_round_trips_through_text(name, pp):
    """Every schedule at pp 2 and 4 on the example GPT, each pass's output checked (values defined once, before
    use, never after a free): the printed programs parse back to the same programs."""
    sched = generate(name, pp, 2 * pp)
    staged = _gpt_split(sched.num_model_stages)
    for program in lower_all(sched, staged, check_each_pass=True):   # every pass's output checked
        text = program.to_text()
        back = RankProgram.from_text(text, graphs=program.graphs)
        assert back.ops == program.ops and back.to_text() == text
        assert back == program
        bare = RankProgram.from_text(text)   # without GraphModules: the same program but for gm
        assert bare.ops == program.ops and bare.to_text() == text
        assert all(g.gm is None for g in bare.graphs.values())


def test_a_rank_program_holds_no_schedule_and_no_staged_model():
    sched = generate("zbv", 2, 4)
    program = lower_all(sched, _gpt_split(4))[0]
    for f in dataclasses.fields(program):
        value = getattr(program, f.name)
        assert not isinstance(value, (Schedule, StagedModel)), f.name
    hints = typing.get_type_hints(RankProgram)
    assert not any("Schedule" in str(h) or "StagedModel" in str(h) for h in hints.values())
    emit_fx(RankProgram.from_text(program.to_text(), graphs=program.graphs))   # emits from the program alone
