"""bench.load.spec_decode's bookkeeping: per-round ratios of the speculating node's figures over the plain node's."""

from __future__ import annotations

import pytest

from bench.load.spec_decode import _ratios

pytestmark = pytest.mark.quick


def test_ratios_pair_rounds_and_skip_missing_values():
    plain = [{"itl": 2.0}, {"itl": None}, {"itl": 4.0}]
    spec = [{"itl": 1.0}, {"itl": 3.0}, {"itl": 1.0}]
    assert _ratios(plain, spec, "itl") == [0.5, 0.25]
