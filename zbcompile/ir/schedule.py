"""The schedule IR: what each rank computes, in which order.

Glossary
    rank        one process / GPU of the pipeline.
    stage       one cut of the model, placed on exactly one rank. A rank holds one stage (1F1B, ZB-H*),
                `chunks` stages in a loop (interleaved 1F1B) or two stages in a V (ZB-V, V-*, DualPipeV).
    pipeline    the sequence of stages one microbatch travels. Every schedule has one, except DualPipe,
                which has two mirrored pipelines over the same ranks (the first half of the microbatches
                flows rank 0 -> p-1 through stages 0..p-1, the second half p-1 -> 0 through stages p..2p-1;
                stage s and s+p compute the same model cut, on mirrored ranks).
    microbatch  a slice of the batch; numbered 0..m-1 across the whole schedule.

An action is (kind, stage, microbatch). Its text form is `{stage}{kind}{microbatch}`, e.g. `2F0`, `0B3`,
`1W3`, `0BW2`; the kinds and what each means, needs, costs and holds are one table, `KIND_SPECS`. A step of a
rank may also be an `Overlap` of actions run together, `(2F3;1B1)` (DualPipe's overlapped F&B). A schedule is a
frozen record: the stage -> rank placement plus, per rank, the ordered tuple of actions that rank runs. Schedules
are plain data built from integers; the simulator times them, the lowering turns them into programs, and they
round-trip through text and through torch.distributed.pipelining's compute-only CSV (where torch's `I` is our B
and torch's `B` is our BW).
"""

from __future__ import annotations

import csv
import io
import re
from dataclasses import dataclass
from typing import Iterable, Sequence

from zbcompile.ir.actions import (CELL_FORMS, COST_KEYS, KIND_SPECS, SHARDED_KINDS, VOCAB_COST_KEYS, Action, DepContext,
                                  Kind, KindSpec, MemoryRates, Overlap, _expand, parse_step)
from zbcompile.errors import ScheduleError

# The action IR (kinds, their specs, actions, overlapped steps) lives in `zbcompile.ir.actions`; it is re-exported
# here so that one import gives the whole schedule IR.
__all__ = ["Kind", "KindSpec", "DepContext", "MemoryRates", "KIND_SPECS", "COST_KEYS", "VOCAB_COST_KEYS",
           "SHARDED_KINDS", "CELL_FORMS", "Action", "Overlap", "parse_step", "Schedule", "build", "loop_placement",
           "v_placement", "dual_placement"]


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def loop_placement(num_ranks: int, chunks: int = 1) -> tuple[int, ...]:
    """Stage s on rank s % p: one stage per rank for chunks=1, interleaved loops otherwise."""
    return tuple(s % num_ranks for s in range(num_ranks * chunks))


def v_placement(num_ranks: int) -> tuple[int, ...]:
    """2p stages in a V: rank r holds stage r (going down) and stage 2p-1-r (coming back)."""
    return tuple(range(num_ranks)) + tuple(reversed(range(num_ranks)))


def dual_placement(num_ranks: int) -> tuple[int, ...]:
    """DualPipe: pipeline 0 is stages 0..p-1 on ranks 0..p-1; pipeline 1 is stages p..2p-1 on ranks p-1..0."""
    return v_placement(num_ranks)


