"""The vocabulary layers in a rank program: one RUN op per sharded action, with its collectives.

build_compute makes one RUN op per sharded action (`vocab_run`: S, T, IF, IB, every rank its own shard); the
pass `insert_collectives`, first of the lowering for a schedule with sharded actions, adds the collectives
around them. Every rank posts the same collectives in the same order (the schedule's sharded sequence is the same on
every rank; Schedule.validate), numbered by `seq`:

    [0IF3] v.mb3.vocab:part = vocab_if(param:wte, vocab:offset, mb3.data:0)
    h:c7 = collective(v.mb3.vocab:part; reduce root 0 seq 7 [2, 8, 64] float32)
    ...                                        (on rank 0, where stage 0 runs:)
    v.mb3.vocab:emb = wait_coll(h:c7)          right before [0F3] reads it as act:vocab.emb

    h:c8 = collective(s1.mb3.act:vocab.x; broadcast root 1 seq 8 [16, 64] float32)   (no input off the root)
    v.mb3.vocab:x = wait_coll(h:c8)
    [0S3] v.mb3.vocab:stats, v.mb3.vocab:saved:0, v.mb3.vocab:saved:1 = vocab_s(param:wte, v.mb3.vocab:x, ...)
    h:c9 = collective(v.mb3.vocab:stats; all_gather root -1 seq 9 [16, 3] float32)
    ...
    v.mb3.vocab:gathered = wait_coll(h:c9)     right before T
    [0T3] v.mb3.grad:param:wte, v.mb3.vocab:dx, v.mb3.loss = vocab_t(...)
    h:c10 = collective(v.mb3.vocab:dx; reduce root 1 seq 10 [16, 64] float32)
    v.mb3.vocab:gx = wait_coll(h:c10)          on rank 1, right before [1B3] reads it as grad:act:vocab.x

    h:c11 = collective(s0.mb3.grad:act:vocab.emb; broadcast root 0 seq 11 [2, 8, 64] float32)
    v.mb3.vocab:demb = wait_coll(h:c11)
    [0IB3] vi.mb3.grad:param:wte = vocab_ib(v.mb3.vocab:demb, vocab:offset, mb3.data:0)

A forward returning the model's logits (VocabLayers.whole) reads the output layer whole: every rank first posts
one all-gather of its rows per such parameter,

    h:c0 = collective(param:wte.weight; all_gather root -1 seq 0 [32, 64] float32)    # the whole parameter
    ...                                        (on the last stage's rank, right before its first F:)
    vocab:whole:wte.weight = wait_coll(h:c0)

and a rank that does not read it waits at once, keeping nothing.

A wait goes right before the first op that reads its result; a wait whose result this rank does not get (a
reduce off its root) goes before the rank's next sharded action, so at most one such collective is in flight.
"""

from __future__ import annotations

from typing import Sequence

from zbcompile.errors import LoweringError
from zbcompile.ir.names import VOCAB_EMB, VOCAB_WHOLE, VOCAB_X, Role, is_vocab_boundary, key_of, role_of
from zbcompile.ir.program import ProgramGraph, RankProgram
from zbcompile.ir.program.ops import Coll, CollArgs, Op, OpKind, RunArgs, TensorType
from zbcompile.ir.program.values import GRAD_LOSS, VOCAB_OFFSET, data_value, handle, stage_value, vocab_value
from zbcompile.ir.schedule import KIND_SPECS, Action, Kind, Schedule
from zbcompile.ir.stages import VocabLayers

__all__ = ["insert_collectives", "check_vocab", "vocab_run", "vocab_input", "reports_loss", "VOCAB_GRAPHS"]

VOCAB_GRAPHS = {Kind.IF: "if", Kind.S: "s", Kind.T: "t", Kind.IB: "ib"}

# the program values the stage graphs read in place of a neighbour's boundary tensor
_SUMMED_EMB, _SUMMED_GRAD = "vocab:emb", "vocab:gx"


def vocab_input(name: str, microbatch: int) -> str | None:
    """The value a first / last stage graph reads for a vocabulary boundary, or for a vocabulary parameter
    gathered whole (one value for the whole step); None for other names."""
    if name.startswith(VOCAB_WHOLE):
        return name
    if not is_vocab_boundary(name):
        return None
    if name == VOCAB_EMB:
        return vocab_value(microbatch, _SUMMED_EMB)
    if name == "grad:" + VOCAB_X:
        return vocab_value(microbatch, _SUMMED_GRAD)
    raise LoweringError(f"stage graph input {name!r}: a vocabulary boundary only a first stage (act:vocab.emb) "
                        f"or a last stage (grad:act:vocab.x) reads")


