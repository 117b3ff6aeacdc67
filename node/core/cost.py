"""Step-time cost model shared by the role scheduler, the imbalance fallback and the simulator.

Pure arithmetic (stdlib + msgspec). The node calibrates one from measured steps
(:func:`fit_cost_model`); the simulator and the unit tests use the same Struct, so a policy sees the
same numbers live and offline.

Forms (all times in seconds):

* prefill step over ``n`` batched prompt tokens: ``a + b*n + c*n**2`` — the linear part is the
  compute-bound GEMM work, the optional quadratic part stands for attention over long chunks;
* a prefill of ``N`` tokens under a per-step token budget ``B`` runs ``floor(N/B)`` full steps and one
  remainder step (chunked prefill);
* decode step over ``s`` sequences holding ``k`` context tokens in total:
  ``a + b*s + c*k`` — a fixed weight read, per-sequence work, and KV reads proportional to context
  (the memory-bound decode of the seed note);
* a mixed step (colocated chunked prefill: ``n`` prompt tokens and ``s`` decode sequences in one forward
  pass) pays one fixed cost, the larger of the two, plus each part's variable cost:
  ``max(a_p, a_d) + (prefill_step_s(n) - a_p) + (decode_step_s(s, k) - a_d)``;
* a role switch costs ``pause_s`` (drain, swap execution configuration, configured floor).

:class:`node.core.roofline.RooflineCost` has the same interface, computed from bytes and FLOPs.
"""

from __future__ import annotations

import msgspec

__all__ = ["CostModel", "fit_cost_model", "least_squares", "nonneg_least_squares", "tokens_within"]


class CostModel(msgspec.Struct, frozen=True, kw_only=True):
    """Coefficients of the step-time model (seconds, seconds per token, seconds per sequence)."""

    prefill_fixed_s: float = 0.0
    prefill_per_token_s: float = 0.0
    prefill_per_token2_s: float = 0.0
    decode_fixed_s: float = 0.0
    decode_per_seq_s: float = 0.0
    decode_per_context_token_s: float = 0.0
    pause_s: float = 0.0

    def prefill_step_s(self, tokens: int) -> float:
        """Seconds for one prefill step over ``tokens`` batched prompt tokens (0 for none)."""
        if tokens <= 0:
            return 0.0
        return self.prefill_fixed_s + self.prefill_per_token_s * tokens + self.prefill_per_token2_s * tokens * tokens

    def prefill_s(self, tokens: int, token_budget: int) -> float:
        """Seconds to prefill ``tokens`` prompt tokens in steps of at most ``token_budget`` tokens."""
        return chunked_s(self.prefill_step_s, tokens, token_budget)

    def prefill_tokens_within(self, seconds: float, token_budget: int) -> int:
        """Most prompt tokens whose chunked prefill (:meth:`prefill_s`) fits in ``seconds``: the inverse the
        role scheduler uses to size a prefill window in tokens (:func:`tokens_within`, since ``prefill_s``
        is monotone in its token count; 2**40 when time costs nothing)."""
        return tokens_within(lambda n: self.prefill_s(n, token_budget), seconds)

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        """Seconds for one decode step of ``batch`` sequences with ``context_tokens`` cached in total."""
        if batch <= 0:
            return 0.0
        return self.decode_fixed_s + self.decode_per_seq_s * batch + self.decode_per_context_token_s * context_tokens

    def mixed_step_s(self, prompt_tokens: int, decode_seqs: int, context_tokens: int) -> float:
        """Seconds of one forward pass over ``prompt_tokens`` prompt tokens and ``decode_seqs`` decode
        sequences holding ``context_tokens`` cached tokens: one fixed cost (the larger, both stand for
        reading the weights and launching the pass) plus each part's variable cost; never negative."""
        if decode_seqs <= 0:
            return max(0.0, self.prefill_step_s(prompt_tokens))
        if prompt_tokens <= 0:
            return max(0.0, self.decode_step_s(decode_seqs, context_tokens))
        fixed = max(self.prefill_fixed_s, self.decode_fixed_s)
        return max(0.0, fixed + (self.prefill_step_s(prompt_tokens) - self.prefill_fixed_s)
                   + (self.decode_step_s(decode_seqs, context_tokens) - self.decode_fixed_s))

    def with_host_overhead(self, seconds: float) -> CostModel:
        """This model with ``seconds`` of host work added to every step (both fixed costs); itself for <= 0."""
        if seconds <= 0:
            return self
        return msgspec.structs.replace(self, prefill_fixed_s=self.prefill_fixed_s + seconds,
                                       decode_fixed_s=self.decode_fixed_s + seconds)


