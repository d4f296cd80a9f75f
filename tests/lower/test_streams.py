"""Deadlock freedom on device streams (NCCL), where a posted receive blocks everything behind it on its stream.

The event-graph check of passes/lower/streams.py: with one stream per direction of a peer pair (what the
runtime sets up) every schedule's programs are acyclic; with one stream per pair (a single process group)
the same programs have cycles, the deadlock the per-direction groups exist to avoid. The runtime's routing
of each message to its direction's group is checked against a recording stand-in group.
"""

from __future__ import annotations

import functools

import pytest
import torch

from support.models import gpt
from zbcompile.errors import LoweringError
from zbcompile.passes.lower import lower_all
from zbcompile.passes.lower.streams import check_streams, stream_cycle
from zbcompile.passes.schedules import GENERATORS, generate
from zbcompile.ir.program.ops import OpKind
from zbcompile.runtime.abi import StepContext, recv, send
from zbcompile.split import split_model


@functools.lru_cache(maxsize=None)
def _staged(stages: int):
    model, loss_fn, (x, y), _ = gpt(layers=4)
    return split_model(model, loss_fn, ((x[:1],), (y[:1],)), num_stages=stages)


def _programs(name: str, pp: int, m: int):
    sched = generate(name, pp, m)
    return lower_all(sched, _staged(sched.num_model_stages))


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("name", list(GENERATORS))
def test_every_schedule_is_deadlock_free_with_a_stream_per_direction(name, pp):
    programs = _programs(name, pp, 2 * pp)
    assert stream_cycle(programs, "directed") is None
    check_streams(programs)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1", "zbv"])
def test_one_stream_per_pair_deadlocks_and_the_error_shows_the_cycle(name):
    programs = _programs(name, 2, 4)
    cycle = stream_cycle(programs, "pair")
    assert cycle is not None and len(cycle) >= 2
    messages = [n for n in cycle if n[0] == "m"]
    # the cycle runs through both directions of the pair: that is what one shared stream cannot do
    assert {(n[1], n[2]) for n in messages} == {(0, 1), (1, 0)}
    with pytest.raises(LoweringError, match="deadlock on device streams") as err:
        check_streams(programs, "pair")
    assert "message 0 -> 1" in str(err.value) and "message 1 -> 0" in str(err.value)


def _run_streams(programs, channel: str) -> bool:
    """Reference: execute the stream model step by step and say whether every op finishes.

    The hosts post everything at once (device ops do not block the host). A compute op runs once the
    messages waited on since the previous compute op are done; a message is done once it heads both its
    sender's and its receiver's queue for its stream and each side's compute posted before it has run."""
    compute, queues, done_compute = {}, {}, {}
    for prog in programs:
        r, ops, waited, handles, posted = prog.rank, [], [], {}, 0
        for op in prog.ops:
            if op.kind in (OpKind.SEND, OpKind.RECV):
                keys = op.messages(r)
                handles[op.outs[0]] = keys
                for key in keys:
                    a, b = key[:2]
                    stream = (a, b) if channel == "directed" else (min(a, b), max(a, b))
                    queues.setdefault((r, stream), []).append((key, posted))
            elif op.kind in (OpKind.WAIT_SEND, OpKind.WAIT_RECV):
                waited += handles[op.ins[0]]
            elif op.kind is not OpKind.STAMP:
                ops.append(set(waited))
                waited, posted = [], posted + 1
        compute[r], done_compute[r] = ops, 0
    finished: set = set()
    progress = True
    while progress:
        progress = False
        for r, ops in compute.items():
            while done_compute[r] < len(ops) and ops[done_compute[r]] <= finished:
                done_compute[r] += 1
                progress = True
        heads = {}
        for (r, stream), q in queues.items():
            if q and done_compute[r] >= q[0][1]:
                heads.setdefault(q[0][0], []).append((r, stream))
        for key, where in heads.items():
            if len(where) == 2:
                for r, stream in where:
                    queues[(r, stream)].pop(0)
                finished.add(key)
                progress = True
    return all(done_compute[r] == len(ops) for r, ops in compute.items()) and not any(queues.values())


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("name", list(GENERATORS))
def test_cycle_check_agrees_with_executing_the_streams(name, pp):
    programs = _programs(name, pp, 2 * pp)
    for channel in ("directed", "pair"):
        assert (stream_cycle(programs, channel) is None) == _run_streams(programs, channel), channel


def test_a_send_posted_after_the_compute_that_needs_its_reply_is_a_stream_deadlock():
    """A post waits on its stream for the compute posted before it (NCCL's model). Rank 0's send of its
    activation moved after its own backward, which needs the gradient rank 1 makes from that activation: the
    programs cannot finish on device streams (the reference executor above), and the cycle check must say so,
    not only the host-side order check."""
    p0, p1 = _programs("1f1b", 2, 1)
    ops = list(p0.ops)
    send_op = ops.pop(next(i for i, op in enumerate(ops) if op.kind is OpKind.SEND))
    wait_op = ops.pop(next(i for i, op in enumerate(ops) if op.kind is OpKind.WAIT_SEND
                           and op.ins[0] == send_op.outs[0]))
    backward = next(i for i, op in enumerate(ops) if op.kind is OpKind.RUN and op.action.kind.name in ("B", "BW"))
    ops[backward + 1:backward + 1] = [send_op, wait_op]
    programs = (p0.replace(ops=tuple(ops)), p1)
    assert not _run_streams(programs, "directed")
    assert stream_cycle(programs, "directed") is not None


class _Recorder:
    def __init__(self, name):
        self.name, self.calls = name, []

    def send(self, tensors, peer, tag):
        self.calls.append(("send", peer, tag))
        return None

    def recv(self, tensors, peer, tag):
        self.calls.append(("recv", peer, tag))
        return None


def test_runtime_routes_each_direction_to_its_own_group():
    up, down = _Recorder("up"), _Recorder("down")
    ctx = StepContext(None, 1, torch.device("cpu"), 5.0, 0, ranks=3, channels=(up, down))
    t = torch.zeros(2)
    send(ctx, (2,), (7,), "to rank 2", t)      # 1 -> 2: up
    send(ctx, (0,), (8,), "to rank 0", t)      # 1 -> 0: down
    recv(ctx, 0, 9, (2,), torch.float32, "from rank 0")   # 0 -> 1: up
    recv(ctx, 2, 10, (2,), torch.float32, "from rank 2")  # 2 -> 1: down
    assert up.calls == [("send", 2, 7), ("recv", 0, 9)]
    assert down.calls == [("send", 0, 8), ("recv", 2, 10)]


def test_programs_post_both_directions_to_one_peer():
    """The case the groups are for: at pp=2 every rank both sends to and receives from its peer."""
    for prog in _programs("1f1b", 2, 4):
        kinds = {op.kind for op in prog.ops if op.kind in (OpKind.SEND, OpKind.RECV)}
        assert kinds == {OpKind.SEND, OpKind.RECV}
