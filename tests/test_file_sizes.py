"""The house rule on size: no Python file of ``node/`` is over 400 lines (one concept per file; a file that
grows past it is split by concept, not cut in half), and ``DeviceEngine`` is composed of parts rather than
mixed in from other files, nor is the adaptive policy (issue 47, item 5)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from node.core.cost import CostModel
from node.core.roles import RoleSchedulerConfig

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 400


def _lines(path: Path) -> int:
    """Lines as ``wc -l`` counts them (newlines; a last line without one counts too)."""
    data = path.read_bytes()
    return data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)


def test_no_file_of_node_is_over_400_lines():
    files = sorted((ROOT / "node").rglob("*.py"))
    assert len(files) > 100  # the package is there (a wrong root would pass vacuously)
    over = {str(f.relative_to(ROOT)): n for f in files if (n := _lines(f)) > MAX_LINES}
    assert over == {}, f"split these by concept: {over}"


def test_the_line_count_matches_wc(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\ny = 2\n")
    (tmp_path / "b.py").write_text("x = 1\ny = 2")
    assert _lines(tmp_path / "a.py") == 2 and _lines(tmp_path / "b.py") == 2


def test_the_engine_and_the_adaptive_policy_have_no_mixins():
    """Each concern is an attribute the class builds (its state owned there), not a base class whose methods
    read state another file defines."""
    from node.core.adaptive import AdaptiveScheduler
    from node.core.handoff_windows import HandoffWindows
    from node.core.mixed_placement import MixedPlacement
    from node.core.roles import RoleScheduler
    from node.core.windows import WindowMath
    from node.runtime.engine import DeviceEngine

    assert DeviceEngine.__mro__ == (DeviceEngine, object)
    assert AdaptiveScheduler.__mro__ == (AdaptiveScheduler, RoleScheduler, WindowMath, object)  # one chain
    policy = AdaptiveScheduler(RoleSchedulerConfig(ttft_slo_ms=200, tpot_slo_ms=50), CostModel())
    assert isinstance(policy.mixed, MixedPlacement) and isinstance(policy.handoffs, HandoffWindows)


# bases that add an interface, not state: typing's and asyncio's protocols
_INTERFACE_BASES = {"Protocol", "typing.Protocol", "asyncio.Protocol", "asyncio.BaseProtocol"}


def _mixed_in(tree: ast.Module) -> list[tuple[str, list[str]]]:
    """The classes of a module with two or more bases besides interfaces: (name, those bases)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            bases = [ast.unparse(b) for b in node.bases]
            state = [b for b in bases if b not in _INTERFACE_BASES and not b.startswith("Generic[")]
            if len(state) > 1:
                out.append((node.name, state))
    return out


def test_no_class_of_node_mixes_in_a_second_base():
    """A mixin reads and writes state through ``self`` that another file defines; a part is given what it
    uses by its constructor (issue 47, item 5). A class of ``node/`` has one base chain, plus protocols."""
    files = sorted((ROOT / "node").rglob("*.py"))
    found = {f"{f.relative_to(ROOT)}:{name}": bases
             for f in files for name, bases in _mixed_in(ast.parse(f.read_text()))}
    assert found == {}, f"make these parts the class builds, not bases: {found}"


def test_the_mixin_check_sees_a_mixin_and_lets_protocols_pass():
    tree = ast.parse("class A(Handoffs, RoleScheduler): pass\n"
                     "class B(FrameWriter, asyncio.Protocol): pass\n"
                     "class C(EngineSet, Protocol): pass\n"
                     "class D(msgspec.Struct, frozen=True): pass\n")
    assert _mixed_in(tree) == [("A", ["Handoffs", "RoleScheduler"])]
