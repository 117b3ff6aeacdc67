"""The step-time model of a timed benchmark device (``--benchmark-model timed:PATH``): one loader, one formula.

A timed device computes nothing and takes, per step, the time a cost model gives for that step's work
(the idea of NVIDIA Dynamo's mocker engine: a fake engine that sleeps a modelled step time, so the
real scheduler, router and transfers run at GPU-like step times without a GPU). Everything the node
reads from the cost-model file goes through :func:`load_step_cost`, every step's seconds through
:func:`step_seconds`, so another kind of cost model can be put behind these two functions alone.

The file is a JSON object of a cost model of either kind (``bench/cost_models/*.json``: a linear
:class:`~node.core.cost.CostModel`, or a :class:`~node.core.roofline.RooflineCost` with ``"kind":
"roofline"``); other keys (``calibration``, ...) are ignored. Stdlib + msgspec.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from node.core.cost import CostModel
from node.core.roofline import RooflineCost, cost_model_from_dict

__all__ = ["CostFileError", "load_step_cost", "step_seconds"]


class CostFileError(ValueError):
    """A cost-model file that cannot be read (the message names the path and the reason)."""


def load_step_cost(path: str | Path) -> CostModel | RooflineCost:
    """Read the cost model of a timed device from the JSON file ``path`` (either kind:
    :func:`node.core.roofline.cost_model_from_dict`).

    Raises:
        CostFileError: no such file, not JSON, not an object, an unknown kind, no field of the model
            at all, a field of the wrong type, negative, out of range or not finite.
    """
    p = Path(path)
    if not p.is_file():
        raise CostFileError(f"cost model {str(p)!r} is not a file")
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise CostFileError(f"cost model {str(p)!r} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise CostFileError(f"cost model {str(p)!r} must hold a JSON object of cost-model fields")
    try:
        cost = cost_model_from_dict(data)  # unknown keys are dropped
    except ValueError as e:
        raise CostFileError(f"cost model {str(p)!r}: {e}") from e
    if not set(data) & set(cost.__struct_fields__):
        raise CostFileError(f"cost model {str(p)!r} names none of the {type(cost).__name__} fields "
                            f"({', '.join(cost.__struct_fields__)})")
    bad = [f for f in cost.__struct_fields__ if isinstance(getattr(cost, f), float)
           and not (math.isfinite(getattr(cost, f)) and getattr(cost, f) >= 0)]
    if bad:
        raise CostFileError(f"cost model {str(p)!r}: {', '.join(bad)} must be finite and at least 0 (seconds)")
    return cost


def step_seconds(cost: CostModel | RooflineCost, prompt_tokens: int, decode_seqs: int, context_tokens: int) -> float:
    """Seconds of one step with ``prompt_tokens`` prompt tokens computed (chunks included) and
    ``decode_seqs`` decoding sequences holding ``context_tokens`` cached tokens in all (each counting
    the token it computes): the cost model's ``mixed_step_s``, what the simulator charges the same
    step (``bench/sim/stepcost.py``). Never negative."""
    return max(0.0, cost.mixed_step_s(prompt_tokens, decode_seqs, context_tokens))
