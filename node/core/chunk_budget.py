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

**Efficient chunk** (the budget a MIXED step actually uses): ``u(c) = (M(c) - d) / c`` is the device
time each prompt token adds to the step the residents run anyway. On a device whose mixed steps run
eagerly while decode replays graphs (``M(1) - d`` is the eager penalty ``e``), ``u`` falls while the
step sits on the launch floor and rises once attention and compute grow, so the cheapest chunk is the
knee, ``c* = argmin u(c)`` over ``1 <= c <= c_L`` (the largest of equals). A larger chunk only lengthens
the step — each resident waits longer per token and holds its sequence slot and KV longer (Little's
law), for no prompt throughput — and a smaller one pays the floor for fewer tokens. On a linear cost
model ``u`` falls to ``c_L``, so ``c* = c_L``. (1B prompts from 32 to 7,000 tokens on 4 simulated H200s
at 560 req/s: SLO attainment 0.85 with ``c_L`` ~ 8,000, 0.98 with ``c*`` ~ 1,250; colocated's tuned
budget there is 2,048.)

**Keeping up.** ``c*`` is the cheapest per token, not the fastest: where prompts arrive faster than
``c*``-chunks carry them (every step mixed and the queue still growing), the chunk grows to the
smallest ``c`` in ``[c*, c_T]`` whose chunks serve the device's backlog (its queue plus its share of
the waiting prompts that some device has the slots and KV to take) within ``KEEP_UP_SHARE`` of the
TTFT SLO (:mod:`node.core.adaptive`), ``c_T`` if none does. Prompts that wait for sequence slots or
KV are no prefill backlog: a larger chunk would not admit them sooner, only slow every resident. (8B
prompts from 32 to 7,000 tokens on 4 simulated H200s at 127 req/s: SLO attainment 0.71 with ``c*``
~ 400 alone.) ``c_T`` (:func:`fastest_chunk`) is the chunk in ``[c*, c_L]`` that carries prompt
tokens fastest, ``argmax c / M(c)``: attention within a chunk grows with its square, so past ``c_T``
a larger chunk lengthens every step *and* drains the queue more slowly (1B, the Azure code trace, 4
simulated H200s at TPOT 50 ms and 290 req/s: SLO attainment 0.74 growing to ``c_L``, 45 ms steps;
1.00 stopping at ``c_T``, 16 ms).

**Gathering.** A mixed step that carries fewer than ``c*`` tokens pays the whole eager penalty ``e`` for
them. Like a role-switch pause, the penalty's share of device time is bounded by ``max_pause_share``
``s``: a device holds a partial queue in DECODE until it fills ``c*``, or its oldest prompt has waited
``G = e (1 - s) / s``, or ``G`` has passed since the device last ran MIXED — so mixed steps are at least
``G`` apart and ``e / (G + e) <= s``, and a lone prompt after a quiet spell is not held for nothing
(one CPU device, stories260k, 32-token prompts at 10 req/s: the node's refitted cost model gave ``G``
near 100 ms, and a prompt arriving in DECODE waited a median 106 ms to be mixed, saving no mixed step). Where
prompt and decode steps are one forward configuration (no decode graphs, one degree: the CPU node),
``e`` is one prompt token's cost (the node's refit gives both one fixed cost: ``fit_cost_model``'s
``shared_fixed``), so ``G`` is microseconds and prompts there are not held. (1B 128-token prompts on 4 simulated H200s at 1,200 req/s: ``e`` ~ 4 ms, ``G``
~ 17 ms; SLO attainment 0.58 mixing every step, 1.00 gathering.)