def chunked_s(step_s, tokens: int, token_budget: int) -> float:
    """Seconds of ``tokens`` prompt tokens in steps of at most ``token_budget`` (chunked prefill):
    ``floor(N/B)`` full steps and one remainder step, each costing ``step_s(n)``; 0 for none."""
    if tokens <= 0:
        return 0.0
    budget = max(1, token_budget)
    full, rest = divmod(tokens, budget)
    return full * step_s(budget) + step_s(rest)


def tokens_within(cost_s, seconds: float, cap: int = 1 << 40) -> int:
    """Largest ``n`` in ``[0, cap]`` with ``cost_s(n) <= seconds``, for ``cost_s`` monotone
    non-decreasing in ``n``.

    ``cap`` itself first (one evaluation when it fits), then doubling and binary search (about
    ``2 log2 n`` more); 0 for ``seconds <= 0`` or ``cap <= 0``; ``cap`` (default 2**40) when time
    costs nothing.
    """
    if seconds <= 0 or cap <= 0:
        return 0
    if cost_s(cap) <= seconds:  # the common case of a chunk budget under a loose limit: one evaluation
        return cap
    hi = 1
    while hi < cap and cost_s(hi) <= seconds:
        hi *= 2
    hi = min(hi, cap)  # cost_s(cap) > seconds (above); cost_s(hi // 2) <= seconds (or hi // 2 == 0)
    lo = hi // 2  # cost_s(lo) <= seconds (or lo == 0)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if cost_s(mid) <= seconds:
            lo = mid
        else:
            hi = mid
    return lo


def least_squares(rows: list[list[float]], ys: list[float]) -> list[float]:
    """Ordinary least squares ``argmin_x |A x - y|^2`` by the normal equations (pure Python).

    Gaussian elimination with partial pivoting on ``A^T A``; a singular column gets coefficient 0.

    Raises:
        ValueError: no samples.
    """
    if not rows:
        raise ValueError("no samples")
    ata, aty, _ = _gram(rows, ys)
    return _solve_normal(ata, aty)


def _gram(rows: list[list[float]], ys: list[float]) -> tuple[list[list[float]], list[float], float]:
    """``(A^T A, A^T y, y^T y)``: all a least-squares fit on any subset of the columns needs."""
    n = len(rows[0])
    cols = list(zip(*rows))
    ata = [[sum(a * b for a, b in zip(cols[i], cols[j])) for j in range(n)] for i in range(n)]
    aty = [sum(a * y for a, y in zip(cols[i], ys)) for i in range(n)]
    return ata, aty, sum(y * y for y in ys)


