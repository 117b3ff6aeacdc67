"""The quick tier (``bash scripts/test --quick``: ``pytest -m quick``) covers every test module: each module
under tests/ has at least one test marked ``quick``, or says why it has none with
``pytestmark = pytest.mark.slow_only("reason")``. And CI cannot skip the tests of real parts silently."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from support import REPO

pytestmark = pytest.mark.quick

TESTS = REPO / "tests"


def _is_mark(node: ast.expr, name: str) -> bool:
    """``node`` is ``pytest.mark.<name>`` or ``mark.<name>``, called or not."""
    if isinstance(node, ast.Call):
        node = node.func
    return (isinstance(node, ast.Attribute) and node.attr == name and isinstance(node.value, ast.Attribute)
            and node.value.attr == "mark")


def _marks(value: ast.expr) -> list[ast.expr]:
    return list(value.elts) if isinstance(value, (ast.List, ast.Tuple)) else [value]


def tier_of(path: Path) -> tuple[bool, str | None]:
    """(whether some test of the module at ``path`` is marked quick, the reason of its ``slow_only`` mark or
    None), read from the module's source: a module-level ``pytestmark``, or marks on ``test_*`` functions and
    ``Test*`` classes (with their methods)."""
    tree = ast.parse(path.read_text(), str(path))
    quick, reason = False, None
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in stmt.targets):
            for m in _marks(stmt.value):
                quick |= _is_mark(m, "quick")
                if _is_mark(m, "slow_only"):
                    args = m.args if isinstance(m, ast.Call) else []
                    reason = args[0].value if args and isinstance(args[0], ast.Constant) else ""
    tests = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
             and n.name.startswith(("test_", "Test"))]
    quick |= any(_is_mark(d, "quick") for n in tests for d in n.decorator_list)
    return quick, reason


def test_every_test_module_has_a_quick_test_or_says_why_not():
    modules = sorted(p for p in TESTS.rglob("test_*.py"))
    assert len(modules) > 50  # the walk found the suite
    bare, both, no_reason = [], [], []
    for path in modules:
        quick, reason = tier_of(path)
        name = str(path.relative_to(REPO))
        if quick and reason is not None:
            both.append(name)  # a module is in the quick tier, or says why not: not both
        elif not quick and reason is None:
            bare.append(name)
        elif not quick and len(reason.strip()) < 20:
            no_reason.append(name)  # a reason that explains nothing
    assert not bare, f"modules with no quick test and no slow_only reason: {bare}"
    assert not both, f"modules marked slow_only that also have quick tests: {both}"
    assert not no_reason, f"slow_only marks without a reason: {no_reason}"


def test_the_tier_reader_sees_each_kind_of_mark(tmp_path):
    cases = {
        "pytestmark = pytest.mark.quick\n": (True, None),
        "pytestmark = [pytest.mark.quick, pytest.mark.filterwarnings('x')]\n": (True, None),
        "import pytest\n@pytest.mark.quick\ndef test_a():\n    pass\n": (True, None),
        "class TestA:\n    @pytest.mark.quick\n    def test_b(self):\n        pass\n": (True, None),
        "pytestmark = pytest.mark.slow_only('each test starts its own nodes')\n": (False, "each test starts its own nodes"),
        "def test_a():\n    pass\n": (False, None),
        "@pytest.mark.slow\ndef test_a():\n    pass\n": (False, None),
    }
    for i, (source, expected) in enumerate(cases.items()):
        path = tmp_path / f"test_{i}.py"
        path.write_text(source)
        assert tier_of(path) == expected, source


def test_the_markers_are_registered():
    """``--strict-markers`` would reject a typo such as ``quik``; the two tier marks are declared."""
    import tomllib

    markers = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    assert {m.split(":")[0].split("(")[0].strip() for m in markers} >= {"quick", "slow_only"}


def test_ci_runs_the_suite_with_ci_set(tmp_path):
    """``.ci/run`` exports CI=true before it runs the suite, so the tests of real parts (etcd, chromium, NIXL)
    fail rather than skip when a part is missing. Run on a copy whose scripts/test prints what it sees."""
    repo = tmp_path / "repo"
    (repo / ".ci").mkdir(parents=True)
    (repo / "scripts").mkdir()
    shutil.copy(REPO / ".ci" / "run", repo / ".ci" / "run")
    (repo / "scripts" / "test").write_text('echo "CI=${CI:-unset}"\n')
    model = tmp_path / "shared" / "models" / "stories260k" / "model.safetensors"
    model.parent.mkdir(parents=True)
    model.touch()
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    out = subprocess.run(["bash", str(repo / ".ci" / "run")], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "CI=true"


def test_scripts_test_quick_selects_the_quick_marker(tmp_path):
    """``bash scripts/test --quick ARGS`` runs pytest with ``-m quick`` and ARGS in one process; without ``--quick``,
    no marker filter, in two xdist workers; ``SHIFTNODE_TEST_WORKERS`` overrides either. Run on a copy whose
    set-up does nothing and whose python prints its arguments."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "test", repo / "scripts" / "test")
    (repo / "scripts" / "setup").write_text("true\n")
    python = repo / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text('#!/bin/sh\necho "$@"\n')
    python.chmod(0o755)

    def args(*extra: str, workers: str | None = None) -> list[str]:
        env = {k: v for k, v in os.environ.items() if k != "SHIFTNODE_TEST_WORKERS"}
        if workers is not None:
            env["SHIFTNODE_TEST_WORKERS"] = workers
        out = subprocess.run(["bash", str(repo / "scripts" / "test"), *extra], capture_output=True, text=True,
                             timeout=30, env=env)
        assert out.returncode == 0, out.stderr
        return out.stdout.split()

    quick = args("--quick", "tests/core")
    assert quick[:2] == ["-m", "pytest"] and ("-m", "quick") in zip(quick, quick[1:]) and quick[-1] == "tests/core"
    assert "-n" not in quick  # the quick tier: one process (its API tests share one node)
    whole = args("tests/core")
    pairs = set(zip(whole, whole[1:]))
    assert "quick" not in whole and whole[-1] == "tests/core"
    assert {("-n", "2"), ("--dist", "loadfile")} <= pairs  # the whole suite: two workers by default
    # SHIFTNODE_TEST_WORKERS=2: two workers, a file to a worker, in conftest's order (slow_only files first)
    for extra in ((), ("--quick",)):
        split = args(*extra, "tests/core", workers="2")
        pairs = set(zip(split, split[1:]))
        assert {("-n", "2"), ("--dist", "loadfile")} <= pairs and "--no-loadscope-reorder" in split
        assert split[-1] == "tests/core" and (("-m", "quick") in pairs) == bool(extra)
    assert "-n" not in args("tests/core", workers="1")


