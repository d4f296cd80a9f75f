"""Every ```python block of README.md runs as written.

The blocks of one `## ` section run in order in one namespace (a block may continue the one before it). A
section whose code calls `zb.compile(` needs a process group: it is written out as the script the README tells
users to write and launched under torchrun with 2 ranks (gloo), as they would; the other sections run in this
process. The code keeps its README line numbers (the lines between blocks are blank), so a traceback points at
README.md. Shell commands and other text that must not run are fenced as something other than python.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from support.launch import torchrun

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAIN_JOB = ("pip install torch==2.13.0 -e . && torchrun --nproc-per-node 2 -m zbcompile.examples.train_gpt "
            "--schedule zb-h1")
TESTS = 'pip install torch==2.13.0 -e ".[test]" && python -m pytest -q -n 2'


def fences(text: str) -> list[tuple[str, str, int, list[str]]]:
    """(section, language, first code line (1-based), code lines) of every fenced block, in order."""
    out, section, block = [], "", None
    for number, line in enumerate(text.splitlines(), 1):
        if block is None:
            if line.startswith("## "):
                section = line[3:].strip()
            elif line.startswith("```"):
                block = (section, line[3:].strip(), number + 1, [])
                out.append(block)
        elif line.startswith("```"):
            block = None
        else:
            block[3].append(line)
    assert block is None, f"README.md: the block opened at line {out[-1][2] - 1} is never closed"
    return out


def sections() -> dict[str, str]:
    """Section title -> its python blocks as one program of README.md's length (code at its own line numbers)."""
    text = README.read_text()
    total = len(text.splitlines())
    programs: dict[str, list[str]] = {}
    for section, lang, first, code in fences(text):
        if lang == "python":
            lines = programs.setdefault(section, [""] * total)
            lines[first - 1:first - 1 + len(code)] = code
    return {section: "\n".join(lines) + "\n" for section, lines in programs.items()}


def anchors(markdown: Path) -> set[str]:
    """GitHub's anchors of a markdown file's headings."""
    heads = (line.lstrip("#").strip() for line in markdown.read_text().splitlines() if line.startswith("#"))
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}


def needs_ranks(program: str) -> bool:
    return "zb.compile(" in program


def slug(section: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", section.lower()).strip("-")


PROGRAMS = sections()
LOCAL = [s for s, p in PROGRAMS.items() if not needs_ranks(p)]
DISTRIBUTED = [s for s, p in PROGRAMS.items() if needs_ranks(p)]


def test_readme_fences_name_their_language_and_keep_the_two_commands():
    blocks = fences(README.read_text())
    unnamed = [first - 1 for _, lang, first, _ in blocks if not lang]
    assert not unnamed, f"README.md: fences without a language at lines {unnamed} (python runs as a test)"
    for section, lang, first, code in blocks:
        if lang == "python":   # the in-process sections compile below anyway; this checks the torchrun ones too
            compile("\n" * (first - 1) + "\n".join(code), str(README), "exec")
    shell = [line for _, lang, _, code in blocks if lang == "bash" for line in code]
    assert MAIN_JOB in shell and TESTS in shell
    # .ci/run runs exactly the README's test command (with --durations added)
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert any(line == TESTS or line.startswith(TESTS + " ") for line in ci), ".ci/run is out of step with README"
    assert LOCAL and DISTRIBUTED


def test_readme_links_point_at_files_and_headings_that_exist():
    for doc in (README, ROOT / "benchmarks" / "README.md"):
        for target in re.findall(r"\]\(([^)#:]+)(?:#([^)]+))?\)", doc.read_text()):
            path, anchor = doc.parent / target[0], target[1]
            assert path.exists(), f"{doc.relative_to(ROOT)} links to {target[0]}, which does not exist"
            assert not anchor or anchor in anchors(path), \
                f"{doc.relative_to(ROOT)}: no heading #{anchor} in {target[0]}"


def local_param(section: str):
    slow = "split_model(" in PROGRAMS[section]   # tracing a model takes seconds
    return pytest.param(section, id=slug(section), marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("section", [local_param(s) for s in LOCAL])
def test_readme_section_runs(section, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(PROGRAMS[section], str(README), "exec"), {"__name__": "__main__"})


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("section", DISTRIBUTED, ids=[slug(s) for s in DISTRIBUTED])
def test_readme_section_runs_under_torchrun(section, tmp_path):
    script = tmp_path / f"readme_{slug(section).replace('-', '_')}.py"
    script.write_text(PROGRAMS[section])
    out = torchrun([str(script)], cwd=tmp_path, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    # on failure, the ranks' own tracebacks (their line numbers are README.md's) without torchrun's summary
    assert out.returncode == 0, f"README.md, section {section!r} under torchrun:\n" + out.stdout[-2000:] + "\n".join(
        line for line in out.stderr.splitlines() if "torch/distributed/elastic" not in line)[-6000:]
