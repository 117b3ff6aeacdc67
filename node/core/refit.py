"""The online refit of the policy's cost model from the node's own measured steps (pure).

The node's driver records every step it runs: prompt steps in the prefill configuration (a window's
``(tokens, s)``) and steps in the decode configuration, decode and mixed alike, as
``(prompt tokens, decode sequences, their context tokens, s)``. :func:`fit_steps` fits them in one
least-squares problem, non-negative (:func:`node.core.cost.nonneg_least_squares`):

* **jointly**: a decode step is ``a_d + c_b b + c_k k`` and a mixed step ``a_d + e + c_b b + c_k k + c_p p``
  (``e`` the mixed step's extra fixed cost, ``max(a_p, a_d) - a_d`` in :meth:`CostModel.mixed_step_s`),
  so mixed steps inform the decode terms and decode steps the mixed ones. Before, a mixed step's prompt
  share was its time less the *current model's* decode cost, so the model fed its own error back into its
  samples: a device that mixed in nearly every step (few pure decode steps, so the decode part was never
  refitted) kept whatever decode terms it started with, and its prompt-token cost absorbed the error.
  Where prompt and decode steps run one configuration (``shared_fixed``: no decode graphs, one degree)
  there is one fixed cost and no ``e``, and prompt steps are rows of the same problem ``a + c_p n``;
  otherwise a window's steps are fitted apart (``a_p + c_p n``: the prefill configuration), and where
  there are none the mixed rows give the prompt terms (``a_p = a_d + e``).
* **identified**: where every sample is a mixed step (a device prompt-bound for the last
  :data:`node.core.online_refit.SAMPLES` steps runs no pure decode step), the intercept and ``e`` are one
  column, and only ``a_d + e`` is known. The decode intercept then keeps its value (lowered only if the
  fitted sum is below it) and ``e`` takes the rest. Before, the least-squares split put the whole eager
  mixed-step floor into ``a_d``: the policy's decode step read 14.4 ms against a true 6.5-10 ms (8B on
  simulated H200s, Mooncake conversation, TPOT 20), its step limit left chunks of ~120 tokens a third of
  the prompt rate it needed, the queue grew, every device stayed MIXED, no decode step came to correct the
  fit, and TTFT ran away (p50 10 s, issue 43; ``bench.studies.heldout``, 8B Mooncake conversation 20:8).
* **damped**: each coefficient moves at most ``max_shift`` (25 %) of the mean measured step per refit,
  measured by its contribution at the samples' mean (``|Δc_j| x mean column_j <= max_shift x mean step``),
  so one noisy window on a shared machine cannot swing the policy's chunk sizes, and a coefficient at 0
  can still grow (a relative bound could not move it).

Columns without variation in the samples (no prompt token seen yet, say) keep the base model's value.
"""

from __future__ import annotations

import msgspec

from node.core.cost import CostModel, nonneg_least_squares

__all__ = ["MAX_SHIFT", "MIN_DISTINCT", "fit_steps", "bounded"]

MAX_SHIFT = 0.25  # per refit, each coefficient's share of the mean step may move this much
MIN_DISTINCT = 5  # distinct decode-configuration step shapes before the joint fit runs


def bounded(old: list[float], new: list[float], means: list[float], ref_s: float, max_shift: float) -> list[float]:
    """``new`` coefficients moved from ``old`` by at most ``max_shift x ref_s / means[j]`` each (s per unit
    of column ``j``; ``means``: the column's mean in the samples, ``ref_s``: the mean step, s), and never
    below 0 (``max_shift`` inf: ``new`` itself). A column with mean 0 keeps its old coefficient."""
    out = []
    for o, n, mu in zip(old, new, means):
        if mu <= 0:
            out.append(o)
            continue
        if max_shift == float("inf"):  # unbounded: the fit itself
            out.append(max(0.0, n))
            continue
        step = max_shift * ref_s / mu
        out.append(max(0.0, min(max(n, o - step), o + step)))
    return out