def test_workers_take_the_slow_only_modules_first_each_module_whole():
    """Under ``-n N`` (a worker's config has ``workerinput``) conftest puts the items of ``slow_only`` modules
    first, keeping each module's items together and in order; in one process the order is left as collected,
    and only a process that runs tests (not xdist's controller) launches the early stories260k node."""
    import conftest

    class Item:
        def __init__(self, module: str, n: int, slow: bool):
            self.name, self.slow = f"{module}{n}", slow

        def get_closest_marker(self, name):
            return pytest.mark.slow_only("x").mark if name == "slow_only" and self.slow else None

    def items():
        return [Item("a", 1, False), Item("a", 2, False), Item("b", 1, True), Item("c", 1, False),
                Item("d", 1, True), Item("d", 2, True)]

    class Config:
        def __init__(self, dist: str, worker: bool):
            self.dist = dist
            if worker:
                self.workerinput = {"workerid": "gw0"}

        def getoption(self, name, default=None):
            return self.dist if name == "dist" else default

    got = items()
    conftest.pytest_collection_modifyitems(Config("loadfile", worker=True), got)
    assert [i.name for i in got] == ["b1", "d1", "d2", "a1", "a2", "c1"]
    got = items()
    conftest.pytest_collection_modifyitems(Config("no", worker=False), got)
    assert [i.name for i in got] == ["a1", "a2", "b1", "c1", "d1", "d2"]
    assert conftest._runs_tests(Config("no", worker=False)) and conftest._runs_tests(Config("loadfile", worker=True))
    assert not conftest._runs_tests(Config("loadfile", worker=False))  # the controller
