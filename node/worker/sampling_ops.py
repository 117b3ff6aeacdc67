"""Row-parallel torch operations of the batched sampler (no host syncs, no Python loops over rows).

Shapes: ``N`` rows, ``V`` vocabulary, ``K`` sorted candidates per row, ``G = GROUP`` tokens per group.

Draws are *inverse-transform sampling* with one uniform ``u`` per row: the token is the first whose
cumulative (float64) mass exceeds ``u`` times the row's total. Every quantity a row's token depends
on is computed from that row alone and in an order fixed by the row (vocabulary order, or the
canonical order "logit descending, then token id ascending"), so a row draws the same token whatever
else is in the batch. Plain rows (no top-k/top-p) walk the vocabulary in id order in two levels
(group masses, then the tokens of one group), so no sort is needed; filtered rows walk their sorted
candidates. The residue of batch dependence is float rounding where torch picks a reduction or
vector-tail path by tensor shape: it can move a cumulative sum by an ulp, which changes a token only
when ``u`` falls within that ulp of a boundary (about 1e-7 relative, per token).
"""

from __future__ import annotations

import torch

GROUP = 16  # tokens per group: group maxima and masses cut full-vocabulary passes to V/16 work


def apply_penalties(x: torch.Tensor, rows: torch.Tensor | None, repetition: torch.Tensor, presence: torch.Tensor,
                    frequency: torch.Tensor, output_index: torch.Tensor, seen_index: torch.Tensor | None) -> None:
    """Repetition, then presence/frequency penalties, in place on rows ``rows`` of ``x [N, V]`` float32.

    Repetition (CTRL, Keskar et al. 2019, as in HF and vLLM): over tokens seen in the prompt or the
    output, positive logits are divided by the penalty and the others multiplied. Presence/frequency
    (OpenAI): ``logit -= frequency * count + presence * (count > 0)`` over output-token counts.
    Counts come from ``scatter_add_`` of the flat ``row * V + token`` indexes. A row without a penalty
    carries 1.0 / 0.0, which leaves its logits bit-for-bit unchanged.

    Args:
        rows: ``[P]`` int64 rows to penalize, or None for all ``N`` (then ``P == N``).
        repetition, presence, frequency: ``[P, 1]`` float32.
        output_index: ``[n]`` int64 flat indexes of output tokens. seen_index: same over prompt and
            output tokens of rows with a repetition penalty (None: no row has one).
    """
    v = x.shape[1]
    sub = x if rows is None else x.index_select(0, rows)
    p = sub.shape[0]
    counts = torch.zeros(p * v, dtype=x.dtype, device=x.device)
    counts.scatter_add_(0, output_index, torch.ones_like(output_index, dtype=x.dtype))
    counts = counts.view(p, v)
    if seen_index is not None:
        seen = torch.zeros(p * v, dtype=x.dtype, device=x.device)
        seen.scatter_add_(0, seen_index, torch.ones_like(seen_index, dtype=x.dtype))
        seen = seen.view(p, v) > 0
        sub.copy_(torch.where(seen & (sub > 0), sub / repetition, torch.where(seen, sub * repetition, sub)))
    sub -= frequency * counts + presence * (counts > 0).to(x.dtype)
    if rows is not None:
        x.index_copy_(0, rows, sub)


def canonical_key(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """int64 keys whose descending order is "value descending, then id ascending" (unique per id).

    ``values`` float32, ``ids`` int64 in ``[0, 2**32)``, same shape. The float's bits are mapped to
    an order-preserving int32 (negative floats have their magnitude bits flipped), placed in the high
    32 bits, above ``2**32 - 1 - id``. NaN sorts above everything (such rows are degenerate anyway).
    """
    bits = values.contiguous().view(torch.int32)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)
    return ordered * (1 << 32) + (0xFFFFFFFF - ids)


