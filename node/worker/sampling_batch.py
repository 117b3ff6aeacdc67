"""One step's sampling parameters as device tensors, built on the host before the forward pass.

Everything the batched sampler branches on is decided here, from the parameters alone (which rows
are greedy, which need a sorted prefix, how long that prefix is), so the device pass has no
data-dependent control flow and no host sync until its results are copied back.

Randomness is one uniform number per sampled row, drawn on the host. A seeded row's uniform is a
counter-based function of ``(seed, output index)``: SplitMix64 (Steele, Lea & Flood, "Fast splittable
pseudorandom number generators", OOPSLA 2014; constants of Vigna's ``splitmix64.c``) applied as
``u = mix(mix(seed) xor index) >> 11`` scaled by ``2**-53``. It depends on nothing else, so the token a
seeded sequence draws does not depend on its batch, its row, preemption or migration. Unseeded rows
take their uniforms from the runner's shared generator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from node.worker.sampler import SampleRequest

_M64 = (1 << 64) - 1
PREFIX_TOKENS = 512  # sorted candidates kept per filtered row before falling back to a full sort


def splitmix64(z: int) -> int:
    """SplitMix64's output function of state ``z`` (a Python int, taken mod 2**64) → 64-bit int."""
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def seeded_uniform(seed: int, output_index: int) -> float:
    """The uniform in ``[0, 1)`` (53 bits) that a seeded sequence uses for output ``output_index``."""
    return (splitmix64(splitmix64(seed & _M64) ^ (output_index & _M64)) >> 11) * 2.0**-53


@dataclass
class PenaltyBatch:
    """Rows with a repetition, presence or frequency penalty, and their token counts' scatter indexes.

    Attributes:
        rows: ``[P]`` int64 rows of the logits.
        repetition, presence, frequency: ``[P, 1]`` float32 (1.0 / 0.0 / 0.0 where a row has none).
        output_index: ``[n]`` int64 flat ``p * V + token`` over every output token of every row.
        seen_index: ``[m]`` int64 flat indexes of prompt and output tokens of rows with a repetition
            penalty, or None when no row has one.
    """

    rows: torch.Tensor
    repetition: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor
    output_index: torch.Tensor
    seen_index: torch.Tensor | None
    all_rows: bool


@dataclass
class SamplingBatch:
    """Device tensors for one step's ``N`` sample requests (build with :func:`prepare`).

    Rows split into greedy ones (argmax) and sampled ones; sampled rows split into *plain* ones (no
    top-k/top-p: drawn over the vocabulary in id order) and *filtered* ones (top-k and/or top-p:
    drawn over a sorted prefix of ``prefix_tokens`` candidates). Index tensors are None when empty;
    ``*_all`` flags say a subset is every row, so no gather is needed.

    Attributes:
        greedy_rows: ``[G]`` int64. sampled_rows: ``[S]`` int64.
        temperature: ``[S, 1]`` float32. uniform: ``[S]`` float64 in ``[0, 1)``.
        log_min_p: ``[S, 1]`` float64 ``ln(min_p)`` (``-inf`` when off): min-p keeps ``y >= max(y) + ln(min_p)``.
        plain, filtered: int64 positions within the sampled rows.
        top_k: ``[F]`` int64 (0: off). top_p: ``[F, 1]`` float64 (1.0: off).
        has_top_k, has_top_p: ``[F]`` bool.
        logprob_rows: ``[R]`` int64 rows asking for logprobs; ``logprob_top`` their alternative counts.
    """

    num_rows: int
    vocab_size: int
    greedy_rows: torch.Tensor | None
    sampled_rows: torch.Tensor | None
    greedy_all: bool
    sampled_all: bool
    temperature: torch.Tensor | None
    uniform: torch.Tensor | None
    log_min_p: torch.Tensor | None
    any_min_p: bool
    plain: torch.Tensor | None
    plain_all: bool
    filtered: torch.Tensor | None
    filtered_all: bool
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    has_top_k: torch.Tensor | None
    has_top_p: torch.Tensor | None
    needs_full_mass: bool  # some filtered row has top-p without top-k: it needs its whole row's mass
    prefix_tokens: int
    penalty: PenaltyBatch | None
    logprob_rows: torch.Tensor | None
    logprob_top: list[int]
    sampled_list: list[int]  # host copies of ``sampled_rows`` and ``filtered`` (for the fallback pass)
    filtered_list: list[int]


