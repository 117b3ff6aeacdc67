"""The per-row reference sampler: the node's sampler before batching, kept as the readable
specification that :mod:`node.worker.sampler` is tested against and as the benchmark's baseline.

Order (vLLM's): repetition penalty (CTRL, Keskar et al. 2019: positive logits divided, negative
multiplied, over prompt and output tokens) → presence/frequency penalties (OpenAI: subtract
``frequency * count + presence * (count > 0)`` over output tokens) → greedy argmax, or temperature →
top-k → top-p (nucleus, Holtzman et al. 2020) → min-p (Nguyen et al. 2024) → draw. A seeded row draws
with a ``torch.Generator`` seeded from ``(seed, output index)``; every row costs its own sort, softmax
and ``torch.multinomial`` (3.5-4.9 ms per row at a 128k vocabulary on a CPU).
"""

from __future__ import annotations

import torch

from node.core.sequence import SamplingParams
from node.worker.sampler import SampleRequest

_SEED_STRIDE = 1_000_003  # a prime, so (seed, index) pairs map to distinct generator seeds


def apply_penalties_per_row(logits: torch.Tensor, reqs: list[SampleRequest]) -> None:
    """Repetition, then presence/frequency penalties, row by row, in place on ``logits [N, V]``."""
    for row, r in enumerate(reqs):
        p = r.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(r.prompt_ids) | set(r.output_ids)), dtype=torch.long, device=logits.device)
            if seen.numel():
                vals = logits[row, seen]
                logits[row, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and r.output_ids:
            out = torch.tensor(r.output_ids, dtype=torch.long, device=logits.device)
            counts = torch.bincount(out, minlength=logits.shape[-1]).to(logits.dtype)
            logits[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def filter_row(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Mask a ``[V]`` row of temperature-scaled logits to its top-k / top-p / min-p set."""
    if 0 < p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = (torch.cumsum(probs, dim=-1) - probs) >= p.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(0, order, sorted_logits)
    if p.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return logits


def sample_per_row(logits: torch.Tensor, reqs: list[SampleRequest], generator: torch.Generator) -> torch.Tensor:
    """Draw one token per row (the previous sampler: float64 masks, ``torch.multinomial`` per row).

    Args:
        logits: ``[N, V]`` float32 (modified in place by penalties).
        reqs: ``N`` sample requests, one per row.
        generator: CPU generator for unseeded rows (the node's own stream).

    Returns:
        ``[N]`` int64 token ids on the CPU.
    """
    if any(r.params.repetition_penalty != 1.0 or r.params.presence_penalty or r.params.frequency_penalty for r in reqs):
        apply_penalties_per_row(logits, reqs)
    out = logits.argmax(dim=-1).cpu()
    for row, r in enumerate(reqs):
        p = r.params
        if p.greedy:
            continue
        row_logits = filter_row(logits[row].double() / p.temperature, p)
        probs = torch.softmax(row_logits, dim=-1).cpu()
        if not torch.isfinite(probs).all() or probs.sum() <= 0:  # degenerate row: never fail the batch
            continue  # keep the argmax already in ``out``
        gen = generator
        if p.seed is not None:
            gen = torch.Generator(device="cpu").manual_seed((p.seed * _SEED_STRIDE + r.output_index) % (2**63))
        out[row] = torch.multinomial(probs, 1, generator=gen)[0]
    return out
