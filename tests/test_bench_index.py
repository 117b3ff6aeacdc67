"""``python -m bench``, the index of the benchmark tools: it lists every module of ``bench`` (so it cannot go
stale), every listed module imports, every tool has a ``main``, the dispatch runs a tool, and each group's
imports go the documented way (``Group.imports``)."""
from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from bench.__main__ import GROUPS, index, main, tools

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"


def modules_on_disk() -> set[str]:
    """Dotted paths below ``bench`` of every module file (``sim`` for bench/sim/__main__.py), packages left out."""
    found = set()
    for path in BENCH.rglob("*.py"):
        parts = path.relative_to(BENCH).with_suffix("").parts
        if parts == ("__main__",) or parts[-1] == "__init__":
            continue
        found.add(".".join(parts[:-1]) if parts[-1] == "__main__" else ".".join(parts))
    return found


def listed() -> list[str]:
    return [m for g in GROUPS for m in (*(t.module for t in g.tools), *g.helpers)]


def test_every_module_is_listed_once():
    names = listed()
    assert len(names) == len(set(names)), "listed twice: " + ", ".join(sorted({n for n in names if names.count(n) > 1}))
    assert set(names) == modules_on_disk(), (f"missing from bench/__main__.py: {sorted(modules_on_disk() - set(names))}; "
                                             f"listed but absent: {sorted(set(names) - modules_on_disk())}")
    for group in GROUPS:  # a module is listed in the group of its folder
        assert all(m.split(".")[0] == group.package for m in (*(t.module for t in group.tools), *group.helpers))


def test_every_listed_module_imports_and_every_tool_has_main():
    for name in listed():
        importlib.import_module(f"bench.{name}")
    for group in GROUPS:
        for tool in group.tools:
            mod = importlib.import_module(f"bench.{tool.module}" + (".__main__" if tool.module == "sim" else ""))
            assert callable(getattr(mod, "main", None)), tool.module
            assert tool.question.strip() and tool.command == f"python -m bench.{tool.module}"


def bench_imports(path: Path) -> set[str]:
    """The ``bench`` sub-packages a module imports (any ``bench.X...`` or ``from bench import X``)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] if node.module != "bench" else [f"bench.{a.name}" for a in node.names]
        else:
            continue
        out |= {n.split(".")[1] for n in names if n.startswith("bench.")}
    return out


def test_imports_go_one_way():
    allowed = {g.package: g.imports | {g.package} for g in GROUPS}
    wrong = []
    for path in sorted(BENCH.rglob("*.py")):
        parts = path.relative_to(BENCH).parts
        if len(parts) == 1:
            continue  # bench/__init__.py and the index itself
        wrong += [f"{path.relative_to(REPO)} imports bench.{p}" for p in bench_imports(path) - allowed[parts[0]]]
    assert not wrong, "\n".join(wrong)


def test_index_lists_every_tool_and_dispatches(capsys):
    text = index()
    for tool in {t.module: t for t in tools().values()}.values():
        assert tool.command in text and tool.question in text
    assert main(["no-such-tool"]) == 2
    assert "no tool 'no-such-tool'" in capsys.readouterr().err
    run = lambda *args: subprocess.run([sys.executable, "-m", "bench", *args], cwd=REPO, capture_output=True,
                                       text=True, check=True).stdout  # noqa: E731
    assert run().strip() == text.strip()
    assert "--tensor-parallel-size" in run("derive_cost", "--help")  # the tool's own argparse answered
