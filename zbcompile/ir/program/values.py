"""Value names of the rank-program IR: one grammar, parsed once per name.

Values are named by strings that are *global* across ranks, so a value keeps its name when it crosses a rank
boundary (the receiver's receive defines the same name the sender's compute defined):

    s{stage}.mb{mb}.{local}     a value of one (stage, microbatch); `local` is a stage-IR name
                                (zbcompile.ir.stages): `s1.mb0.act:h`, `s1.mb0.saved:3`, `s2.mb0.grad:act:h`
    mb{mb}.data:{i}             the microbatch slice of the i-th flat user argument (a program input)
    v.mb{mb}.{local}            a value of the vocabulary layers for one microbatch on this rank's shard
                                (zbcompile.ir.stages.VocabLayers): `v.mb0.vocab:x`, `v.mb0.grad:param:wte.weight`;
                                `vi.mb{mb}.` for the input layer's gradient (IB), beside the head's (T)
    vocab:offset                the first vocabulary row of this rank's shard (a program input)
    vocab:whole:<fqn>           a vocabulary parameter all-gathered from every rank's rows, [shards, rows, ...],
                                for a forward returning the model's logits (one value for the whole step)
    param:{fqn} / buffer:{fqn}  the live Parameter / buffer (program inputs; canonical names)
    grad_loss                   the seed gradient 1 / num_microbatches (a program input)
    acc{k}.grad:param:{fqn}     the k-th running sum of a parameter's gradient on this rank
    r{q}.grad:param:{fqn}       rank q's sum of a shared parameter's gradient, received
    sum.grad:param:{fqn}        the total of a shared parameter's gradient over its holders
    dp.grad:param:{fqn}         a parameter's gradient averaged over the data-parallel replicas (sharded: this
                                replica's rows of it)
    zero.param:{fqn}            this replica's shard of a parameter (sharded data parallelism; a program input:
                                the Parameter, a DTensor)
    ag{k}.param:{fqn}           the whole parameter, gathered from the replicas' shards by the k-th gather
    loss                        the sum of this rank's microbatch losses (the program's output)
    re.s{stage}.mb{mb}.{local}  an offloaded stage value brought back from the host pool (passes/lower/offload.py):
                                a new name, since values are defined once; parses to the original's role, stage
                                and microbatch with scope "reload" and index 1: `re.s0.mb1.saved:3`
    re.re.s{stage}...           the same value offloaded and reloaded again (reloaded for B, then offloaded after
                                B until W): one `re.` per reload, index the count: `re.re.s0.mb1.saved:3`
    h:{...}                     a handle: a posted receive or batch of sends, a collective, or a host copy
                                (`h:off.s0.mb1.saved:3` an offload's, `h:re.s0.mb1.saved:3` a reload's;
                                `h:off.re.s0.mb1.saved:3` and `h:re.re.s0.mb1.saved:3` the second round's)

Names stay strings in the IR (cheap to hash, print and compare); `parse` turns one into a `Value` record
once and remembers it, so passes ask `parse(v).role is Role.SAVED` instead of testing string prefixes.
"""

from __future__ import annotations

from typing import NamedTuple

from zbcompile.ir.names import VOCAB_WHOLE, Role, key_of, role_of

__all__ = ["Role", "Value", "parse", "role_of", "key_of", "stage_value", "data_value", "acc_value", "handle",
           "vocab_value", "reloaded_value", "python_name", "GRAD_LOSS", "LOSS", "OUTPUTS", "VOCAB_OFFSET"]

GRAD_LOSS = "grad_loss"
LOSS = "loss"
OUTPUTS = "outputs"   # what a forward returning the model's outputs returns: every microbatch's out:<k>
VOCAB_OFFSET = "vocab:offset"
RELOADED = "re"   # the head of a reloaded value's name


