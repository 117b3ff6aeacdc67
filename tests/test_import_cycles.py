"""The layering of ``node/`` holds: no import cycle among its modules, type-only imports
(``if TYPE_CHECKING:``) and imports inside functions included, and only the composition roots know the
concrete ``Node`` (the services are handed the views of :mod:`node.runtime.interfaces`)."""

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here

ROOT = Path(__file__).resolve().parents[1]


def _modules(package: str) -> dict[str, Path]:
    out = {}
    for f in (ROOT / package).rglob("*.py"):
        parts = f.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = f
    return out


def _imports(f: Path, name: str, known: dict[str, Path]) -> set[str]:
    """Modules of ``known`` that ``f`` (module ``name``) imports anywhere in its body."""
    found = set()
    is_pkg = f.name == "__init__.py"
    for n in ast.walk(ast.parse(f.read_text(), str(f))):
        if isinstance(n, ast.Import):
            found |= {a.name for a in n.names}
        elif isinstance(n, ast.ImportFrom):
            base = n.module or ""
            if n.level:
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - (n.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{a.name}" for a in n.names}  # ``from pkg import module``
    return {m for m in found if m in known and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of two or more modules (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    groups = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                group = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    group.append(w)
                    if w == v:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return groups


def _graph(package: str) -> dict[str, set[str]]:
    mods = _modules(package)
    return {m: _imports(f, m, mods) for m, f in mods.items()}


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_node():
    assert _cycles(_graph("node")) == []


def test_only_the_composition_roots_import_the_node():
    graph = _graph("node")
    importers = sorted(m for m, deps in graph.items() if "node.runtime.node" in deps)
    assert importers == ["node.api.app"], importers  # the CLI builds it through the app factory


def test_the_config_reaches_no_layer_above_it():
    """``node.config`` (flags and their checks) sits below the engines, the runtime and the API: nothing it
    imports, directly or through other modules, is of ``node.worker``, ``node.runtime`` or ``node.api``."""
    graph = _graph("node")
    seen, todo = set(), ["node.config"]
    while todo:
        for dep in graph[todo.pop()] - seen:
            seen.add(dep)
            todo.append(dep)
    assert "node.core.cost" in seen  # the walk follows imports (node.timed_cost's)
    above = sorted(m for m in seen if m.startswith(("node.worker", "node.runtime", "node.api")))
    assert above == [], above