@dataclass(frozen=True)
class Schedule:
    """Per-rank ordered action lists plus the stage -> rank placement.

    Invariants (checked by `validate`): every action sits on the rank that holds its stage; every
    (stage, microbatch) on the microbatch's pipeline has exactly one F and either one BW or one B and
    one W; nothing else appears. With vocabulary parallelism (any sharded action) every rank r also runs
    rS, rT, rIF and rIB once for every microbatch, and all ranks run these in the same (kind, microbatch)
    sequence, since each joins a collective. Dependencies and deadlock freedom are checked by `check_order`.
    """

    name: str
    num_microbatches: int
    placement: tuple[int, ...]
    ranks: tuple[tuple[Action, ...], ...]  # an entry may be an Overlap in schedules read from text or CSV
    pipelines: int = 1

    # ---- derived structure -------------------------------------------------------------------
    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    @property
    def num_stages(self) -> int:
        return len(self.placement)

    @property
    def num_model_stages(self) -> int:
        """How many distinct model cuts there are (DualPipe holds each cut twice)."""
        return self.num_stages // self.pipelines

    def model_stage(self, stage: int) -> int:
        """The model cut that `stage` computes (stage itself, except in DualPipe's mirrored pipeline)."""
        return stage % self.num_model_stages

    def stage_ranks(self) -> list[set[int]]:
        """Per model stage, the ranks that run it (two for DualPipe's mirrored stages, one otherwise)."""
        out: list[set[int]] = [set() for _ in range(self.num_model_stages)]
        for s, r in enumerate(self.placement):
            out[self.model_stage(s)].add(r)
        return out

    def stage_groups(self) -> tuple[int, ...]:
        """Per model stage, a group id for balancing the split: the set of ranks running it. Most schedules run
        each model stage on one rank; DualPipe runs stage m on ranks m and p-1-m (half the microbatches each),
        so m and p-1-m share one group, whose summed weight is then the load of both ranks."""
        ids: dict[frozenset[int], int] = {}
        return tuple(ids.setdefault(frozenset(h), len(ids)) for h in self.stage_ranks())

    def pipeline_of(self, microbatch: int) -> int:
        """DualPipe feeds the first half of the microbatches to pipeline 0 and the rest to pipeline 1."""
        return microbatch * self.pipelines // self.num_microbatches

    def path(self, microbatch: int) -> range:
        """The stages `microbatch` visits, in forward order."""
        first = self.pipeline_of(microbatch) * self.num_model_stages
        return range(first, first + self.num_model_stages)

    def is_first(self, stage: int) -> bool:
        return stage % self.num_model_stages == 0

    def is_last(self, stage: int) -> bool:
        return stage % self.num_model_stages == self.num_model_stages - 1

    def first_of(self, microbatch: int) -> int:
        return self.pipeline_of(microbatch) * self.num_model_stages

    def last_of(self, microbatch: int) -> int:
        return self.first_of(microbatch) + self.num_model_stages - 1

    @property
    def vocab_shards(self) -> int:
        """Vocabulary shards (one per rank) when the schedule holds sharded actions (S, T, IF, IB), else 0."""
        found = self.__dict__.get("_vocab_shards")
        if found is None:
            found = self.num_ranks if any(KIND_SPECS[a.kind].sharded for row in self.ranks for a in _expand(row)) else 0
            object.__setattr__(self, "_vocab_shards", found)
        return found

    def microbatches_of(self, stage: int) -> range:
        """The microbatches that pass through `stage`."""
        pipe = stage // self.num_model_stages
        m, k = self.num_microbatches, self.pipelines
        return range(-(-pipe * m // k), -(-(pipe + 1) * m // k))

    def deps(self, action: Action) -> tuple[Action, ...]:
        """The actions whose results `action` consumes, by its kind's rule in KIND_SPECS (F needs the
        previous stage's F; B and BW their own F and the next stage's B, or its BW when fused; W its B)."""
        kind, s, mb = action
        return KIND_SPECS[kind].deps(self, s, mb)

    def backward_of(self, stage: int, microbatch: int) -> Action:
        """The action that computes `stage`'s input gradient for `microbatch`: its B, or its BW if fused."""
        return Action(self._backward_kind(stage, microbatch), stage, microbatch)

    def _backward_kind(self, stage: int, microbatch: int) -> Kind:
        cache = self.__dict__.get("_bkind")
        if cache is None:
            cache = {(a.stage, a.microbatch): a.kind for r in self.ranks for a in _expand(r)
                     if a.kind in (Kind.B, Kind.BW)}
            object.__setattr__(self, "_bkind", cache)
        return cache.get((stage, microbatch), Kind.B)

    def actions(self) -> Iterable[tuple[int, int, Action]]:
        """Every (rank, position, action)."""
        for r, row in enumerate(self.ranks):
            for i, a in enumerate(row):
                yield r, i, a

    @property
    def has_overlaps(self) -> bool:
        """Whether some step is an `Overlap` (only schedules read from text or CSV that hold one)."""
        return any(type(a) is Overlap for row in self.ranks for a in row)

    def flatten(self) -> Schedule:
        """The sequential form: every Overlap replaced by its sub-actions in order (self if there is none)."""
        if not self.has_overlaps:
            return self
        return Schedule(self.name, self.num_microbatches, self.placement,
                        tuple(tuple(_expand(row)) for row in self.ranks), self.pipelines)

    def forward_only(self, loss: bool = True, microbatches: int | None = None) -> Schedule:
        """The forward actions of `flatten()` (F; with vocabulary parallelism IF, S and T too: KindSpec.forward),
        in each rank's order: an evaluation step's schedule (forward-only programs, no backward). Their
        dependencies are among themselves and those of this schedule, and every rank drops the same sharded
        actions (IB), so a schedule that runs without deadlock keeps running without one. loss=False (a step
        returning the model's outputs): without the kinds that only compute the loss (S, T). Not for `validate`
        (its cells have no backward by design).
        microbatches: for another number of microbatches than this schedule's (an evaluation batch of another
        size), the same kinds over the same placement in wave order (`_forward_waves`)."""
        keep = {k for k, spec in KIND_SPECS.items() if spec.forward and (loss or not spec.loss_only)}
        if microbatches is not None and microbatches != self.num_microbatches:
            keep &= {a.kind for row in self.flatten().ranks for a in row}
            return self._forward_waves(keep, microbatches)
        rows = tuple(tuple(a for a in row if a.kind in keep) for row in self.flatten().ranks)
        return Schedule(f"{self.name}/forward", self.num_microbatches, self.placement, rows, self.pipelines)

    def _forward_waves(self, keep: set[Kind], m: int) -> Schedule:
        """`keep`'s forward kinds for m microbatches over this placement, each rank in wave order: microbatch j
        at its k-th stage in wave j + k (j counted from the first microbatch of its pipeline), a sharded
        embedding lookup (IF) one wave before its first stage, the sharded loss (S, then T) one wave after its
        last. Every rank runs its part of one global order (by wave, then kind, then microbatch) that the
        dependencies follow, and every rank meets the sharded actions in the same sequence, so it runs without
        deadlock for any m: it fills the pipeline as GPipe's forward does."""
        if m < 1:
            raise ScheduleError(f"schedule {self.name!r}: an evaluation step needs at least 1 microbatch, got {m}")
        shape = Schedule(f"{self.name}/forward", m, self.placement, tuple(() for _ in self.ranks), self.pipelines)
        starts = {shape.pipeline_of(j): j for j in reversed(range(m))}   # each pipeline's first microbatch
        keyed: list[tuple[tuple[int, int, int, int], int, Action]] = []
        for j in range(m):
            wave, path = j - starts[shape.pipeline_of(j)], shape.path(j)
            keyed += [((wave + k, 1, j, s), self.placement[s], Action(Kind.F, s, j)) for k, s in enumerate(path)]
            for kind, at, order in ((Kind.IF, -1, 0), (Kind.S, len(path), 2), (Kind.T, len(path), 3)):
                if kind in keep:
                    keyed += [((wave + at, order, j, r), r, Action(kind, r, j)) for r in range(self.num_ranks)]
        rows: list[list[Action]] = [[] for _ in self.ranks]
        for _, rank, action in sorted(keyed):
            rows[rank].append(action)
        return Schedule(shape.name, m, self.placement, tuple(map(tuple, rows)), self.pipelines)

    # ---- checks -------------------------------------------------------------------------------
    def validate(self) -> Schedule:
        """Check the structural invariants (of `flatten()`); returns self so calls chain. Raises ScheduleError."""
        if self.has_overlaps:
            self.flatten().validate()
            return self
        p, n = self.num_ranks, self.num_stages
        if self.num_microbatches < 1:
            raise ScheduleError(f"schedule {self.name!r}: needs at least 1 microbatch, got {self.num_microbatches}")
        if not isinstance(self.pipelines, int) or self.pipelines < 1:
            raise ScheduleError(f"schedule {self.name!r}: pipelines must be an int >= 1 (1, or 2 for DualPipe's "
                                f"mirrored pair), got {self.pipelines!r}")
        if n % self.pipelines:
            raise ScheduleError(f"schedule {self.name!r}: {n} stages do not split into {self.pipelines} pipelines")
        if sorted(set(self.placement)) != list(range(p)):
            raise ScheduleError(
                f"schedule {self.name!r}: placement {list(self.placement)} must use every rank 0..{p - 1}"
            )
        seen: dict[Action, tuple[int, int]] = {}
        kinds: dict[tuple[int, int], set[Kind]] = {}
        for r, i, a in self.actions():
            if a in seen:
                raise ScheduleError(self.at(r, i, f"{a} appears twice (first at rank {seen[a][0]}, "
                                                      f"step {seen[a][1]})"))
            seen[a] = (r, i)
            if KIND_SPECS[a.kind].sharded:
                self._check_shard(r, i, a)
                continue
            if not 0 <= a.stage < n:
                raise ScheduleError(self.at(r, i, f"stage {a.stage} does not exist (stages 0..{n - 1})"))
            if self.placement[a.stage] != r:
                raise ScheduleError(self.at(
                    r, i, f"{a} runs on rank {r} but stage {a.stage} is placed on rank {self.placement[a.stage]}"))
            if a.microbatch not in self.microbatches_of(a.stage):
                raise ScheduleError(self.at(r, i, f"microbatch {a.microbatch} never visits stage {a.stage}"))
            kinds.setdefault((a.stage, a.microbatch), set()).add(a.kind)
        for s in range(n):
            for mb in self.microbatches_of(s):
                self._check_cell(kinds.get((s, mb), set()), s, mb)
        if self.vocab_shards:
            self._check_sharded_complete(seen)
            self._check_sharded_order()
        return self

    def _check_shard(self, r: int, i: int, a: Action) -> None:
        """A sharded action runs on its own shard's rank, for a microbatch that exists."""
        if a.stage != r:
            raise ScheduleError(self.at(
                r, i, f"{a} is vocabulary shard {a.stage}'s {a.kind.name}, but rank {r} holds shard {r} (a sharded "
                      f"action's stage field is its shard, which is the rank that runs it); fix: write "
                      f"{Action(a.kind, r, a.microbatch)} here, or move {a} to rank {a.stage}"))
        if not 0 <= a.microbatch < self.num_microbatches:
            raise ScheduleError(self.at(r, i, f"microbatch {a.microbatch} does not exist (microbatches "
                                              f"0..{self.num_microbatches - 1})"))

    def _check_sharded_complete(self, seen: dict[Action, tuple[int, int]]) -> None:
        """Every rank runs every sharded kind once for every microbatch: each one joins a collective over
        all ranks, which waits forever for a rank that never comes."""
        missing = [Action(kind, r, mb) for r in range(self.num_ranks) for kind in SHARDED_KINDS
                   for mb in range(self.num_microbatches) if Action(kind, r, mb) not in seen]
        if missing:
            shown = ", ".join(map(str, missing[:8])) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise ScheduleError(
                f"schedule {self.name!r}: vocabulary parallelism needs every rank to run "
                f"{', '.join(k.name for k in SHARDED_KINDS)} on its shard for every microbatch (each joins a "
                f"collective over all ranks); missing: {shown}\n{self.format_grid()}\n"
                f"fix: add them, e.g. with passes.schedules.vocab.insert_vocab on the schedule without them")

    def _check_sharded_order(self) -> None:
        """Every rank runs its sharded actions in the same (kind, microbatch) sequence: each joins a
        collective over all ranks, and collectives entered in different orders pair the wrong tensors or hang."""
        steps = [[(i, a) for i, a in enumerate(row) if KIND_SPECS[a.kind].sharded] for row in self.ranks]
        keys = [[(a.kind, a.microbatch) for _, a in row] for row in steps]
        for r in range(1, self.num_ranks):
            if keys[r] == keys[0]:
                continue
            j = next(j for j, (x, y) in enumerate(zip(keys[0], keys[r])) if x != y)
            around = range(max(0, j - 3), j + 4)
            seq = {q: " ".join(("[" + str(steps[q][k][1]) + "]") if k == j else str(steps[q][k][1])
                               for k in around if k < len(steps[q])) for q in (0, r)}
            raise ScheduleError(
                f"schedule {self.name!r}: ranks 0 and {r} run their sharded actions in different orders: the "
                f"{_ordinal(j + 1)} is {steps[0][j][1]} on rank 0 but {steps[r][j][1]} on rank {r}\n"
                f"  rank 0 sharded steps: {seq[0]}\n  rank {r} sharded steps: {seq[r]}\n"
                f"{self.format_grid(mark={0: steps[0][j][0], r: steps[r][j][0]})}\n"
                f"each sharded action joins a collective over all ranks, and every rank must join them in the same "
                f"order; fix: order the sharded (kind, microbatch) sequence the same on every rank")

    def _check_cell(self, has: set[Kind], s: int, mb: int) -> None:
        has = {k for k in has if KIND_SPECS[k].in_cell}
        if Kind.F not in has:
            raise ScheduleError(f"schedule {self.name!r}: {Action(Kind.F, s, mb)} is missing\n{self.format_grid()}")
        if has in CELL_FORMS:
            return
        missing = "a B and a W, or one BW" if Kind.BW not in has else "not both BW and B/W"
        raise ScheduleError(
            f"schedule {self.name!r}: stage {s}, microbatch {mb} has {sorted(k.value for k in has)}; "
            f"it needs F plus {missing}\n{self.format_grid()}"
        )

    def check_order(self) -> Schedule:
        """Run the schedule by dependencies alone (no costs): raises ScheduleError on a deadlock, showing
        the rank x step grid with each rank's stuck action in brackets. Overlaps run as `flatten()` does."""
        if self.has_overlaps:
            self.flatten().check_order()
            return self
        done: set[Action] = set()
        pos = [0] * self.num_ranks
        progressed = True
        while progressed:
            progressed = False
            for r, row in enumerate(self.ranks):
                while pos[r] < len(row) and all(d in done for d in self.deps(row[pos[r]])):
                    done.add(row[pos[r]])
                    pos[r] += 1
                    progressed = True
        if all(pos[r] == len(row) for r, row in enumerate(self.ranks)):
            return self
        raise ScheduleError(self.describe_deadlock(pos, done))

    def describe_deadlock(self, pos: Sequence[int], done: set[Action]) -> str:
        """What each stuck rank waits for, and the grid with the stuck actions in brackets.

        pos: each rank's next (unrun) step; done: the actions that have run."""
        stuck = {r: pos[r] for r in range(self.num_ranks) if pos[r] < len(self.ranks[r])}
        waits = "; ".join(
            f"rank {r} waits at {self.ranks[r][i]} for "
            + ", ".join(str(d) for d in self.deps(self.ranks[r][i]) if d not in done)
            for r, i in stuck.items()
        )
        return (f"schedule {self.name!r} deadlocks: {waits}\n{self.format_grid(mark=stuck)}\n"
                f"fix: reorder so that every action's inputs are produced earlier on some rank")

    def at(self, rank: int, step: int, what: str) -> str:
        """An error message about one step of one rank, with the grid around it."""
        return f"schedule {self.name!r}, rank {rank}, step {step}: {what}\n{self.format_grid(mark={rank: step})}"

    # ---- text forms ---------------------------------------------------------------------------
    def format_grid(self, mark: dict[int, int] | None = None, window: int = 12) -> str:
        """A rank x step grid of action strings; `mark` brackets one step per rank and centres the view."""
        mark = mark or {}
        centre = min(mark.values()) if mark else 0
        lo = max(0, centre - window // 2)
        hi = lo + window
        width = max((len(str(a)) for _, _, a in self.actions()), default=3) + 2
        head = "        " + "".join(f"{i:>{width}}" for i in range(lo, hi))
        lines = [head]
        for r, row in enumerate(self.ranks):
            cells = []
            for i in range(lo, min(hi, len(row))):
                text = str(row[i])
                cells.append(f"[{text}]" if mark.get(r) == i else text)
            more = " ..." if len(row) > hi else ""
            lines.append(f"rank {r:>2} " + "".join(f"{c:>{width}}" for c in cells) + more)
        return "\n".join(lines)

    def to_text(self) -> str:
        """One header line, then one line per rank: `rank 0: 0F0 0F1 0B0 ...`."""
        head = (f"# zbcompile schedule {self.name}: microbatches={self.num_microbatches} "
                f"placement={','.join(map(str, self.placement))} pipelines={self.pipelines}")
        rows = [f"rank {r}: " + " ".join(map(str, row)) for r, row in enumerate(self.ranks)]
        return "\n".join([head, *rows]) + "\n"

    @staticmethod
    def from_text(text: str) -> Schedule:
        lines = [ln for ln in text.strip().splitlines() if ln.strip()]
        head = re.match(r"#\s*zbcompile schedule (\S+): microbatches=(\d+) placement=(\d+(?:,\d+)*) "
                        r"pipelines=(\d+)",
                        lines[0] if lines else "")
        if not head:
            raise ScheduleError("not a zbcompile schedule: the first line must read "
                                "'# zbcompile schedule NAME: microbatches=M placement=0,1,.. pipelines=K'")
        name, m, placement, pipelines = head.groups()
        rows = []
        for r, line in enumerate(lines[1:]):
            label, _, cells = line.partition(":")
            if label.strip() != f"rank {r}":
                raise ScheduleError(f"schedule text line {r + 2}: expected 'rank {r}: ...', got {line!r}")
            rows.append(tuple(parse_step(c) for c in cells.split()))
        return Schedule(name, int(m), tuple(int(x) for x in placement.split(",")), tuple(rows), int(pipelines))

    def to_torch_csv(self) -> str:
        """torch.distributed.pipelining's compute-only CSV: one row per rank, `I` for our B, `B` for BW."""
        if self.pipelines != 1:
            raise ScheduleError(f"schedule {self.name!r} has {self.pipelines} pipelines; torch's CSV holds one")
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        for row in self.ranks:
            writer.writerow([_to_torch_cell(a, self.name) for a in row])
        return out.getvalue()

    @staticmethod
    def from_torch_csv(text: str, name: str = "torch-csv", num_microbatches: int | None = None,
                       keep_overlap: bool = False) -> Schedule:
        """Load torch's compute-only CSV. Empty cells (idle steps) are dropped; the placement is read off
        where each stage's actions appear. An `(A;B)OVERLAP_F_B` cell becomes an `Overlap` with
        `keep_overlap`, else its sub-actions in order (the flat form)."""
        rows: list[tuple[Action | Overlap, ...]] = []
        lines = list(csv.reader(io.StringIO(text)))
        while lines and not any(c.strip() for c in lines[-1]):   # trailing blank lines
            lines.pop()
        empty = [r + 1 for r, cells in enumerate(lines) if not any(c.strip() for c in cells)]
        if empty:
            raise ScheduleError(f"torch CSV: line {empty[0]} is empty; each line is one rank's actions, so a rank "
                                "would run nothing: remove the blank line")
        for r, cells in enumerate(lines):
            steps = [_from_torch_cell(c, r) for c in cells if c.strip()]
            rows.append(tuple(steps) if keep_overlap else tuple(_expand(steps)))
        placement: dict[int, int] = {}
        for r, row in enumerate(rows):
            for a in _expand(row):
                if placement.setdefault(a.stage, r) != r:
                    raise ScheduleError(f"torch CSV: stage {a.stage} appears on ranks {placement[a.stage]} and {r}")
        n = max(placement, default=-1) + 1
        if sorted(placement) != list(range(n)):
            raise ScheduleError(f"torch CSV: stages {sorted(placement)} are not 0..{n - 1}")
        m = num_microbatches or 1 + max((a.microbatch for row in rows for a in _expand(row)), default=-1)
        return Schedule(name, m, tuple(placement[s] for s in range(n)), tuple(rows))

    def __str__(self) -> str:
        return self.to_text()


_FROM_TORCH = {spec.torch: kind for kind, spec in KIND_SPECS.items() if spec.torch is not None}


def _to_torch_cell(action: Action | Overlap, name: str) -> str:
    if type(action) is Overlap:
        return "(" + ";".join(_to_torch_cell(a, name) for a in action.actions) + ")OVERLAP_F_B"
    code = KIND_SPECS[action.kind].torch
    if code is None:
        raise ScheduleError(f"schedule {name!r}: torch's CSV has no code for {action.kind.name} actions "
                            f"({action}); drop them before exporting")
    return f"{action.stage}{code}{action.microbatch}"
_TORCH_RE = re.compile(r"^\s*(\d+)([A-Z_]+?)(\d+)\s*$")
_TORCH_OVERLAP_RE = re.compile(r"^\s*\((.*)\)\s*OVERLAP_F_B\s*$")


def _from_torch_cell(cell: str, rank: int) -> Action | Overlap:
    """One cell of torch's CSV: an action, or DualPipeV's overlapped pair `(0F3;3B1)OVERLAP_F_B`."""
    overlap = _TORCH_OVERLAP_RE.match(cell)
    if overlap:
        parts = [_from_torch_cell(part, rank) for part in overlap.group(1).split(";")]
        return Overlap.of(tuple(_expand(parts)))
    match = _TORCH_RE.match(cell)
    if not match or match.group(2) not in _FROM_TORCH:
        raise ScheduleError(
            f"torch CSV, rank {rank}: cannot read cell {cell!r}; only the compute-only format is supported "
            f"(F, I, W, B actions such as '2F0', '1I3', and overlapped F/B pairs); export comms-free schedules "
            f"from torch"
        )
    stage, kind, mb = match.groups()
    return Action(_FROM_TORCH[kind], int(stage), int(mb))


def build(name: str, num_microbatches: int, placement: Sequence[int], ranks: Sequence[Sequence[Action]],
          pipelines: int = 1) -> Schedule:
    """Freeze generator output into a Schedule and validate its structure."""
    return Schedule(name, num_microbatches, tuple(placement), tuple(tuple(r) for r in ranks), pipelines).validate()
