"""Every action kind has a complete spec in `zbcompile.ir.schedule.KIND_SPECS` (docs/design.md, "Adding an
action kind"): a kind missing a part fails here rather than deep inside the simulator or a search."""

from __future__ import annotations

import dataclasses

import pytest

from zbcompile.ir.schedule import (CELL_FORMS, COST_KEYS, VOCAB_COST_KEYS, KIND_SPECS, Action, Kind, KindSpec,
                                   Schedule, loop_placement)
from zbcompile.simulate import Costs, MemoryModel


@pytest.mark.parametrize("kind", list(Kind), ids=lambda k: k.name)
def test_every_kind_has_a_complete_spec(kind: Kind) -> None:
    spec = KIND_SPECS.get(kind)
    assert isinstance(spec, KindSpec), f"{kind!r} has no KindSpec in KIND_SPECS"
    for field in dataclasses.fields(KindSpec):
        value = getattr(spec, field.name)
        assert value is not None or field.name == "torch", f"{kind!r}: {field.name} is missing"
    assert spec.meaning.strip() and "\n" not in spec.meaning, f"{kind!r}: meaning must be one line"
    assert spec.code and spec.code.isalpha() and spec.code.isupper(), f"{kind!r}: code {spec.code!r}"
    keys = VOCAB_COST_KEYS if spec.sharded else COST_KEYS
    assert spec.cost and set(spec.cost) <= set(keys), f"{kind!r}: cost keys {spec.cost} not in {keys}"
    assert callable(spec.deps) and callable(spec.memory)
    assert isinstance(spec.memory(MemoryModel(b_frees=0.5, vocab=2.0), 1.0), float)
    action = Action(kind, 1, 2)
    assert Action.parse(str(action)) == action
    context = Schedule("probe", 4, loop_placement(3), ((), (), ()))
    assert all(isinstance(d, Action) for d in spec.deps(context, 1, 2))


def test_codes_are_unique() -> None:
    codes = [spec.code for spec in KIND_SPECS.values()]
    torch = [spec.torch for spec in KIND_SPECS.values() if spec.torch is not None]
    assert len(set(codes)) == len(codes) and len(set(torch)) == len(torch)


def test_cell_forms_name_known_kinds() -> None:
    assert all(form <= set(KIND_SPECS) and Kind.F in form for form in CELL_FORMS)


def test_tables_read_by_the_simulator() -> None:
    """Cost and memory come from the spec: BW costs b + w and frees what B and W free together."""
    schedule = Schedule("s", 1, (0,), ((Action(Kind.F, 0, 0), Action(Kind.BW, 0, 0)),))
    table = Costs(f=1, b=2, w=3).action_costs(schedule)
    assert table[Kind.BW, 0] == 5 and table[Kind.B, 0] == 2
    model = MemoryModel(b_frees=0.25)
    assert model.delta(Kind.B, 2.0) + model.delta(Kind.W, 2.0) == model.delta(Kind.BW, 2.0) == -2.0
