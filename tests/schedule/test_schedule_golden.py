"""Golden schedules: every generator's order for a few small sizes is pinned as text in tests/golden/.

A refactoring of the schedule IR, the simulator or a generator must leave these orders byte-identical. If a
generator's order changes on purpose, regenerate the file with `Schedule.to_text()` and say why in the commit.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from zbcompile.passes.schedules import GENERATORS, generate
from zbcompile.ir.schedule import Schedule
from zbcompile.simulate import Costs

GOLDEN = Path(__file__).resolve().parents[1] / "golden"   # tests/golden
COSTS = Costs(f=1, b=1.1, w=0.6, comm=0.05)

CASES = [(name, 4, 8, {}, f"{name}_p4_m8.txt") for name in GENERATORS] + [
    ("zb-auto", 3, 6, {"costs": COSTS, "mem_limit": 4}, "zb-auto_p3_m6_costs.txt"),
    ("zbv", 3, 6, {"costs": COSTS}, "zbv_p3_m6_costs.txt"),
    ("v-zb", 3, 6, {"costs": COSTS}, "v-zb_p3_m6_costs.txt"),
]


@pytest.mark.parametrize("name,pp,m,options,file", CASES, ids=[c[-1] for c in CASES])
def test_order_matches_golden(name, pp, m, options, file):
    expected = (GOLDEN / file).read_text()
    assert generate(name, pp, m, **options).to_text() == expected
    assert Schedule.from_text(expected).to_text() == expected