def _dev(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":  # pinned + non_blocking: the copy does not wait on queued kernels
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _rows(idx: list[int], n: int, device: torch.device) -> tuple[torch.Tensor | None, bool]:
    if not idx:
        return None, False
    return _dev(idx, torch.int64, device), len(idx) == n


def _penalties(reqs: list[SampleRequest], vocab: int, device: torch.device) -> PenaltyBatch | None:
    rows = [i for i, r in enumerate(reqs)
            if r.params.repetition_penalty != 1.0 or r.params.presence_penalty or r.params.frequency_penalty]
    if not rows:
        return None
    out_idx: list[int] = []
    seen_idx: list[int] = []
    any_rep = False
    for p, i in enumerate(rows):
        r = reqs[i]
        base = p * vocab
        out_idx.extend(base + t for t in r.output_ids)
        if r.params.repetition_penalty != 1.0:
            any_rep = True
            seen_idx.extend(base + t for t in r.prompt_ids)
            seen_idx.extend(base + t for t in r.output_ids)
    col = lambda vals: _dev(vals, torch.float32, device).view(-1, 1)  # noqa: E731
    return PenaltyBatch(
        rows=_dev(rows, torch.int64, device),
        repetition=col([reqs[i].params.repetition_penalty for i in rows]),
        presence=col([reqs[i].params.presence_penalty for i in rows]),
        frequency=col([reqs[i].params.frequency_penalty for i in rows]),
        output_index=_dev(out_idx, torch.int64, device),
        seen_index=_dev(seen_idx, torch.int64, device) if any_rep else None,
        all_rows=len(rows) == len(reqs),
    )


def prepare(reqs: list[SampleRequest], vocab_size: int, device: torch.device,
            generator: torch.Generator, prefix_tokens: int = PREFIX_TOKENS) -> SamplingBatch:
    """Build the device tensors of one step's sample requests (one row each, in order).

    Args:
        reqs: ``N >= 1`` requests. vocab_size: ``V``, the logits' width.
        device: where the logits will be. generator: CPU generator for unseeded rows' uniforms.
        prefix_tokens: sorted candidates per filtered row (raised to ``max top_k + 1``, capped at ``V``).
    """
    n = len(reqs)
    greedy = [i for i, r in enumerate(reqs) if r.params.greedy]
    sampled = [i for i, r in enumerate(reqs) if not r.params.greedy]
    sreqs = [reqs[i] for i in sampled]

    def _top_k(r: SampleRequest) -> int:
        return r.params.top_k if 0 < r.params.top_k < vocab_size else 0

    filtered = [j for j, r in enumerate(sreqs) if _top_k(r) or r.params.top_p < 1.0]
    plain = [j for j, r in enumerate(sreqs) if not (_top_k(r) or r.params.top_p < 1.0)]
    fre = [sreqs[j] for j in filtered]

    uniform = None
    if sreqs:
        unseeded = [j for j, r in enumerate(sreqs) if r.params.seed is None]
        draws = torch.rand(len(unseeded), dtype=torch.float64, generator=generator).tolist() if unseeded else []
        u = [0.0] * len(sreqs)
        for j, v in zip(unseeded, draws):
            u[j] = v
        for j, r in enumerate(sreqs):
            if r.params.seed is not None:
                u[j] = seeded_uniform(r.params.seed, r.output_index)
        uniform = _dev(u, torch.float64, device)

    max_k = max((_top_k(r) for r in fre), default=0)
    lp_rows = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
    greedy_t, greedy_all = _rows(greedy, n, device)
    sampled_t, sampled_all = _rows(sampled, n, device)
    plain_t, plain_all = _rows(plain, len(sreqs), device)
    filtered_t, filtered_all = _rows(filtered, len(sreqs), device)
    return SamplingBatch(
        num_rows=n,
        vocab_size=vocab_size,
        greedy_rows=greedy_t, sampled_rows=sampled_t, greedy_all=greedy_all, sampled_all=sampled_all,
        temperature=_dev([r.params.temperature for r in sreqs], torch.float32, device).view(-1, 1) if sreqs else None,
        uniform=uniform,
        log_min_p=_dev([math.log(r.params.min_p) if r.params.min_p > 0.0 else -math.inf for r in sreqs],
                       torch.float64, device).view(-1, 1) if sreqs else None,
        any_min_p=any(r.params.min_p > 0.0 for r in sreqs),
        plain=plain_t, plain_all=plain_all, filtered=filtered_t, filtered_all=filtered_all,
        top_k=_dev([_top_k(r) for r in fre], torch.int64, device) if fre else None,
        top_p=_dev([r.params.top_p for r in fre], torch.float64, device).view(-1, 1) if fre else None,
        has_top_k=_dev([_top_k(r) > 0 for r in fre], torch.bool, device) if fre else None,
        has_top_p=_dev([r.params.top_p < 1.0 for r in fre], torch.bool, device) if fre else None,
        needs_full_mass=any(r.params.top_p < 1.0 and not _top_k(r) for r in fre),
        prefix_tokens=min(vocab_size, max(prefix_tokens, max_k + 1)),
        penalty=_penalties(reqs, vocab_size, device),
        logprob_rows=_dev(lp_rows, torch.int64, device) if lp_rows else None,
        logprob_top=[reqs[i].params.logprobs for i in lp_rows],
        sampled_list=sampled,
        filtered_list=filtered,
    )