def sorted_prefix(y: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest entries of each row of ``y [N, V]`` float32, in canonical order.

    Two stages (exact): the ``k`` groups of ``GROUP`` tokens with the largest (max, -group index) hold
    the row's canonical top ``k`` (each of those tokens lies in a group whose max is at least the
    ``k``-th value, and among groups tied at it the lower indexes hold the lower ids); the canonical
    top ``k`` of those ``k * GROUP`` candidates (plus the ragged last ``V % GROUP`` tokens) follows.
    ``k == V`` is a full canonical sort. Returns values ``[N, k]`` float32 and ids ``[N, k]`` int64.
    """
    n, v = y.shape
    dev = y.device
    if k >= v:
        ids = torch.arange(v, device=dev).expand(n, v)
        order = canonical_key(y, ids).sort(dim=1, descending=True).indices
        return y.gather(1, order), order
    ng = v // GROUP
    groups = min(ng, k)
    gmax = y[:, : ng * GROUP].view(n, ng, GROUP).amax(dim=2)
    gsel = canonical_key(gmax, torch.arange(ng, device=dev).expand(n, ng)).topk(groups, dim=1).indices
    cand = (gsel.unsqueeze(2) * GROUP + torch.arange(GROUP, device=dev)).view(n, groups * GROUP)
    if v > ng * GROUP:
        cand = torch.cat([cand, torch.arange(ng * GROUP, v, device=dev).expand(n, v - ng * GROUP)], dim=1)
    cvals = y.gather(1, cand)
    sel = canonical_key(cvals, cand).topk(k, dim=1).indices
    return cvals.gather(1, sel), cand.gather(1, sel)


def group_masses(w: torch.Tensor) -> torch.Tensor:
    """Sums of ``w [N, V]`` float32 over consecutive groups of ``GROUP`` tokens → ``[N, ceil(V / GROUP)]``."""
    n, v = w.shape
    ng = v // GROUP
    g = w[:, : ng * GROUP].view(n, ng, GROUP).sum(dim=2)
    if v > ng * GROUP:
        g = torch.cat([g, w[:, ng * GROUP :].sum(dim=1, keepdim=True)], dim=1)
    return g


def _pick(weights: torch.Tensor, cum: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Index of the first entry of each row whose cumulative mass ``cum [N, M]`` float64 (of
    ``weights [N, M]``) exceeds ``target [N, 1]``; never an entry of zero weight (a target at the
    total, by rounding, takes the last positive entry). Returns ``[N, 1]`` int64."""
    j = torch.searchsorted(cum, target.contiguous(), right=True)
    idx = torch.arange(weights.shape[1], device=weights.device)
    last = torch.where(weights > 0, idx, -1).amax(dim=1, keepdim=True)
    return torch.minimum(j, last).clamp_(min=0)


def float32_ceil(x: torch.Tensor) -> torch.Tensor:
    """Smallest float32 ``>= x`` (float64): for float32 ``y``, ``y < float32_ceil(x)`` iff ``y < x``."""
    t = x.to(torch.float32)
    return torch.where(t.to(torch.float64) < x, torch.nextafter(t, torch.full_like(t, float("inf"))), t)


