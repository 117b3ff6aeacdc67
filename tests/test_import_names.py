"""shiftnode's import names never clash with another installed distribution's.

transformers 5.x imports Hugging Face's ``kernels`` distribution at module level
(``transformers/integrations/hub_kernels.py``). When this project's kernels package was itself
called ``kernels``, the checkout (first on ``sys.path`` under pytest and ``python -m``) shadowed it
and every test that touched transformers failed with ``cannot import name 'CUDAProperties' from
'kernels'``. The kernels now import as ``shiftnode_kernels`` from the folder ``kernels/``, which has
no ``__init__.py``. These tests name such a clash directly if one ever comes back.
"""
import importlib
import importlib.metadata as metadata
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _owners() -> dict[str, set[str]]:
    """Top-level import name -> the installed distributions that provide it."""
    return {name: set(dists) for name, dists in metadata.packages_distributions().items()}


def _checkout_top_level() -> set[str]:
    """Names importable from the checkout root as regular packages or modules (what ``sys.path[0]``
    offers when a command runs from here)."""
    names = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    names |= {p.stem for p in ROOT.glob("*.py")}
    return names


@pytest.mark.quick
def test_installed_names_belong_to_shiftnode_alone():
    owners = _owners()
    ours = {name for name, dists in owners.items() if "shiftnode" in dists}
    assert {"node", "shiftnode_kernels"} <= ours, f"shiftnode installs {sorted(ours)}"
    clashes = {name: sorted(owners[name] - {"shiftnode"}) for name in ours if owners[name] - {"shiftnode"}}
    assert not clashes, f"another installed distribution provides shiftnode's import names: {clashes}"


@pytest.mark.quick
def test_checkout_root_shadows_no_installed_package():
    owners = _owners()
    clashes = {name: sorted(owners[name]) for name in _checkout_top_level()
               if name in owners and owners[name] != {"shiftnode"}}
    assert not clashes, (f"a package in the checkout root would shadow an installed distribution's "
                         f"(the root is sys.path[0] under pytest and python -m): {clashes}")


@pytest.mark.quick
def test_kernels_folder_is_not_a_regular_package():
    # With no __init__.py the folder is at most a namespace portion, which an installed regular
    # package of the same name always beats, whatever the order of sys.path.
    assert not (ROOT / "kernels" / "__init__.py").exists()
    assert str(ROOT) in [str(Path(p).resolve()) for p in sys.path if p], "the test runs with the root on sys.path"
    spec = importlib.util.find_spec("kernels")
    if "kernels" in _owners():  # Hugging Face's distribution is installed (transformers >= 5 pulls it in)
        assert spec is not None and spec.origin is not None
        assert not Path(spec.origin).resolve().is_relative_to(ROOT / "kernels"), (
            f"`import kernels` resolves to the checkout ({spec.origin}), shadowing Hugging Face's kernels")


def test_transformers_modeling_imports_beside_shiftnode_kernels():
    import shiftnode_kernels.reference  # noqa: F401  (first, as in a test session that loaded ours)

    importlib.import_module("transformers.integrations.hub_kernels")
    from transformers import LlamaForCausalLM  # noqa: F401  (the class the model-family tests use)

    assert Path(shiftnode_kernels.reference.__file__).resolve().is_relative_to(ROOT / "kernels")