def check_vocab(schedule: Schedule, vocab: VocabLayers | None) -> VocabLayers:
    """The vocabulary layers a schedule with sharded actions lowers against; LoweringError if they do not fit."""
    if vocab is None:
        raise LoweringError(f"schedule {schedule.name!r} has vocabulary actions (S, T, IF, IB) but the model "
                            "was split without vocabulary parallelism; split with vocab_shards=p "
                            "(zb.compile(..., vocab_parallel=True))")
    if vocab.shards != schedule.num_ranks:
        raise LoweringError(f"the vocabulary is split into {vocab.shards} shards but schedule "
                            f"{schedule.name!r} has {schedule.num_ranks} ranks; split with "
                            f"vocab_shards={schedule.num_ranks}")
    return vocab


def vocab_run(vocab: VocabLayers, action: Action, graphs: dict[str, ProgramGraph]) -> Op:
    """The RUN op of sharded `action` (this rank's shard), its graph added to `graphs` (build_compute)."""
    kind, _, mb = action
    key = "vocab_" + VOCAB_GRAPHS[kind]
    g = vocab.graphs[VOCAB_GRAPHS[kind]]
    if key not in graphs:
        graphs[key] = ProgramGraph(g.gm, g.inputs, g.outputs, types=_output_types(g))
    ins = tuple(_input(name, mb) for name in g.inputs)
    outs = tuple(vocab_value(mb, name, input_layer=kind is Kind.IB) for name in g.outputs)
    return Op(OpKind.RUN, ins, outs, RunArgs(action, key))


def _input(name: str, mb: int) -> str:
    role = role_of(name)
    if name == VOCAB_OFFSET or role is Role.PARAM:
        return name
    if role is Role.DATA:
        return data_value(mb, int(key_of(name)))
    if role is Role.GRAD_LOSS:
        return GRAD_LOSS
    if role is Role.VOCAB:
        return vocab_value(mb, name)
    raise LoweringError(f"vocabulary graph input {name!r} has no known meaning")


def insert_collectives(schedule: Schedule, vocab: VocabLayers | None):
    """The cross-rank pass adding the vocabulary layers' collectives and their waits around every rank's
    sharded RUN ops (see the module docstring). Every rank posts the same sequence, numbered alike."""
    check_vocab(schedule, vocab)

    def insert_collectives(programs: Sequence[RankProgram]) -> tuple[RankProgram, ...]:
        return tuple(_Collectives(schedule, vocab, p.rank).rewrite(p) for p in programs)
    return insert_collectives


