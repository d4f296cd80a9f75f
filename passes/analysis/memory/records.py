"""What a memory plan says: the categories of dynamic memory, one rank's RankMemory (its samples over the step)
and every rank's MemoryPlan. See the package docstring for what the numbers mean."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, NamedTuple

from zbcompile.ir.names import Role
from zbcompile.ir.program.values import parse

__all__ = ["CATEGORIES", "Sample", "RankMemory", "MemoryPlan"]

# params: whole parameters gathered from their data-parallel shards for the step (passes/lower/dp_shard.py)
CATEGORIES = ("saved", "boundary", "grads", "workspace", "params", "other")
_SAVED, _BOUNDARY, _GRADS, _WORKSPACE, _PARAMS, _OTHER = range(6)
_ACTIVATION = (_SAVED, _BOUNDARY)
_ROLE_CATEGORY = {Role.SAVED: _SAVED, Role.WSAVED: _SAVED, Role.ACT: _BOUNDARY, Role.GRAD_ACT: _BOUNDARY,
                  Role.DATA: _BOUNDARY, Role.VOCAB: _BOUNDARY, Role.GRAD_PARAM: _GRADS}


class Sample(NamedTuple):
    """One op of the program: the most dynamic bytes live while it runs, and the dynamic bytes live after it
    by category (CATEGORIES order; workspace is 0 between ops)."""

    op: int
    peak: int
    after: tuple[int, ...]

    @property
    def total(self) -> int:
        return sum(self.after)


@dataclass(frozen=True)
class RankMemory:
    """One rank's memory over the step (bytes). resident: what exists before the step, by kind; samples: one
    per op; peak_op: the op during which the dynamic bytes peak, peak_split: their categories then; host: the
    host pool's bytes (offload), not device memory."""

    rank: int
    name: str
    resident: Mapping[str, int]
    samples: tuple[Sample, ...]
    peak_op: int
    peak_at: str
    peak_split: tuple[int, ...]
    host: int = 0

    @property
    def resident_bytes(self) -> int:
        return sum(self.resident.values())

    @property
    def peak_dynamic_bytes(self) -> int:
        """The most bytes the step itself holds at once (what a tracker of the step's allocations measures)."""
        return max((s.peak for s in self.samples), default=0)

    @property
    def peak_total_bytes(self) -> int:
        return self.resident_bytes + self.peak_dynamic_bytes

    @property
    def peak_activation_bytes(self) -> int:
        """The most bytes of saved and boundary tensors live at once (between ops)."""
        return max((sum(s.after[c] for c in _ACTIVATION) for s in self.samples), default=0)

    def to_json(self) -> dict:
        return {"rank": self.rank, "peak_activation_bytes": self.peak_activation_bytes,
                "peak_total_bytes": self.peak_total_bytes, "peak_dynamic_bytes": self.peak_dynamic_bytes,
                "resident_bytes": self.resident_bytes, "resident": dict(self.resident),
                "peak_op": self.peak_op, "peak_at": self.peak_at,
                "peak_split": dict(zip(CATEGORIES, self.peak_split)), "host_bytes": self.host,
                "timeline": [[s.op, s.peak, *s.after] for s in self.samples],
                "timeline_columns": ["op", "peak", *CATEGORIES]}


@dataclass(frozen=True)
class MemoryPlan:
    """Every rank's RankMemory; `table()` prints one row per rank."""

    name: str
    ranks: tuple[RankMemory, ...]

    def __getitem__(self, rank: int) -> RankMemory:
        return self.ranks[rank]

    def to_json(self) -> dict:
        return {"schedule": self.name, "ranks": [r.to_json() for r in self.ranks]}

    def table(self) -> str:
        from tabulate import tabulate

        rows = [(r.rank, _mib(r.resident_bytes), _mib(r.peak_activation_bytes), _mib(r.peak_dynamic_bytes),
                 _mib(r.peak_total_bytes), r.peak_at) for r in self.ranks]
        return tabulate(rows, headers=("rank", "resident MiB", "peak activations MiB", "peak step MiB",
                                       "peak total MiB", "at op"), floatfmt=".2f")


def _mib(n: int) -> float:
    return n / 2**20


def _category(value: str) -> int:
    v = parse(value)
    if v.role is Role.HANDLE:
        inner = value[2:]
        if inner[:2] == "ag" and inner[2:].isdigit():   # a parameter gather's
            return _PARAMS
        return _category(inner) if inner and parse(inner).role is not Role.OTHER else _BOUNDARY
    if v.scope == "gather":
        return _PARAMS
    return _ROLE_CATEGORY.get(v.role, _OTHER)