def _solve_normal(ata: list[list[float]], aty: list[float]) -> list[float]:
    """Solve ``A^T A x = A^T y`` (Gaussian elimination, partial pivoting; a singular column gets 0)."""
    n = len(aty)
    m = [ata[i] + [aty[i]] for i in range(n)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-300:
            continue
        m[col], m[piv] = m[piv], m[col]
        for r in range(n):
            if r != col and m[r][col] != 0.0:
                f = m[r][col] / m[col][col]
                m[r] = [a - f * b for a, b in zip(m[r], m[col])]
    return [m[i][n] / m[i][i] if abs(m[i][i]) >= 1e-300 else 0.0 for i in range(n)]


def fit_cost_model(
    prefill_samples: list[tuple[int, float]],
    decode_samples: list[tuple[int, int, float]],
    pause_samples_s: list[float] | tuple[float, ...] = (),
    *,
    quadratic: bool = False,
    base: CostModel | None = None,
    nonneg: bool = False,
    shared_fixed: bool = False,
) -> CostModel:
    """Calibrate a :class:`CostModel` from measured steps.

    Args:
        prefill_samples: ``(batched prompt tokens, step seconds)`` per prefill step.
        decode_samples: ``(batch size, total context tokens, step seconds)`` per decode step.
        pause_samples_s: measured role-switch pauses (s); their mean becomes ``pause_s``.
        quadratic: also fit the ``tokens**2`` prefill term.
        base: coefficients kept for any part without samples.
        nonneg: keep every fitted coefficient >= 0 (:func:`nonneg_least_squares`). The node's online
            refit needs it: its decode samples have context growing with batch (nearly collinear
            columns), and on a loaded CPU plain least squares returned, e.g., +3.4 ms per sequence and
            -48 us per context token, a decode step of -73 ms at 20 sequences, which the adaptive
            policy read as a 73 ms mixed-step penalty (and so gathered prompts for ~300 ms).
        shared_fixed: prompt and decode steps run one execution configuration (no decode graphs: a
            prompt row is one more row of the same forward pass), so they share one fixed cost: the
            prefill intercept is the decode one (fitted, or ``base``'s) and only the per-token terms
            are fitted to ``step - a_d``. Two intercepts fitted apart differ by noise, and
            ``max(a_p, a_d) - a_d`` then reads as a mixed-step penalty that is not there (the adaptive
            policy's gathering time ``G`` grows with it: node.core.chunk_budget.gather_s). Without
            prompt samples the prefill intercept is still the fitted decode one.
    """
    solve = nonneg_least_squares if nonneg else least_squares
    out = base or CostModel()
    fields: dict[str, float] = {}
    if decode_samples:
        rows = [[1.0, float(b), float(k)] for b, k, _ in decode_samples]
        coef = solve(rows, [s for _, _, s in decode_samples])
        fields.update(decode_fixed_s=coef[0], decode_per_seq_s=coef[1], decode_per_context_token_s=coef[2])
    if prefill_samples and shared_fixed:
        a = fields.get("decode_fixed_s", out.decode_fixed_s)
        rows = [[float(n)] + ([float(n) * n] if quadratic else []) for n, _ in prefill_samples]
        coef = solve(rows, [s - a for _, s in prefill_samples])
        fields.update(prefill_fixed_s=a, prefill_per_token_s=coef[0], prefill_per_token2_s=coef[1] if quadratic else 0.0)
    elif prefill_samples:
        rows = [[1.0, float(n)] + ([float(n) * n] if quadratic else []) for n, _ in prefill_samples]
        coef = solve(rows, [s for _, s in prefill_samples])
        fields.update(prefill_fixed_s=coef[0], prefill_per_token_s=coef[1],
                      prefill_per_token2_s=coef[2] if quadratic else 0.0)
    elif shared_fixed and "decode_fixed_s" in fields:
        # no prompt samples yet: the prompt rows keep base's per-token terms but share the fitted intercept
        # (a stories260k CPU node with 32-token prompts, before three prompt sizes were seen: base's 2 ms
        # against a fitted ~1 ms read as a 1 ms mixed-step penalty, and prompts were gathered ~10 ms)
        fields["prefill_fixed_s"] = fields["decode_fixed_s"]
    if pause_samples_s:
        fields["pause_s"] = sum(pause_samples_s) / len(pause_samples_s)
    return msgspec.structs.replace(out, **fields)


def nonneg_least_squares(rows: list[list[float]], ys: list[float]) -> list[float]:
    """Least squares with every coefficient >= 0: ``argmin_{x >= 0} |A x - y|^2`` (pure Python).

    Exact for the few columns of a cost model: the constrained optimum is the unconstrained least-squares
    fit on its own support, so every subset of columns is fitted (:func:`least_squares`) and the
    feasible fit of least squared residual is kept (all zeros when none is feasible).

    Raises:
        ValueError: no samples, or more than 6 columns (2**n subsets).
    """
    if not rows:
        raise ValueError("no samples")
    n = len(rows[0])
    if n > 6:
        raise ValueError("nonneg_least_squares enumerates column subsets: at most 6 columns")
    # One pass over the samples: every subset's fit and residual come from the Gram matrix, since
    # |A x - y|^2 = y'y - 2 x'A'y + x'A'A x (the online refit ran this over 2 x 256 samples on the node's
    # event loop: 2.3 ms a refit when each subset summed the samples again)
    ata, aty, yty = _gram(rows, ys)
    best, best_sse = [0.0] * n, yty
    for mask in range(1, 1 << n):
        cols = [j for j in range(n) if mask >> j & 1]
        coef = _solve_normal([[ata[i][j] for j in cols] for i in cols], [aty[i] for i in cols])
        if min(coef) < 0:
            continue
        x = [0.0] * n
        for j, c in zip(cols, coef):
            x[j] = c
        sse = yty - 2 * sum(x[i] * aty[i] for i in range(n)) + sum(
            x[i] * ata[i][j] * x[j] for i in range(n) for j in range(n))
        if sse < best_sse:
            best, best_sse = x, sse
    return best
