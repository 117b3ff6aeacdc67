"""The online chunk budget of the MIXED role, and what serving a prompt queue costs as chunks or as a
prefill window (pure arithmetic: stdlib only; the adaptive role policy, :mod:`node.core.adaptive`,
reads these).

Symbols (seconds unless noted), as in :mod:`node.core.roles`: ``T = slo_margin * tpot_slo_ms / 1e3``
the per-token target; ``s`` resident sequences holding ``k`` context tokens; ``M(c) = mixed_step_s(c, s, k)``
the step time of the resident batch plus ``c`` prompt tokens (:meth:`CostModel.mixed_step_s`), ``d = M(0)``
the pure decode step; ``p`` the role-switch pause; ``P(Q)`` the prefill-configuration time of ``Q``
prompt tokens (:meth:`CostModel.prefill_s` at the prefill token budget).

**Step limit** (stall-free batching with the budget derived from the TPOT SLO, Sarathi-Serve's rule)::

    L = T                       (with residents; inf with none)

Every step of at most ``T`` gives every resident a token within ``T`` of the last, so its TPOT (vLLM's
mean over the request) stays at or under ``T``. Per-token deadlines since the first token
(``f + n*T``) would be stricter than that mean: a sequence behind them — after a prefill window, or
born into a long step — would hold the chunk at 0 until decode-only steps won the time back, which
starved prompts into TTFT windows that put the residents further behind (8B wide prompts on 4
simulated H200s at 120 req/s: SLO attainment 0.76 with deadline-driven chunks, 1.00 with ``L = T``).
When decode alone cannot meet ``T`` (``d >= T``), the SLO is lost whatever the chunks do and ``L = 2d``:
prompts and decode share the device about evenly instead of prompts starving.

**Chunk budget**: the largest ``c <= cap`` with ``M(c) <= L`` (0 when even ``M(1) > L``: no chunk fits,
the device decodes only), ``cap = max(0, max_num_batched_tokens - s)`` so a step never computes more than
``--max-num-batched-tokens`` tokens — the flag is an upper bound, no longer a knob to tune.

**Chunks or a window.** Serving ``Q`` queued prompt tokens as chunks of ``c`` costs the device, on top
of the decode steps it runs anyway, ``E_chunks = floor(Q/c) (M(c) - d) + (M(Q mod c) - d)``; as a prefill
window it costs ``E_window = 2p + P(Q)`` (the pauses there and back, and the window, during which the
residents make no progress). The cheaper is the better use of the device: a window wins for a burst or
a long prompt when the prefill configuration is faster per token than mixed steps (more instances,
larger steps, or a tight ``c``), or when ``c = 0``.
"""

from __future__ import annotations

import math

from node.core.cost import tokens_within

__all__ = ["step_limit_s", "chunk_budget", "chunks_s", "chunks_extra_s", "window_extra_s"]

INF = math.inf


def step_limit_s(residents: int, decode_s: float, T: float) -> float:
    """Longest MIXED step (s): ``L`` of the module docstring — ``T`` with residents, ``2 * decode_s``
    when decode alone misses ``T`` (``decode_s >= T``), inf with none.

    Args:
        residents: sequences decoding on the device.
        decode_s: their decode step ``d`` (s).
        T: the per-token target (s).
    """
    if residents <= 0:
        return INF
    return 2 * decode_s if decode_s >= T else T


def chunk_budget(mixed_step_s, limit_s: float, cap: int) -> int:
    """Largest chunk ``c`` in ``[0, cap]`` with ``mixed_step_s(c) <= limit_s`` (prompt tokens).

    ``mixed_step_s(c)``: seconds of the resident batch plus ``c`` prompt tokens, non-decreasing in ``c``.
    Returns ``cap`` when the whole cap fits, 0 when one token does not (:func:`node.core.cost.tokens_within`).
    """
    return tokens_within(mixed_step_s, limit_s, cap)


def chunks_s(mixed_step_s, tokens: int, chunk: int) -> float:
    """Seconds of the mixed steps that carry ``tokens`` prompt tokens in chunks of ``chunk`` (inf when
    ``chunk`` is 0 and there are tokens; 0 for none)."""
    if tokens <= 0:
        return 0.0
    if chunk <= 0:
        return INF
    full, rest = divmod(tokens, chunk)
    return full * mixed_step_s(chunk) + (mixed_step_s(rest) if rest else 0.0)


def chunks_extra_s(mixed_step_s, tokens: int, chunk: int) -> float:
    """``E_chunks``: device seconds that carrying ``tokens`` prompt tokens in chunks of ``chunk`` adds to
    the decode steps the residents run anyway (inf when ``chunk`` is 0)."""
    if tokens <= 0:
        return 0.0
    if chunk <= 0:
        return INF
    d = mixed_step_s(0)
    full, rest = divmod(tokens, chunk)
    return full * (mixed_step_s(chunk) - d) + ((mixed_step_s(rest) - d) if rest else 0.0)


def window_extra_s(prefill_s: float, pause_s: float) -> float:
    """``E_window = 2p + P(Q)``: device seconds a prefill window of ``prefill_s`` seconds costs."""
    return 2 * pause_s + prefill_s
