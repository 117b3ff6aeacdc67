"""Verifying draft tokens (speculative decoding's engine half): one sampled row per position of a verify
item, and the tokens it keeps.

A verify item computes ``[last, d_1 .. d_k]``; row ``j`` (``0 <= j <= k``) holds the target model's
logits for the token after ``d_1 .. d_j``. Each row is sampled by the ordinary sampler
(:func:`node.worker.sampler.sample`) as if the drafts before it were the sequence's output: its
:class:`SampleRequest` carries the history extended by ``d_1 .. d_j`` (penalties, ``bad_words``,
``min_tokens`` read it) and output index ``i + j`` (a seeded row draws the uniform the same token would
draw without speculation). The item keeps ``x_0 .. x_a``, where ``a`` is the first ``j`` with
``x_j != d_{j+1}`` (or ``k``): the matched drafts, then the correction or the bonus token.

Why this is exact. For n-gram drafts the draft distribution is a point mass on ``d``; speculative
sampling's rule (Leviathan et al. 2023, arXiv:2211.17192; Chen et al. 2023, arXiv:2302.01318) accepts
``d`` with probability ``min(1, p(d) / q(d)) = p(d)`` and on rejection draws from ``norm(max(0, p - q))``,
which is ``p`` with ``d`` removed and renormalised. Drawing ``x ~ p`` and accepting when ``x == d`` does
both at once: ``P(accept) = p(d)``, and a rejected ``x`` is distributed as ``p`` conditioned on
``x != d``. So every kept token has the distribution it would have without speculation, greedy rows
(``p`` a point mass on the argmax) give exactly the tokens they would, and the rows' uniforms are
independent (one per row and output index).
"""

from __future__ import annotations

from node.worker.sample_request import SampleRequest


def verify_requests(req: SampleRequest, draft: list[int]) -> list[SampleRequest]:
    """The ``len(draft) + 1`` rows' sample requests of a verify item whose last row's request (without
    drafts) is ``req``: row ``j`` sees the history extended by ``draft[:j]`` at output index ``+ j``."""
    rows = [req]
    hist = req.token_ids
    for j in range(1, len(draft) + 1):
        rows.append(SampleRequest(req.params, hist + draft[:j], req.prompt_len, req.output_index + j))
    return rows


def accepted(draft: list[int], sampled: list[int]) -> int:
    """How many of ``sampled`` (``len(draft) + 1`` tokens, one per row) a verify item keeps: the rows up
    to and including the first whose token differs from the draft after it (all of them when every
    draft matched), so 1 to ``len(draft) + 1``."""
    for j, d in enumerate(draft):
        if sampled[j] != d:
            return j + 1
    return len(draft) + 1
