"""Verifying drafts: which sampled rows a verify item keeps, and (statistically) that the kept tokens have
the distribution sampling without speculation gives them: speculative sampling with a point-mass draft."""

from __future__ import annotations

import math

import pytest
import torch

from node.core.sequence import SamplingParams
from node.worker.sample_request import SampleRequest
from node.worker.sampler import sample
from node.worker.spec_verify import accepted, verify_requests

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here


def test_keeps_the_matched_drafts_then_the_token_after_them():
    assert accepted([4, 5, 6], [4, 5, 6, 9]) == 4  # every draft matched: the bonus too
    assert accepted([4, 5, 6], [4, 8, 6, 9]) == 2  # 4 matched, 8 corrects 5
    assert accepted([4, 5, 6], [7, 5, 6, 9]) == 1  # the first draft rejected: the correction only
    assert accepted([], [3]) == 1


def test_each_row_sees_the_drafts_before_it():
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=3)
    req = SampleRequest(params, [1, 2, 3], 2, 1)
    rows = verify_requests(req, [7, 8])
    assert [r.token_ids for r in rows] == [[1, 2, 3], [1, 2, 3, 7], [1, 2, 3, 7, 8]]
    assert [r.output_index for r in rows] == [1, 2, 3]
    assert req.token_ids == [1, 2, 3]  # the engine's history is not touched


def _chi2_p_value(stat: float, df: int) -> float:
    """Upper tail of chi-square(df) at ``stat``, by the Wilson-Hilferty normal approximation."""
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


V = 6  # a toy vocabulary: a Markov chain whose next-token logits depend on the last token


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=8, temperature=0.9),
                                    SamplingParams(max_tokens=8, temperature=1.0, top_k=4),
                                    SamplingParams(max_tokens=8, temperature=1.0, top_p=0.8)],
                         ids=["temperature", "top_k", "top_p"])
def test_the_first_two_kept_tokens_have_the_distribution_of_plain_sampling(params):
    """The chain's logits table stands in for the model: row ``j`` of a verify item holds the logits after
    the drafts before it. Verify items (drafts ``[d1, d2]``) run through the real sampler in batches; where
    only one token is kept, the second comes from a plain sampled step after it, as the next step would
    draw it. The joint distribution of the first two tokens must equal the chain's exact one (a
    chi-square test, seeded), with both outcomes (accepted and rejected drafts) well represented."""
    gen = torch.Generator().manual_seed(1234)
    table = torch.randn(V, V, generator=gen) * 1.5
    start, draft, n = 0, [2, 3], 24_000

    def probs(row: torch.Tensor) -> torch.Tensor:  # the exact distribution the sampler draws from
        x = row / params.temperature
        p = torch.softmax(x.double(), -1)
        if params.top_k:
            keep = torch.zeros(V, dtype=torch.bool)
            keep[torch.topk(p, params.top_k).indices] = True
            p = torch.where(keep, p, 0)
        if params.top_p < 1.0:
            order = torch.argsort(p, descending=True)
            cum = torch.cumsum(p[order], 0)
            keep = torch.zeros(V, dtype=torch.bool)
            keep[order[(cum - p[order]) < params.top_p * p.sum()]] = True
            p = torch.where(keep, p, 0)
        return p / p.sum()

    expected = torch.stack([probs(table[start])[a] * probs(table[a]) for a in range(V)]).flatten()

    history = [9, start]  # prompt [9], one output so far (the last token, ``start``); ids >= V never drawn
    req = SampleRequest(params, history, 1, 1)
    rows = verify_requests(req, draft)  # 3 rows: after start, after d1, after d2
    logits = torch.stack([table[start], table[draft[0]], table[draft[1]]]).repeat(n, 1)
    toks, _ = sample(logits.clone(), rows * n, gen)
    firsts, seconds, need = [], [None] * n, []
    kept_lengths = []
    for t in range(n):
        got = toks[3 * t : 3 * t + 3]
        a = accepted(draft, got)
        kept_lengths.append(a)
        firsts.append(got[0])
        if a >= 2:
            seconds[t] = got[1]
        else:
            need.append(t)
    # where one token was kept, the next step samples after it (plain, no drafts)
    more = [SampleRequest(params, history + [firsts[t]], 1, 2) for t in need]
    nxt, _ = sample(torch.stack([table[firsts[t]] for t in need]), more, gen) if need else ([], [])
    for t, tok in zip(need, nxt):
        seconds[t] = tok
    counts = torch.zeros(V * V, dtype=torch.float64)
    for a, b in zip(firsts, seconds):
        counts[a * V + b] += 1
    exp = expected * n
    cells = exp > 0
    assert counts[~cells].sum() == 0, "a pair the distribution excludes was produced"
    stat = float(((counts[cells] - exp[cells]) ** 2 / exp[cells]).sum())
    df = int(cells.sum()) - 1
    p = _chi2_p_value(stat, df)
    assert p > 1e-3, f"chi-square {stat:.1f} on {df} degrees of freedom (p = {p:.2e})"
    # both branches ran often: kept drafts and rejected ones
    assert sum(1 for a in kept_lengths if a >= 2) > n // 20 and sum(1 for a in kept_lengths if a == 1) > n // 20
