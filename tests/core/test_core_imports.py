"""node/core is pure: it imports only the standard library, msgspec and itself."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here

CORE = Path(__file__).resolve().parents[2] / "node" / "core"
FORBIDDEN = {"torch", "numpy", "asyncio", "aiohttp", "time", "random", "threading", "socket", "multiprocessing",
             "subprocess", "os", "io", "pathlib", "logging", "structlog", "datetime", "concurrent", "selectors"}
ALLOWED_THIRD_PARTY = {"msgspec"}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: inside node.core
                out.append((node.lineno, "node.core" + ("." + node.module if node.module else "")))
            else:
                out.append((node.lineno, node.module or ""))
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "__import__":
            out.append((node.lineno, "__import__"))
    return out


def test_core_modules_import_nothing_impure():
    files = sorted(CORE.glob("**/*.py"))
    assert files, f"no modules under {CORE}"
    bad = []
    for f in files:
        for line, mod in imported_modules(f):
            top = mod.split(".")[0]
            if mod == "__import__" or top in FORBIDDEN:
                bad.append(f"{f.name}:{line}: {mod}")
            elif mod.startswith("node.") and not mod.startswith("node.core"):
                bad.append(f"{f.name}:{line}: {mod} (the core never imports the shell)")
            elif top not in sys.stdlib_module_names and top not in ALLOWED_THIRD_PARTY and top != "node":
                bad.append(f"{f.name}:{line}: {mod} (not stdlib or msgspec)")
    assert not bad, "forbidden imports in node/core:\n" + "\n".join(bad)


def test_the_checker_catches_a_forbidden_import(tmp_path):
    f = tmp_path / "bad.py"
    f.write_text("import os.path\nfrom time import monotonic\nfrom . import ledger\nfrom .cost import CostModel\n")
    mods = [m for _, m in imported_modules(f)]
    assert mods == ["os.path", "time", "node.core", "node.core.cost"]
