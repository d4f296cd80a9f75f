"""An in-process stand-in for a ProcessGroup, so that all ranks' programs can run as threads of one process.

The CPU "null tier" of the runtime: every rank a thread, messages handed over in memory. It checks a lowering
end to end (P2P matching, gradient sums, buffer reuse) without starting processes, and lets `inspect`-style
tools run a schedule in one process. Only what RankRuntime uses: send / recv of single tensors by (source,
destination, tag), allgather, and the vocabulary layers' broadcast / reduce / allgather as posted collectives.
Sends are buffered (they complete at once); a receive takes the earliest unmatched message of its source and tag
(first come first served, as gloo matches them) and completes when that has arrived; a posted collective
completes when every rank has posted its k-th one (matched by order, as a real group does).

    world = LoopbackWorld(2)
    runtime, model_r = rank_runtime(world, programs, rank, emit_fx(programs[rank]), model, staged)  # its thread
"""

from __future__ import annotations

import copy
import threading
from collections import deque
from datetime import timedelta

import torch

from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["LoopbackWorld", "LoopbackGroup", "LoopbackCollectives", "rank_runtime"]


def _wire_copy(t):
    """A copy standing in for the data on the wire: a memory tracker on this thread must not count it (gloo and
    NCCL send straight from the tensor, into the receiver's own buffer)."""
    with _disable_current_modes():
        return t.clone()


class _Work:
    def __init__(self, event: threading.Event | None = None, after=None, keep=None, world=None):
        # keep: the sent tensor, held as long as the work is, as gloo's send work holds it
        self.event, self.after, self.keep, self.world = event, after, keep, world

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        if self.event is not None:
            seconds = timeout.total_seconds() or None
            if not self.event.wait(seconds):
                raise RuntimeError("loopback group: a wait timed out (a peer thread died or never sent)")
            if self.world is not None and self.world.aborted:
                raise RuntimeError("loopback group: the world was aborted (another rank failed)")
        if self.after is not None:
            self.after()
        return True


class LoopbackWorld:
    """Shared state of one fake world; `group(rank)` is that rank's ProcessGroup stand-in."""

    def __init__(self, size: int, timeout: float = 300.0):
        self.size = size
        self.timeout = timeout   # how long the untimed all-gather (gradient statistics) waits for its peers
        self.lock = threading.Lock()
        # per (source, destination, tag): the messages sent and not yet matched, and the posted receives still
        # waiting for one, each matched first come first served, as gloo matches them
        self.mail: dict[tuple[int, int, int], tuple[deque, deque]] = {}
        self.barrier = threading.Barrier(size)
        self.gathered: list = [None] * size
        self.posted = [0] * size                      # collectives each rank has posted
        self.collectives: dict[int, dict] = {}        # k -> the k-th collective's contributions
        self.aborted = False

    def abort(self) -> None:
        """Another rank failed: every pending and later wait raises instead of blocking (an untimed wait, as a
        capture-ready program makes, would block forever)."""
        with self.lock:
            self.aborted = True
            events = ([slot[0] for _, waiting in self.mail.values() for slot in waiting]
                      + [c["event"] for c in self.collectives.values()])
        for e in events:
            e.set()
        self.barrier.abort()

    def group(self, rank: int) -> "LoopbackGroup":
        return LoopbackGroup(self, rank)

    def collective_group(self, rank: int) -> "LoopbackCollectives":
        """Rank `rank`'s stand-in for the vocabulary layers' collective group (RankRuntime's `collectives`)."""
        return LoopbackCollectives(self, rank)


