"""Lowering passes as text in, text out: each pass applied to the printed programs of the pass before it must
print exactly the golden text under tests/golden/programs/ (`{case}.{step}.txt`, every rank's program).

Regenerate after an intended change with `ZB_UPDATE_GOLDEN=1 python -m pytest tests/lower/test_lower_golden.py`
and read the diff: it is the change's effect on the programs.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch

from support.models import mlp
from zbcompile.passes.lower import FINISHING, LOWERING, build_compute, run_passes
from zbcompile.passes.lower.p2p import insert_p2p
from zbcompile.passes.schedules import generate
from zbcompile.ir.program import RankProgram
from zbcompile.split import split_model

torch.set_num_threads(1)

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "programs"   # tests/golden/programs
UPDATE = os.environ.get("ZB_UPDATE_GOLDEN") == "1"
CASES = {"1f1b-pp2-m2": ("1f1b", 2, 2), "zbv-pp2-m3": ("zbv", 2, 3), "zb-h1-pp2-m2": ("zb-h1", 2, 2)}
STEPS = [p.__name__ if hasattr(p, "__name__") else p.func.__name__ for p in (*LOWERING, *FINISHING)]
SEPARATOR = "\n=====\n"


@functools.lru_cache(maxsize=None)
def _chain(case: str) -> list[tuple]:
    """[(step name, programs after it)], from build_compute through every pass, live."""
    name, pp, m = CASES[case]
    sched = generate(name, pp, m)
    model, loss_fn, (x, y), _ = mlp(layers=sched.num_model_stages, width=4, batch=2)
    staged = split_model(model, loss_fn, ((x[:1],), (y[:1],)), num_stages=sched.num_model_stages)
    programs = tuple(build_compute(sched, staged, r) for r in range(pp))
    out = [("build_compute", programs)]
    for p in (*LOWERING, *FINISHING):
        programs = run_passes(programs, [p])
        out.append((STEPS[len(out) - 1], programs))
    return out


def _text(programs) -> str:
    return SEPARATOR.join(p.to_text() for p in programs) + "\n"


def _golden(case: str, step: str, live: str) -> str:
    path = GOLDEN / f"{case}.{step}.txt"
    if UPDATE:
        path.write_text(live)
    if not path.exists():
        pytest.fail(f"{path} is missing; create it with ZB_UPDATE_GOLDEN=1")
    return path.read_text()


@pytest.mark.parametrize("case", list(CASES))
def test_lowered_programs_match_the_golden_text(case):
    for step, programs in _chain(case):
        live = _text(programs)
        assert live == _golden(case, step, live), f"{case}: programs after {step} differ from the golden text"


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("k", range(len(STEPS)), ids=STEPS)
def test_each_pass_is_text_in_text_out(case, k):
    """Parse the golden programs before pass k (GraphModules attached from the live chain: passes that read
    graphs, e.g. the alias analysis of static_recv_buffers, need them), apply the pass, print: the golden
    programs after it."""
    chain = _chain(case)
    (_, before), (step, _) = chain[k], chain[k + 1]
    texts = _golden(case, chain[k][0], _text(before)).rstrip("\n").split(SEPARATOR)
    parsed = tuple(RankProgram.from_text(t, graphs=p.graphs) for t, p in zip(texts, before))
    p = (*LOWERING, *FINISHING)[k]
    after = run_passes(parsed, [p])
    assert _text(after) == _golden(case, step, _text(chain[k + 1][1]))


def test_golden_insert_p2p_needs_no_graph_modules():
    """insert_p2p reads only the program text: ops, graph signatures and the types of boundary tensors."""
    chain = _chain("zbv-pp2-m3")
    texts = _text(chain[0][1]).rstrip("\n").split(SEPARATOR)
    bare = tuple(RankProgram.from_text(t) for t in texts)
    assert _text(run_passes(bare, [insert_p2p])) == _text(chain[1][1])