def _fit(rows: list[list[float]], ys: list[float], old: list[float], max_shift: float) -> list[float]:
    """Non-negative least squares on the columns that vary (others keep ``old``), then :func:`bounded`."""
    n = len(old)
    means = [sum(r[j] for r in rows) / len(rows) for j in range(n)]
    live = [j for j in range(n) if any(r[j] != 0.0 for r in rows)]
    coef = list(old)
    if live:
        fit = nonneg_least_squares([[r[j] for j in live] for r in rows], ys)
        for j, c in zip(live, fit):
            coef[j] = c
    return bounded(old, coef, [means[j] if j in live else 0.0 for j in range(n)], sum(ys) / len(ys), max_shift)


def fit_steps(prefill: list[tuple[int, float]], steps: list[tuple[int, int, int, float]],
              pauses_s: list[float] | tuple[float, ...] = (), *, base: CostModel, shared_fixed: bool,
              max_shift: float = MAX_SHIFT) -> CostModel:
    """``base`` refitted from measured steps (module doc).

    Args:
        prefill: ``(prompt tokens, s)`` of each step in the prefill configuration (a window's).
        steps: ``(prompt tokens, decode sequences, their context tokens, s)`` of each step in the decode
            configuration (prompt tokens 0: a decode step).
        pauses_s: measured role-switch pauses (s); their mean becomes ``pause_s``.
        base: the current model: coefficients without samples stay, the others move from it, bounded.
        shared_fixed: prompt and decode steps run one configuration (one fixed cost, no mixed extra).
        max_shift: the damping bound (:func:`bounded`).

    Returns the refitted :class:`CostModel` (``prefill_per_token2_s`` kept from ``base``).
    """
    fields: dict[str, float] = {}
    if len({s[:3] for s in steps}) < MIN_DISTINCT:
        steps = []
    prefill_sizes = len({n for n, _ in prefill})
    if shared_fixed and (steps or prefill_sizes >= 3):
        rows = [[1.0, float(b), float(k), float(p)] for p, b, k, _ in steps] + [[1.0, 0.0, 0.0, float(n)] for n, _ in prefill]
        ys = [s for *_, s in steps] + [s for _, s in prefill]
        old = [base.decode_fixed_s, base.decode_per_seq_s, base.decode_per_context_token_s, base.prefill_per_token_s]
        a, cb, ck, cp = _fit(rows, ys, old, max_shift)
        fields.update(decode_fixed_s=a, prefill_fixed_s=a, decode_per_seq_s=cb, decode_per_context_token_s=ck,
                      prefill_per_token_s=cp)
    elif not shared_fixed:
        if steps:
            e0 = max(0.0, base.prefill_fixed_s - base.decode_fixed_s)
            old = [base.decode_fixed_s, base.decode_per_seq_s, base.decode_per_context_token_s, base.prefill_per_token_s, e0]
            if any(p == 0 for p, *_ in steps):
                rows = [[1.0, float(b), float(k), float(p), 1.0 if p else 0.0] for p, b, k, _ in steps]
                a, cb, ck, cp, e = _fit(rows, [s for *_, s in steps], old, max_shift)
            else:  # every step mixed: a_d and e are one column, so only a_d + e is known (module doc)
                rows = [[1.0, float(b), float(k), float(p)] for p, b, k, _ in steps]
                fixed, cb, ck, cp = _fit(rows, [s for *_, s in steps], [old[0] + e0] + old[1:4], max_shift)
                a = min(base.decode_fixed_s, fixed)
                e = fixed - a
            fields.update(decode_fixed_s=a, decode_per_seq_s=cb, decode_per_context_token_s=ck)
            if not prefill and any(p for p, *_ in steps):  # no window seen: the mixed rows give the prompt terms
                fields.update(prefill_fixed_s=a + e, prefill_per_token_s=cp)
        if prefill_sizes >= 3:
            a, cp = _fit([[1.0, float(n)] for n, _ in prefill], [s for _, s in prefill],
                         [base.prefill_fixed_s, base.prefill_per_token_s], max_shift)
            fields.update(prefill_fixed_s=a, prefill_per_token_s=cp)
    if pauses_s:
        fields["pause_s"] = sum(pauses_s) / len(pauses_s)
    return msgspec.structs.replace(base, **fields)