class _Collectives:
    """One rank's sharded actions, in order, with their collectives and deferred waits."""

    def __init__(self, schedule: Schedule, vocab: VocabLayers, rank: int):
        self.schedule, self.vocab, self.rank = schedule, vocab, rank
        self.seq = 0
        self.pending: list[Op] = []   # waits not placed yet

    def rewrite(self, program: RankProgram) -> RankProgram:
        """The program with every collective posted after (S, IB: before) its action, and each wait before
        the first op reading its result; waits still pending go before the loss sum, or last."""
        ops: list[Op] = self._gather_whole(program)
        program = _with_inputs(program, [op.ins[0] for op in ops if op.kind is OpKind.COLLECTIVE])
        for op in program.ops:
            if op.kind is OpKind.ADD_LOSS:
                ops += self.finish()
                ops.append(op)
            elif op.kind is OpKind.RUN and KIND_SPECS[op.args.action.kind].sharded:
                ops += self.action(op)
            elif op.kind is OpKind.RUN:
                ops += self._before_reads([op])
            else:
                ops.append(op)
        return program.replace(ops=tuple(ops + self.finish()))

    # ---- the ops of one action ------------------------------------------------------------------------
    def action(self, run: Op) -> list[Op]:
        """The ops of a sharded action's RUN op, after the waits due before it."""
        kind, _, mb = run.args.action
        ops = self._flush_resultless()
        sched = self.schedule
        first, last = sched.placement[sched.first_of(mb)], sched.placement[sched.last_of(mb)]
        if kind is Kind.S:
            ops += self._post(Coll.BROADCAST, last, mb, stage_value(sched.last_of(mb), mb, VOCAB_X), "vocab:x",
                              self.vocab.x.shape, self.vocab.x.dtype, now=True)
        elif kind is Kind.IB:
            ops += self._post(Coll.BROADCAST, first, mb, stage_value(sched.first_of(mb), mb, "grad:" + VOCAB_EMB),
                              "vocab:demb", self.vocab.emb.shape, self.vocab.emb.dtype, now=True)
        ops += self._before_reads([run])
        if kind is Kind.IF:
            ops += self._post(Coll.REDUCE, first, mb, vocab_value(mb, "vocab:part"), _SUMMED_EMB,
                              self.vocab.emb.shape, self.vocab.emb.dtype)
        elif kind is Kind.S:
            ops += self._post(Coll.ALL_GATHER, -1, mb, vocab_value(mb, "vocab:stats"), "vocab:gathered",
                              self.vocab.stats.shape, self.vocab.stats.dtype)
        elif kind is Kind.T and vocab_value(mb, "vocab:dx") in run.outs:   # not in a forward-only step's T
            ops += self._post(Coll.REDUCE, last, mb, vocab_value(mb, "vocab:dx"), _SUMMED_GRAD,
                              self.vocab.x.shape, self.vocab.x.dtype)
        return ops

    def _gather_whole(self, program: RankProgram) -> list[Op]:
        """The all-gathers of the vocabulary parameters read whole (VocabLayers.whole: a forward returning the
        logits), first on every rank; a rank that does not read one waits for it at once and keeps nothing."""
        reads = {v for op in program.ops for v in op.ins}
        ops = []
        for spec in self.vocab.whole:
            h = handle(f"c{self.seq}")
            args = CollArgs(Coll.ALL_GATHER, -1, self.seq, TensorType(tuple(spec.shape), spec.dtype))
            self.seq += 1
            ops.append(Op(OpKind.COLLECTIVE, ("param:" + spec.name.removeprefix(VOCAB_WHOLE),), (h,), args,
                          note="the whole parameter"))
            wait = Op(OpKind.WAIT_COLL, (h,), (spec.name,) if spec.name in reads else ())
            if wait.outs:
                self.pending.append(wait)
            else:
                ops.append(wait)
        return ops

    def finish(self) -> list[Op]:
        """Every wait still pending."""
        ops, self.pending = self.pending, []
        return ops

    def _post(self, op: Coll, root: int, mb: int, source: str, result: str, shape, dtype,
              now: bool = False) -> list[Op]:
        """Post one collective; its wait goes to `pending` (or right after it with `now`)."""
        sends = op is not Coll.BROADCAST or root == self.rank
        gets = op is not Coll.REDUCE or root == self.rank
        h = handle(f"c{self.seq}")
        args = CollArgs(op, root, self.seq, TensorType(tuple(shape), dtype))
        self.seq += 1
        post = Op(OpKind.COLLECTIVE, (source,) if sends else (), (h,), args, note=f"microbatch {mb}")
        wait = Op(OpKind.WAIT_COLL, (h,), (vocab_value(mb, result),) if gets else ())
        if now:
            return [post, wait]
        self.pending.append(wait)
        return [post]

    def _before_reads(self, ops: list[Op]) -> list[Op]:
        out = []
        for op in ops:
            reads = set(op.ins)
            due = [w for w in self.pending if w.outs and w.outs[0] in reads]
            self.pending = [w for w in self.pending if w not in due]
            out += due + [op]
        return out

    def _flush_resultless(self) -> list[Op]:
        due = [w for w in self.pending if not w.outs]
        self.pending = [w for w in self.pending if w.outs]
        return due


def _with_inputs(program: RankProgram, params: list[str]) -> RankProgram:
    """`program` taking `params` too (after its own parameters): a rank gathers its rows of a vocabulary
    parameter whole even where none of its actions reads them."""
    missing = [p for p in params if p not in program.inputs]
    if not missing:
        return program
    inputs = list(program.inputs)
    at = max((i + 1 for i, v in enumerate(inputs) if role_of(v) is Role.PARAM), default=0)
    return program.replace(inputs=tuple(inputs[:at] + missing + inputs[at:]))


def _output_types(g) -> tuple[TensorType | None, ...]:
    """Types of the gradient outputs (shards of parameters), read off the traced graph."""
    types = []
    for name, node in g.output_nodes().items():
        val = node.meta.get("val") if hasattr(node, "meta") else None
        types.append(TensorType(tuple(val.shape), val.dtype) if role_of(name) is Role.GRAD_PARAM and val is not None
                     else None)
    return tuple(types)


def reports_loss(action: Action) -> bool:
    """Whether sharded `action`'s `loss` output is the microbatch loss the program sums: every shard's T
    computes the same loss; shard 0's counts (the runtime adds every rank's sum)."""
    return action.kind is Kind.T and action.stage == 0
