"""Repetition, presence and frequency penalties over a batch of logits, sparse in the histories.

Order and formulas as vLLM's: the repetition penalty (CTRL, Keskar et al. 2019, arXiv:1909.05858:
positive logits divided, negative multiplied) over prompt and output tokens, then presence/frequency
(OpenAI API: subtract ``frequency * count + presence * (count > 0)``) over output tokens.
"""

from __future__ import annotations

import itertools
from array import array
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from node.worker.sample_request import SampleRequest


def _flat_history(reqs: list[SampleRequest], rows: list[int], outputs_only: bool, vocab: int):
    """``(keys, row_pos)`` for the concatenated histories of ``rows``: ``keys = row * V + token`` int64
    on the CPU (tokens outside ``[0, V)`` dropped) and, per key, the position of its row in ``rows``."""
    seqs = [itertools.islice(reqs[i].token_ids, reqs[i].prompt_len, None) if outputs_only else reqs[i].token_ids
            for i in rows]
    lens = [max(len(reqs[i].token_ids) - reqs[i].prompt_len, 0) if outputs_only else len(reqs[i].token_ids)
            for i in rows]
    buf = array("q", itertools.chain.from_iterable(seqs))
    if not len(buf):
        return None, None
    toks = torch.frombuffer(buf, dtype=torch.int64)
    pos = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(lens))
    keep = (toks >= 0) & (toks < vocab)
    if not bool(keep.all()):
        toks, pos = toks[keep], pos[keep]
    keys = torch.tensor(rows, dtype=torch.int64)[pos] * vocab + toks
    return keys, pos


def apply_penalties(logits: torch.Tensor, reqs: list[SampleRequest]) -> None:
    """Apply repetition, then presence/frequency penalties to ``logits [N, V]`` float32 in place.

    Vectorised and sparse: the concatenated histories of the penalised rows become flat indices
    ``row * V + token``; the repetition penalty is one gather/where/scatter over prompt+output tokens
    (duplicates write identical values), presence/frequency one ``torch.unique(return_counts=True)``
    over output tokens then one gather/scatter. Cost is O(history), not O(rows × V); rows without a
    penalty cost nothing. Arithmetic is the same as the dense formulas, element for element.
    """
    rep_rows = [i for i, r in enumerate(reqs) if r.params.repetition_penalty != 1.0]
    pf_rows = [i for i, r in enumerate(reqs) if r.params.presence_penalty or r.params.frequency_penalty]
    if not rep_rows and not pf_rows:
        return
    n, vocab = logits.shape
    dev = logits.device
    work = logits if logits.is_contiguous() else logits.contiguous()
    flat = work.view(-1)
    if rep_rows:
        keys, pos = _flat_history(reqs, rep_rows, False, vocab)
        if keys is not None:
            pen = torch.tensor([reqs[i].params.repetition_penalty for i in rep_rows], dtype=logits.dtype)[pos]
            keys, pen = keys.to(dev), pen.to(dev)
            vals = flat[keys]
            flat[keys] = torch.where(vals > 0, vals / pen, vals * pen)
    if pf_rows:
        keys, _ = _flat_history(reqs, pf_rows, True, vocab)
        if keys is not None:
            uniq, counts = torch.unique(keys, return_counts=True)  # on the CPU: no device sync
            row = uniq // vocab
            freq = torch.zeros(n, dtype=logits.dtype)
            pres = torch.zeros(n, dtype=logits.dtype)
            freq[pf_rows] = torch.tensor([reqs[i].params.frequency_penalty for i in pf_rows], dtype=logits.dtype)
            pres[pf_rows] = torch.tensor([reqs[i].params.presence_penalty for i in pf_rows], dtype=logits.dtype)
            freq, pres = freq[row].to(dev), pres[row].to(dev)
            uniq, c = uniq.to(dev), counts.to(logits.dtype).to(dev)
            flat[uniq] = flat[uniq] - (freq * c + pres * (c > 0).to(logits.dtype))
    if work is not logits:
        logits.copy_(work)