class Value(NamedTuple):
    """A parsed value name. scope: "stage" (s{s}.mb{mb}.local), "vocab" (v.mb{mb}.local), "data", "state"
    (param:/buffer:), "shard" (vocab:offset), "whole" (vocab:whole:<fqn>), "acc", "copy" (r{q}.), "sum", "dp",
    "zero" (a parameter's data-parallel shard), "gather" (ag{k}.), "reload" (re.s{s}.mb{mb}.local,
    re.re.s{s}...), "handle", "seed" (grad_loss), "loss" or "other"; stage / microbatch / index are -1 where the
    scope has none (index: data argument, accumulation step, source rank, gather or how many times a reloaded
    value was reloaded)."""

    scope: str
    role: Role
    local: str
    stage: int = -1
    microbatch: int = -1
    index: int = -1

    @property
    def key(self) -> str:
        """The local name without its role prefix: `h` of `act:h`, the fqn of `grad:param:fqn`."""
        return self.local[len(self.role.value):]


_CACHE: dict[str, Value] = {}


def parse(vid: str) -> Value:
    """The record of value name `vid` (memoized: every pass asks about the same names many times)."""
    value = _CACHE.get(vid)
    if value is None:
        value = _CACHE[vid] = _parse(vid)
    return value


def _parse(vid: str) -> Value:
    if vid.startswith("h:"):
        return Value("handle", Role.HANDLE, vid)
    if vid == GRAD_LOSS:
        return Value("seed", Role.GRAD_LOSS, vid)
    if vid == LOSS:
        return Value("loss", Role.LOSS, vid)
    if vid == VOCAB_OFFSET:
        return Value("shard", Role.VOCAB, vid)
    if vid.startswith(VOCAB_WHOLE):
        return Value("whole", Role.VOCAB, vid)
    head, dot, rest = vid.partition(".")
    if dot and head[:1] == "s" and head[1:].isdigit():
        mb, dot2, local = rest.partition(".")
        if dot2 and mb[:2] == "mb" and mb[2:].isdigit() and local:
            return Value("stage", role_of(local), local, int(head[1:]), int(mb[2:]))
    if dot and head == RELOADED:
        inner = parse(rest)
        if inner.scope in ("stage", "reload"):
            return inner._replace(scope="reload", index=max(inner.index, 0) + 1)
    if dot and head in ("v", "vi"):
        mb, dot2, local = rest.partition(".")
        if dot2 and mb[:2] == "mb" and mb[2:].isdigit() and local:
            return Value("vocab", role_of(local), local, -1, int(mb[2:]))
    if dot and head[:2] == "mb" and head[2:].isdigit() and rest.startswith("data:") and rest[5:].isdigit():
        return Value("data", Role.DATA, rest, -1, int(head[2:]), int(rest[5:]))
    for scope, prefix in (("acc", "acc"), ("copy", "r"), ("gather", "ag")):
        if dot and head.startswith(prefix) and head[len(prefix):].isdigit():
            return Value(scope, role_of(rest), rest, index=int(head[len(prefix):]))
    if dot and head in ("sum", "dp", "zero"):
        return Value(head, role_of(rest), rest)
    role = role_of(vid)
    if role in (Role.PARAM, Role.BUFFER):
        return Value("state", role, vid)
    return Value("other", role, vid)


def stage_value(stage: int, microbatch: int, local: str) -> str:
    """The global name of value `local` of (stage, microbatch)."""
    return f"s{stage}.mb{microbatch}.{local}"


def vocab_value(microbatch: int, local: str, input_layer: bool = False) -> str:
    """The global name of the vocabulary layers' value `local` for `microbatch` (on each rank its own shard's);
    the input layer's backward (IB) names its outputs `vi.`, so that a tied table's two gradients differ."""
    return f"{'vi' if input_layer else 'v'}.mb{microbatch}.{local}"


def data_value(microbatch: int, index: int) -> str:
    return f"mb{microbatch}.data:{index}"


def acc_value(step: int, local: str) -> str:
    """The `step`-th running sum of gradient `local` (grad:param:fqn)."""
    return f"acc{step}.{local}"


def handle(what: str) -> str:
    return f"h:{what}"


def reloaded_value(vid: str) -> str:
    """The name of stage value `vid` once reloaded from the host pool: `s0.mb1.saved:3` -> `re.s0.mb1.saved:3`,
    and of a reloaded one reloaded again: `re.s0.mb1.saved:3` -> `re.re.s0.mb1.saved:3`."""
    return f"{RELOADED}.{vid}"


def python_name(vid: str) -> str:
    """A Python identifier for value `vid` in generated code (every non-alphanumeric character becomes _)."""
    return "".join(c if c.isalnum() else "_" for c in vid)