**Spacing** (where no chunk fits ``T`` but decode alone does: ``M(1) > T > d``, e.g. the 70B's eager
floor, ~36 ms, against a TPOT SLO of 20 ms). The SLO bounds each request's *mean* token gap, not every
gap: a mixed step of ``m > T`` followed by decode steps of ``d < T`` keeps the mean at ``T`` when
``m - T`` is won back, ``(m - T) / (T - d)`` decode steps later. So the device runs a mixed step of
the efficient chunk ``c*`` over ``[1, c_W]`` (``c_W``: the largest with ``M(c) <= Wmax``, the window
bound), then decodes at least ``S = (m - T) d / (T - d)`` seconds before the next (:func:`spacing_s`; where
``S > Wmax``, decode barely meets ``T`` and there is nothing to win back with: ``c = 0`` as before),
and only while every resident would still meet its own mean with its remaining tokens at ``d`` (a
step ends by ``f + (N - 1) τ - (N - n - 1) d``; ``τ`` the TPOT SLO, ``f`` its first token, ``n`` out,
``N`` expected: a
short-output request cannot win a long step back; Azure code trace, 70B at degree 4, TPOT 20 ms,
0.54 req/s: SLO attainment 0.68 with the device's spacing alone, p90 TPOT 32 ms; 0.91 with this),
instead of stopping every resident for a prefill window of the same tokens in the same configuration
(a window at ``P = D`` costs about ``M(c) - d`` too, and gives the residents no token). Chunked
prefill tuned this way wins where the SLO's mean allows (70B, conversation trace, 8 simulated
H200s at degree 8, TPOT 20 ms: colocated at 4,096 tokens holds a p90 TPOT of 19.5 ms with 171 ms
mixed steps, where the windows the adaptive policy opened instead, ``c = 0``, gave 0.60 SLO
attainment at 8.3 req/s).

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

__all__ = ["step_limit_s", "chunk_budget", "efficient_chunk", "fastest_chunk", "keep_up_chunk",
           "gather_s", "spacing_s", "mean_budget_s", "hold_s", "chunks_s", "chunks_extra_s", "window_extra_s"]

GRID_RATIO = 2 ** 0.25  # the efficient chunk's search grid: chunks 19 % apart

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


def efficient_chunk(mixed_step_s, limit: int, ratio: float = GRID_RATIO) -> int:
    """``c*``: the chunk in ``[1, limit]`` of least extra device time per prompt token
    ``u(c) = (M(c) - M(0)) / c`` (prompt tokens; the largest of equals; 0 for ``limit <= 0``).

    ``mixed_step_s(c)``: seconds of the resident batch plus ``c`` prompt tokens (``M``). Searched on the
    geometric grid ``limit, limit / ratio, ...`` down to 1 (``u`` need not be unimodal), so ``c*`` is
    within a factor ``ratio`` of the exact argmin; ``limit`` itself is always a candidate.
    """
    if limit <= 0:
        return 0
    d = mixed_step_s(0)
    best_c, best_u = 0, INF
    c = float(limit)
    while c >= 1:
        n = int(c)
        u = (mixed_step_s(n) - d) / n
        if u < best_u * (1 - 1e-12):  # from the largest chunk down: the largest of (near) equals wins
            best_c, best_u = n, u
        c /= ratio
    return best_c


def fastest_chunk(mixed_step_s, lo: int, hi: int, ratio: float = GRID_RATIO) -> int:
    """``c_T``: the chunk in ``[lo, hi]`` that carries prompt tokens fastest, ``argmax c / M(c)`` (prompt
    tokens; the largest of equals; ``hi`` when ``lo >= hi``). Searched on the grid ``hi, hi / ratio, ...``
    down to ``lo`` (and ``lo`` itself), as :func:`efficient_chunk`.

    ``M(c) = d + e + a c + b c^2`` (attention within the chunk is quadratic) has ``M(c) / c`` least at
    ``c = sqrt((d + e) / b)``: past it a larger chunk lengthens every step *and* carries the queue more
    slowly. On a linear model ``M(c) / c`` only falls, so ``c_T = hi``.
    """
    if lo >= hi:
        return hi
    best_c, best_t = hi, hi / max(mixed_step_s(hi), 1e-12)
    c = hi / ratio
    while c > lo:
        n = int(c)
        t = n / max(mixed_step_s(n), 1e-12)
        if t > best_t * (1 + 1e-12):
            best_c, best_t = n, t
        c /= ratio
    if lo / max(mixed_step_s(lo), 1e-12) > best_t * (1 + 1e-12):
        best_c = lo
    return best_c