class LoopbackGroup:
    def __init__(self, world: LoopbackWorld, rank: int):
        self.world, self.rank_ = world, rank

    def rank(self) -> int:
        return self.rank_

    def size(self) -> int:
        return self.world.size

    def _queues(self, key) -> tuple[deque, deque]:
        return self.world.mail.setdefault(key, (deque(), deque()))

    def collective_group(self) -> "LoopbackCollectives":
        """This rank's group for posted collectives (zbcompile.distributed.collective_group asks for it)."""
        return self.world.collective_group(self.rank_)

    def send(self, tensors, dst: int, tag: int):
        value = _wire_copy(tensors[0])
        with self.world.lock:
            sent, waiting = self._queues((self.rank_, dst, tag))
            if waiting:   # the earliest posted receive takes it
                slot = waiting.popleft()
                slot[1] = value
                slot[0].set()
            else:
                sent.append(value)
        return _Work(keep=tensors[0])

    def recv(self, tensors, src: int, tag: int):
        slot = [threading.Event(), None]
        with self.world.lock:
            sent, waiting = self._queues((src, self.rank_, tag))
            if sent:   # the earliest message not yet taken
                slot[1] = sent.popleft()
                slot[0].set()
            else:
                waiting.append(slot)
            if self.world.aborted:
                slot[0].set()

        def fill():
            with _disable_current_modes():   # the wire writes the buffer, as gloo does, unseen by dispatch modes
                tensors[0].copy_(slot[1])

        return _Work(slot[0], fill, world=self.world)

    # ---- posted collectives (zbcompile.runtime.abi.collective) ------------------------------------------------
    def broadcast(self, tensors, options):
        root = options.rootRank
        return self._post(_wire_copy(tensors[0]) if self.rank_ == root else None,
                          lambda parts: tensors[0].copy_(parts[root]) if self.rank_ != root else None)

    def reduce(self, tensors, options):
        root = options.rootRank

        def land(parts):
            if self.rank_ == root:   # in rank order, like a reduction tree would not promise but tests want
                total = _wire_copy(parts[0])
                with _disable_current_modes():
                    for r in range(1, self.world.size):
                        total += parts[r]
                tensors[0].copy_(total)
        return self._post(_wire_copy(tensors[0]), land)

    def _post(self, part, land):
        world = self.world
        with world.lock:
            k = world.posted[self.rank_]
            world.posted[self.rank_] += 1
            slot = world.collectives.setdefault(k, {"parts": {}, "event": threading.Event(), "left": world.size})
            slot["parts"][self.rank_] = part
            if len(slot["parts"]) == world.size or world.aborted:
                slot["event"].set()

        def finish():
            with _disable_current_modes():   # the wire lands the result
                land(slot["parts"])
            with world.lock:
                slot["left"] -= 1
                if not slot["left"]:
                    world.collectives.pop(k, None)
        return _Work(slot["event"], finish, world=world)

    def allgather(self, outputs, inputs):
        self.world.gathered[self.rank_] = _wire_copy(inputs[0])
        self._meet()
        with _disable_current_modes():
            for out, val in zip(outputs[0], self.world.gathered):
                out.copy_(val)
        self._meet()
        return _Work()

    def _meet(self) -> None:
        """Every rank at the barrier, or RuntimeError after the world's timeout (a peer that failed before it
        joined leaves the others there, as a dead process leaves gloo's all-gather) or an abort."""
        try:
            self.world.barrier.wait(self.world.timeout)
        except threading.BrokenBarrierError:
            raise RuntimeError(f"loopback group: rank {self.rank_}'s all-gather ended without every peer (one "
                               f"failed, or did not join within {self.world.timeout:g} s)") from None


class LoopbackCollectives(LoopbackGroup):
    """The collective group: its allgather is posted (completes when every rank has posted), like the others."""

    def allgather(self, outputs, inputs):
        def land(parts):
            for out, r in zip(outputs[0], range(self.world.size)):
                out.copy_(parts[r])
        return self._post(_wire_copy(inputs[0]), land)


def rank_runtime(world: LoopbackWorld, programs, rank: int, gm, model, staged, *, device: str = "cpu",
                 timeout: float = 30.0, **options):
    """Rank `rank`'s RankRuntime on `world`, running `gm` (its emitted program) over a copy of `model` of its
    own, whose vocabulary parameters are cut to the rank's rows where the split shards them (as zb.compile's
    ranks hold them); returns (runtime, the copy). options: RankRuntime's (cuda_graphs, graph_api, warmup)."""
    from zbcompile.runtime.vocab_rows import shard_vocab_params
    from zbcompile.ir.program.values import VOCAB_OFFSET
    from zbcompile.runtime.eager import RankRuntime

    mine = copy.deepcopy(model)
    constants = {}
    if staged.vocab is not None:
        shard_vocab_params(mine, staged.vocab, rank, None, initialized_here=False, timeout=timeout)
        constants[VOCAB_OFFSET] = torch.tensor(rank * staged.vocab.rows, device=device)
    runtime = RankRuntime(programs[rank], gm, pg=world.group(rank), device=torch.device(device),
                          params=dict(mine.named_parameters()), buffers=dict(mine.named_buffers()), peers=programs,
                          timeout=timeout, constants=constants, collectives=world.collective_group(rank), **options)
    return runtime, mine
