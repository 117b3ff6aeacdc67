"""Per-request token controls on a batch of logits: ``logit_bias``, ``allowed_token_ids``, ``bad_words``.

Applied by the sampler after the raw logprobs are taken (logprobs describe the model's distribution,
as vLLM's default ``raw_logprobs``) and before the penalties. Semantics as vLLM's:

* ``logit_bias``: ``(token_id, bias)`` pairs added to the row's logits (OpenAI: bias in [-100, 100]);
* ``allowed_token_ids``: every id not in the list is set to ``-inf``;
* ``bad_words``: token sequences (each word tokenized with and without a leading space, see
  :func:`node.api.prompts.bad_word_ids`); a one-token word is always masked, a longer one has its last
  token masked where the row's output ends with its other tokens, so the word is never completed.

Rows without a control cost nothing; the work is one scatter per kind over the rows that ask.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from node.worker.sample_request import SampleRequest


def _bad_word_hits(req: "SampleRequest") -> list[int]:
    """Token ids that would complete one of the row's bad words after its output so far."""
    out = req.token_ids[req.prompt_len :]
    hits = []
    for word in req.params.bad_words:
        head = word[:-1]
        if not head or (len(out) >= len(head) and list(out[len(out) - len(head) :]) == list(head)):
            hits.append(word[-1])
    return hits


def apply_token_masks(logits: torch.Tensor, reqs: list["SampleRequest"]) -> None:
    """Apply the rows' ``logit_bias``, ``allowed_token_ids`` and ``bad_words`` to ``logits [N, V]``
    (float32, any device) in place. Ids outside ``[0, V)`` are ignored (the API refuses them)."""
    vocab = logits.shape[1]
    dev = logits.device
    bias_r, bias_t, bias_v = [], [], []
    allow_rows: list[int] = []
    ban_r, ban_t = [], []
    for i, r in enumerate(reqs):
        p = r.params
        if p.logit_bias:
            for t, b in p.logit_bias:
                if 0 <= t < vocab:
                    bias_r.append(i)
                    bias_t.append(t)
                    bias_v.append(b)
        if p.allowed_token_ids:
            allow_rows.append(i)
        if p.bad_words:
            for t in _bad_word_hits(r):
                if 0 <= t < vocab:
                    ban_r.append(i)
                    ban_t.append(t)
    if bias_r:
        logits.index_put_((torch.tensor(bias_r, device=dev), torch.tensor(bias_t, device=dev)),
                          torch.tensor(bias_v, dtype=logits.dtype, device=dev), accumulate=True)
    if allow_rows:  # keep the allowed logits, fill the rows with -inf, put them back: O(rows x V) memset
        keep_r, keep_t = [], []
        for i in allow_rows:
            ids = [t for t in reqs[i].params.allowed_token_ids if 0 <= t < vocab]
            keep_r += [i] * len(ids)
            keep_t += ids
        at = (torch.tensor(keep_r, device=dev), torch.tensor(keep_t, device=dev))
        kept = logits[at]
        logits.index_fill_(0, torch.tensor(allow_rows, device=dev), float("-inf"))
        logits[at] = kept
    if ban_r:
        logits[torch.tensor(ban_r, device=dev), torch.tensor(ban_t, device=dev)] = float("-inf")
