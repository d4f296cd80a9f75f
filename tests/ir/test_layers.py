"""The floor plan as a test: every import of the library (module level and inside functions) points down.

    api, pipeline module, tools (plan, inspect, simulate, timeline), examples     top
    compiler core: options, compiler, split, distributed, data_parallel, agreement, checkpoint, share, watch
    passes (zbcompile.passes = passes/)          runtime (zbcompile.runtime)     neither imports the other
    ir (zbcompile.ir): actions, schedule, costs, names, stages, program          a leaf
    errors, _torch_private, _format                                              the floor

A new import that points up (the IR reaching for an analysis, the runtime for the distributed wiring, a pass
for a tool) fails here with the importing file and line.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]   # the repository (this file is tests/ir/test_layers.py)

# room -> the rooms it may import (itself included)
MAY_IMPORT = {
    "floor": {"floor"},
    "ir": {"floor", "ir"},
    "runtime": {"floor", "ir", "runtime"},
    "passes": {"floor", "ir", "passes"},
    "core": {"floor", "ir", "runtime", "passes", "core"},
    "top": {"floor", "ir", "runtime", "passes", "core", "top"},
}
FLOOR = {"zbcompile.errors", "zbcompile._torch_private", "zbcompile._format"}
CORE = {"zbcompile.options", "zbcompile.compiler", "zbcompile.split", "zbcompile.distributed",
        "zbcompile.agreement", "zbcompile.checkpoint", "zbcompile.checkpoint_checks", "zbcompile.checkpoint_files",
        "zbcompile.checkpoint_rows", "zbcompile.data_parallel", "zbcompile.share", "zbcompile.watch",
        "zbcompile.eval_check"}


def room(module: str) -> str:
    if module in FLOOR:
        return "floor"
    for prefix in ("ir", "runtime", "passes"):
        if module == f"zbcompile.{prefix}" or module.startswith(f"zbcompile.{prefix}."):
            return prefix
    return "core" if module in CORE else "top"


def module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "passes":   # passes/ ships as zbcompile.passes (pyproject's package-dir)
        parts.insert(0, "zbcompile")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: pathlib.Path):
    """(line, imported module) for every import of zbcompile in the file, at any depth."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "zbcompile":
            # `from zbcompile import checkpoint` imports a module; `from zbcompile.x import name` imports x
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                yield node.lineno, full if _is_module(full) else node.module
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "zbcompile":
                    yield node.lineno, alias.name


def _is_module(name: str) -> bool:
    parts = name.split(".")[1:]
    if parts and parts[0] == "passes":
        base = ROOT / "passes" / pathlib.Path(*parts[1:]) if parts[1:] else ROOT / "passes"
    else:
        base = ROOT / "zbcompile" / pathlib.Path(*parts) if parts else ROOT / "zbcompile"
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def library_files() -> list[pathlib.Path]:
    return sorted([*ROOT.joinpath("zbcompile").rglob("*.py"), *ROOT.joinpath("passes").rglob("*.py")])


def test_every_import_points_down():
    wrong = []
    for path in library_files():
        here = module_name(path)
        for line, target in imports(path):
            if room(target) not in MAY_IMPORT[room(here)]:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {here} ({room(here)}) imports {target} "
                             f"({room(target)})")
    assert not wrong, "imports that point up or sideways:\n" + "\n".join(wrong)


@pytest.mark.parametrize("module, expected", [
    ("zbcompile.ir.stages", "ir"), ("zbcompile.passes.lower.emit", "passes"), ("zbcompile.runtime.eager", "runtime"),
    ("zbcompile.api", "top"), ("zbcompile.errors", "floor"), ("zbcompile.split", "core")])
def test_rooms(module, expected):
    assert room(module) == expected


def test_the_check_sees_an_import_inside_a_function(tmp_path):
    """A function-level import counts: the IR importing an analysis lazily is still an upward import."""
    leaky = tmp_path / "leaky.py"
    leaky.write_text("def f():\n    from zbcompile.passes.analysis import stage_report\n")
    found = list(imports(leaky))
    assert found == [(2, "zbcompile.passes.analysis.stage_report")]
    assert room(found[0][1]) not in MAY_IMPORT[room("zbcompile.ir.leaky")]


# the floor plan's sizes (issue "One floor plan"): a library file that outgrows them is split by what its parts
# do (as pipeline_module.py into pipeline_eval / pipeline_grads), not left to grow
MAX_LINES = 500
MAX_API_LINES = 120


def test_no_library_file_is_over_the_size_limit():
    big = {str(p.relative_to(ROOT)): n for p in library_files() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    api = len(ROOT.joinpath("zbcompile", "api.py").read_text().splitlines())
    assert not big, f"library files over {MAX_LINES} lines: {big}"
    assert api <= MAX_API_LINES, f"zbcompile/api.py has {api} lines (at most {MAX_API_LINES}): keep it the entry"