def keep_up_chunk(mixed_step_s, tokens: int, lo: int, hi: int, seconds: float) -> int:
    """Smallest chunk ``c`` in ``[lo, hi]`` whose mixed steps carry ``tokens`` prompt tokens within
    ``seconds`` (:func:`chunks_s`), ``hi`` if none does (``lo`` when ``lo >= hi``); bisection, taking
    :func:`chunks_s` as non-increasing in ``c``."""
    if lo >= hi or chunks_s(mixed_step_s, tokens, lo) <= seconds:
        return lo
    a, b = lo, hi  # chunks_s(a) > seconds; answer in (a, b]
    while b - a > 1:
        mid = (a + b) // 2
        if chunks_s(mixed_step_s, tokens, mid) <= seconds:
            b = mid
        else:
            a = mid
    return b


def gather_s(penalty_s: float, share: float) -> float:
    """``G = e (1 - s) / s``: how long a partial queue may wait for company so that a MIXED step's
    penalty ``e = M(1) - M(0)`` (s) takes at most the share ``s`` of device time (0 when ``e <= 0``).

    Raises:
        ValueError: ``share`` not in (0, 1].
    """
    if not 0 < share <= 1:
        raise ValueError("share must be in (0, 1]")
    return max(0.0, penalty_s) * (1 - share) / share


def spacing_s(step_s: float, decode_s: float, T: float) -> float:
    """``S = (m - T) d / (T - d)``: seconds of decode steps (of ``d = decode_s``) that win back a mixed
    step of ``m = step_s`` longer than the per-token target ``T`` (s), so the mean gap stays <= ``T``
    (0 when ``m <= T``).

    Raises:
        ValueError: ``decode_s >= T`` (decode alone misses ``T``: nothing can be won back).
    """
    if decode_s >= T:
        raise ValueError("decode_s must be below T")
    return max(0.0, step_s - T) * decode_s / (T - decode_s)


def mean_budget_s(first_token_s: float, out: int, expected: int, tpot_slo_s: float, decode_s: float) -> float:
    """Latest end (s) of a resident's next step that leaves its mean token gap within the TPOT SLO ``τ``
    (``tpot_slo_s``) if its other tokens come every ``d`` (``decode_s``): ``f + (N - 1) τ - (N - n - 1) d``
    (``f`` its first token, ``n = out`` tokens out, ``N = expected``, at least ``n + 1``: an unknown length
    may end with the next token). The SLO itself, not ``T``: ``d`` is already optimistic for later tokens
    only if no later step is long, which the spacing ``S`` and this check on every later step see to (Azure
    conversation trace, 70B at degree 8, 9 req/s: SLO attainment 0.84 with ``T``, TTFT-bound; 0.92 with ``τ``)."""
    N = max(expected, out + 1)
    return first_token_s + (N - 1) * tpot_slo_s - (N - out - 1) * decode_s


def hold_s(residents, budgets: list[float], t0: float, step_s: float, decode_s: float) -> float:
    """How long (s) from ``t0`` a spaced device holds its queue: until every resident (``residents``, with
    ``output_tokens`` and ``expected_output_tokens``) whose budget (``budgets``, :func:`mean_budget_s`)
    cannot absorb a mixed step of ``step_s`` from ``t0`` has ended, its remaining ``N - n`` tokens at ``d``
    (``decode_s``); 0 when none blocks. Decode steps do not win such a step back: the budget already counts
    every later token at ``d``, so it moves with the clock, and only the resident's end (or its running
    past ``N``, where its budget grows by ``τ - d`` a token) frees the device."""
    return max(((max(r.expected_output_tokens, r.output_tokens + 1) - r.output_tokens) * decode_s
                for r, b in zip(residents, budgets) if b - t0 < step_s), default=0.0)


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
