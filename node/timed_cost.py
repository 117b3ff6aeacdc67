"""The step-time model of a timed benchmark device (``--benchmark-model timed:PATH``): one loader, one formula.

A timed device computes nothing and takes, per step, the time a cost model gives for that step's work
(the idea of NVIDIA Dynamo's mocker engine: a fake engine that sleeps a modelled step time, so the
real scheduler, router and transfers run at GPU-like step times without a GPU). Everything the node
reads from the cost-model file goes through :func:`load_step_cost`, every step's seconds through
:func:`step_seconds`, so another kind of cost model can be put behind these two functions alone.

The file is a JSON object with :class:`~node.core.cost.CostModel`'s fields (``bench/cost_models/*.json``);
other keys (``calibration``, ...) are ignored. Stdlib + msgspec.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import msgspec

from node.core.cost import CostModel

__all__ = ["CostFileError", "load_step_cost", "step_seconds"]


class CostFileError(ValueError):
    """A cost-model file that cannot be read (the message names the path and the reason)."""


def load_step_cost(path: str | Path) -> CostModel:
    """Read the cost model of a timed device from the JSON file ``path``.

    Raises:
        CostFileError: no such file, not JSON, not an object, a field of the wrong type or not finite.
    """
    p = Path(path)
    if not p.is_file():
        raise CostFileError(f"cost model {str(p)!r} is not a file")
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise CostFileError(f"cost model {str(p)!r} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise CostFileError(f"cost model {str(p)!r} must hold a JSON object of CostModel fields")
    try:
        cost = msgspec.convert(data, CostModel)  # unknown keys are dropped (msgspec's default)
    except msgspec.ValidationError as e:
        raise CostFileError(f"cost model {str(p)!r}: {e}") from e
    bad = [f for f in cost.__struct_fields__ if not math.isfinite(getattr(cost, f))]
    if bad:
        raise CostFileError(f"cost model {str(p)!r}: {', '.join(bad)} must be finite")
    return cost


def step_seconds(cost: CostModel, prompt_tokens: int, decode_seqs: int, context_tokens: int) -> float:
    """Seconds of one step with ``prompt_tokens`` prompt tokens computed (chunks included) and
    ``decode_seqs`` decoding sequences holding ``context_tokens`` cached tokens in all (each counting
    the token it computes). Pure prefill and pure decode cost what the cost model says; a mixed step
    is one forward pass, so it pays the larger fixed cost once plus both variable parts::

        max(a_p, a_d) + (prefill_step_s(n) - a_p) + (decode_step_s(s, k) - a_d)

    (the formula of ``bench/sim/stepcost.py::mixed_step_s``, which the simulator uses). Never negative.
    """
    if decode_seqs <= 0:
        return max(0.0, cost.prefill_step_s(prompt_tokens))
    if prompt_tokens <= 0:
        return max(0.0, cost.decode_step_s(decode_seqs, context_tokens))
    fixed = max(cost.prefill_fixed_s, cost.decode_fixed_s)
    return max(0.0, fixed + (cost.prefill_step_s(prompt_tokens) - cost.prefill_fixed_s)
               + (cost.decode_step_s(decode_seqs, context_tokens) - cost.decode_fixed_s))