def exp_shifted(y: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``exp(y - m)`` float32 ``[N, V]`` for row maxima ``m [N, 1]`` (the unnormalized probabilities)."""
    return torch.sub(y, m).exp_()


def draw_plain(y: torch.Tensor, m: torch.Tensor, uniform: torch.Tensor, log_min_p: torch.Tensor | None) -> torch.Tensor:
    """Draw from ``softmax(y)`` over the whole vocabulary (min-p applied when given), in id order.

    Args:
        y: ``[N, V]`` float32 temperature-scaled logits. m: ``[N, 1]`` their row maxima.
        uniform: ``[N]`` float64 in ``[0, 1)``. log_min_p: ``[N, 1]`` float64 or None; tokens with
            ``y < m + ln(min_p)`` are dropped (min-p, Nguyen et al. 2024: ``p < min_p * p_max``).
    Returns ``[N]`` int64 token ids (meaningless for rows whose ``m`` is not finite).
    """
    n, v = y.shape
    w = exp_shifted(y, m)
    if log_min_p is not None:
        w.masked_fill_(y < float32_ceil(m.to(torch.float64) + log_min_p), 0.0)
    masses = group_masses(w)
    cum = masses.to(torch.float64).cumsum(dim=1)
    target = uniform.view(n, 1) * cum[:, -1:]
    g = _pick(masses, cum, target)
    below = torch.where(g > 0, cum.gather(1, (g - 1).clamp(min=0)), torch.zeros_like(target))
    cols = g * GROUP + torch.arange(GROUP, device=y.device)
    inside = w.gather(1, cols.clamp(max=v - 1)) * (cols < v)
    j = _pick(inside, inside.to(torch.float64).cumsum(dim=1), target - below)
    return (g * GROUP + j).view(n)


def full_mass(y: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``sum(exp(y - m))`` per row of ``y [N, V]`` float32 → ``[N]`` float64 (group sums, then a
    sequential float64 sum over groups)."""
    return group_masses(exp_shifted(y, m)).to(torch.float64).cumsum(dim=1)[:, -1]


def filter_sorted(ys: torch.Tensor, m: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  log_min_p: torch.Tensor, has_top_k: torch.Tensor, has_top_p: torch.Tensor,
                  mass: torch.Tensor | None, complete: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k → top-p → min-p masks (vLLM's order) over sorted candidates; whether they are conclusive.

    Every filter keeps a prefix of the canonical order, so the kept set is one too. Top-k keeps
    values ``>= `` the k-th (ties included, as ``torch.topk``-then-mask does); top-p (Holtzman et al.
    2020) keeps a position while the mass strictly before it, renormalized over the top-k set, is
    below ``top_p`` (the first always stays); min-p keeps ``y >= m + ln(min_p)``.

    Args:
        ys: ``[N, K]`` float32 candidates in canonical order (``K`` largest of ``V``).
        m: ``[N, 1]`` float32 row maxima. top_k: ``[N]`` int64 (0: off, else ``< K``).
        top_p: ``[N, 1]`` float64. log_min_p: ``[N, 1]`` float64. has_top_k, has_top_p: ``[N]`` bool.
        mass: ``[N]`` float64 whole-row ``sum(exp(y - m))`` (needed by rows with top-p and no top-k).
        complete: the candidates are the whole row (``K == V``).
    Returns:
        ``weights [N, K]`` float64 (``exp(y - m)`` where kept, else 0), ``covered [N]`` bool (the kept
        set provably lies inside the candidates, so the weights are exact).
    """
    n, kk = ys.shape
    y64 = ys.to(torch.float64)
    e = torch.exp(y64 - m.to(torch.float64))
    kth = ys.gather(1, (top_k - 1).clamp(min=0, max=kk - 1).view(n, 1))
    keep_k = (ys >= kth) | ~has_top_k.view(n, 1)
    cov_k = has_top_k & (ys[:, -1:] < kth).view(n)
    ek = e * keep_k
    cum_k = ek.cumsum(dim=1)
    z = cum_k.gather(1, (keep_k.sum(dim=1, keepdim=True) - 1).clamp(min=0)).view(n)
    if mass is not None:
        z = torch.where(has_top_k, z, mass)
    probs = ek / z.view(n, 1)
    cum_p = probs.cumsum(dim=1)
    keep_p = ((cum_p - probs) < top_p) | ~has_top_p.view(n, 1)
    cov_p = has_top_p & (cum_p[:, -1:] >= top_p).view(n)
    floor = m.to(torch.float64) + log_min_p
    keep_m = y64 >= floor
    cov_m = (y64[:, -1:] < floor).view(n)
    kept = keep_k & keep_p & keep_m
    if complete:
        covered = torch.ones(n, dtype=torch.bool, device=ys.device)
    else:
        # A top-k set reaching past the candidates leaves z (and so top-p) unknown.
        covered = cov_k | (~has_top_k & cov_p) | (cov_m & ~(has_top_k & has_top_p))
    return e * kept, covered


def draw_sorted(weights: torch.Tensor, ids: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-transform draw over kept candidates: ``weights [N, K]`` float64, ``ids [N, K]`` int64,
    ``uniform [N]`` float64 → ``[N]`` int64 token ids."""
    n = weights.shape[0]
    cum = weights.cumsum(dim=1)
    return ids.gather(1, _pick(weights, cum, uniform.view(n, 1) * cum[:, -1:])).view(n)
