"""Token sampling, batched: penalties, temperature, top-k/top-p/min-p, per-sequence seeds, logprobs.

Order (vLLM's): the request's token controls (``logit_bias``, ``allowed_token_ids``, ``bad_words``:
:mod:`node.worker.token_masks`) → repetition penalty (CTRL, Keskar et al. 2019, arXiv:1909.05858: positive logits
divided, negative multiplied, over prompt and output tokens) → presence/frequency penalties (OpenAI
API: subtract ``frequency * count + presence * (count > 0)`` over output tokens; both in
:mod:`node.worker.penalties`) → greedy rows take
the argmax, the others: temperature → top-k → top-p (nucleus, Holtzman et al. 2020,
arXiv:1904.09751) → min-p (Nguyen et al. 2024, arXiv:2407.01082) → draw.

The whole batch goes through one vectorised pass on the logits' device (CPU or CUDA); the only
device→host transfer is one ``.tolist()`` of a packed float64 tensor at the end (tokens and logprobs
together). On the CPU a few extra host reads are free and are used to skip work (which rows are
degenerate, whether a nucleus fits in the candidate set); they are never done on other devices.

**CPU rows without top-k** (plain temperature, top-p, min-p) go to the compiled kernel of
:mod:`shiftnode_kernels.cpu_sampling_numba` when Numba is there: no sort, top-p by rejection (the
sorting-free top-p of FlashInfer), about the cost of the greedy argmax at Llama-3's vocabulary. Its
draw for a top-p row differs from the sorted inverse CDF below (same distribution, another mapping
from uniforms to tokens: in vocabulary order, with further uniforms when a draw is rejected), so a
seeded top-p row gives other tokens on the CPU than on a GPU or on a CPU without Numba; on one of
them it is reproducible as documented. Everything below describes the torch path, which the other
rows and devices take.

Algorithm for the filters. All three filters keep a *prefix* of the tokens sorted by descending
probability (top-k: the first ``k``; top-p: the shortest prefix whose renormalised mass reaches
``top_p``, the first token always kept; min-p: tokens with ``p >= min_p * p_max``), so their
intersection is a prefix too. For a row with top-k or top-p ("sorted" rows) we take the ``C``
largest logits with ``torch.topk`` instead of sorting the vocabulary: ``C = top_k`` (as vLLM's
``apply_top_k_only`` in vllm/v1/sample/ops/topk_topp_sampler.py does for top-k alone; vLLM sorts for
top-p), and, our extension, for top-p without top-k a candidate set of ``_NUCLEUS_CANDIDATES``
(CPU), grown ×8 on the rows whose kept prefix fills it, then a full sort once ``C`` would exceed
``V / 8`` (a large-``k`` topk costs more than a sort). Top-p mass is normalised by the full-vocabulary
``sum(exp(x - max))``, so the result equals a full sort's whenever the prefix ends inside the
candidates; the final answer never depends on ``C``. On other devices such rows are sorted at once
(a GPU radix sort is cheap and needs no host check). Measured on 2 CPU cores, V = 128256:
``topk(1024)`` ≈0.5 ms/row vs a full sort ≈7 ms/row; bench/device/sampler.py has the step times.
Rows with neither top-k nor top-p ("full" rows: plain temperature, optionally min-p) need no order:
min-p is a threshold ``exp(x - max) >= min_p``, done in place over the vocabulary.

Draw: inverse-CDF sampling with one uniform ``u`` per row: the token is the first index whose
cumulative (unnormalised) weight exceeds ``u * total`` (in candidate order for sorted rows, in
vocabulary order for full rows; which order a row uses depends only on its own parameters). A seeded
row's ``u`` is a counter-based hash of ``(seed, output_index)`` (SplitMix64, Steele, Lea & Flood
2014, "Fast splittable pseudorandom number generators", OOPSLA; constants from Vigna's
splitmix64.c), so its token depends only on its own logits, seed and output index, never on the
batch, preemption or migration; the compiled kernel's later rounds hash the same key
(:func:`seed_key`) with the round number. Unseeded rows take ``u`` from the node's generator (one
``torch.rand`` call per step, and on the CPU one ``torch.randint`` for the round keys). Caveat:
float reductions may round differently in the last ulp with the batch shape (thread splitting of a
single-row sum, vector vs scalar tail of ``exp``); a seeded token can then flip only when ``u``
falls within ~1e-7 of a CDF or top-p boundary.

Degenerate rows (NaN/±inf logits, all masked, overflowing temperature) fall back to the argmax of
the penalised logits; they never fail the batch. Logprobs are those of the model's raw distribution
(log-softmax of the unprocessed logits), computed in the same pass before the penalties.
"""

from __future__ import annotations

import os

import torch

from shiftnode_kernels import cpu_sampling_numba
from node.core.sequence import SamplingParams
from node.worker.grammar import apply_mask
from node.worker.penalties import apply_penalties
from node.worker.sample_request import SampleRequest, TokenLogprobs
from node.worker.token_masks import apply_token_masks

CPU_SAMPLER = os.environ.get("SHIFTNODE_CPU_SAMPLER", "auto")
"""CPU rows without top-k: ``"auto"`` runs the compiled kernel where it applies (Numba installed, float32
logits), ``"torch"`` always the torch path. Read from ``$SHIFTNODE_CPU_SAMPLER`` at import (benches
compare the two); tests set it directly."""

_NUCLEUS_CANDIDATES = 1024  # first candidate-set size for top-p rows without top-k (CPU)
_GROW = 8  # candidate-set growth factor for rows whose nucleus did not fit
_CHUNK_ELEMS = 1 << 20  # CPU: rows per chunk ≈ this / V (≈4 MiB float32 temporaries, reused by malloc)
_MASK64 = (1 << 64) - 1


def logprobs_of(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> list[TokenLogprobs]:
    """Raw-distribution logprobs of ``token_ids [N]`` under ``logits [N, V]`` float32, with top-``k``."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, token_ids.to(lp.device).view(-1, 1)).squeeze(1).tolist()  # sampled ids come from the CPU
    if k > 0:
        vals, idx = lp.topk(min(k, lp.shape[-1]), dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
    else:
        tops = [[] for _ in chosen]
    return [TokenLogprobs(int(t), c, top) for t, c, top in zip(token_ids.tolist(), chosen, tops)]


# ----------------------------------------------------------------------------------------------
# Seeds


def _splitmix64(x: int) -> int:
    """SplitMix64 finaliser of ``x + golden gamma`` (Steele, Lea & Flood 2014; Vigna's splitmix64.c)."""
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def seed_key(seed: int, output_index: int) -> int:
    """The 64-bit key of token ``output_index`` of a sequence seeded with ``seed``: its first uniform is
    :func:`seeded_uniform`, its later rejection rounds (CPU top-p, :mod:`shiftnode_kernels.cpu_sampling_numba`)
    hash the key with the round number."""
    return _splitmix64(seed & _MASK64) ^ (output_index & _MASK64)


def _uniform_of_key(key: int) -> float:
    return (_splitmix64(key) >> 11) * 2.0**-53


def seeded_uniform(seed: int, output_index: int) -> float:
    """Uniform in ``[0, 1)`` (53 bits) for token ``output_index`` of a sequence seeded with ``seed``."""
    return _uniform_of_key(seed_key(seed, output_index))


# ----------------------------------------------------------------------------------------------
# Drawing


def _fallback_argmax(x: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    """Argmax of the rows of ``x [R, V]`` flagged in ``bad [R]`` bool (other rows: 0), ``[R]`` int64."""
    if x.device.type != "cpu":  # no host read: an argmax of every row is cheap there
        return torch.where(bad, x.argmax(dim=-1), 0)
    out = torch.zeros(x.shape[0], dtype=torch.int64)
    idx = bad.nonzero().flatten()
    if idx.numel():
        out[idx] = x[idx].argmax(dim=-1)
    return out


def _inverse_cdf(cum: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """First index of ``cum [R, C]`` (non-decreasing weights' cumsum) exceeding ``u [R]`` × total."""
    total = cum[:, -1:]
    target = torch.minimum(u.to(cum.dtype).view(-1, 1) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cum, target, right=True).squeeze(1).clamp_(max=cum.shape[1] - 1)


def _draw_full(x: torch.Tensor, temp: torch.Tensor, min_p: torch.Tensor | None, u: torch.Tensor) -> torch.Tensor:
    """Rows without top-k/top-p. ``x [R, V]`` penalised logits (overwritten), ``temp``/``min_p`` ``[R]``
    float32, ``u [R]`` float64 → tokens ``[R]`` int64. Weights ``exp((x - max) / T)``, min-p by threshold,
    inverse CDF in vocabulary order over an in-place cumsum."""
    mx = x.amax(dim=-1, keepdim=True)
    m = mx / temp.view(-1, 1)  # == amax(x / T) exactly: division by T > 0 is monotone
    bad = ~torch.isfinite(m).squeeze(1)
    fb = _fallback_argmax(x, bad)
    x.div_(temp.view(-1, 1)).sub_(m).exp_()
    if min_p is not None:
        x.masked_fill_(x < min_p.clamp(max=1.0).view(-1, 1), 0.0)  # the max token (weight exactly 1) stays
    x.cumsum_(dim=-1)
    return torch.where(bad, fb, _inverse_cdf(x, u))


def _top(x: torch.Tensor, c: int) -> tuple[torch.Tensor, torch.Tensor]:
    if c >= x.shape[-1]:
        return torch.sort(x, dim=-1, descending=True)
    return torch.topk(x, c, dim=-1, sorted=True)


def _draw_sorted(x: torch.Tensor, temp: torch.Tensor, top_k: list[int], top_p: torch.Tensor,
                 min_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Rows with top-k and/or top-p. ``x [R, V]`` penalised logits (overwritten), ``top_k`` host ints
    (``V`` when off), ``temp``/``top_p``/``min_p`` ``[R]`` float32, ``u [R]`` float64 → ``[R]`` int64.

    Keep mask over the ``C`` descending candidates ``j``: ``j < k``, ``(cum_j - w_j) < top_p * Z``
    (``Z``: mass of the top-k set, or of the whole vocabulary without top-k), ``w_j >= min_p`` where
    ``w = exp(v - max)`` in float64; candidate 0 always kept; then inverse CDF over the kept prefix.
    """
    r, vocab = x.shape
    dev = x.device
    mx = x.amax(dim=-1, keepdim=True)
    m = mx / temp.view(-1, 1)
    bad = ~torch.isfinite(m).squeeze(1)
    fb = _fallback_argmax(x, bad)
    has_k = [k < vocab for k in top_k]
    k_t = torch.tensor(top_k, device=dev).view(-1, 1)
    has_k_t = torch.tensor(has_k, device=dev)
    p_col, mp_col = top_p.double().view(-1, 1), min_p.double().clamp(max=1.0).view(-1, 1)
    p_off = (top_p >= 1.0).view(-1, 1)
    if all(has_k):  # order of x / T == order of x: take candidates first, divide only them
        z_full = torch.zeros(r, dtype=torch.float64, device=dev)
        c = max(top_k)
        vals, idx = _top(x, c)
        vals = vals / temp.view(-1, 1)
    else:
        x.div_(temp.view(-1, 1))
        z_full = (x - m).exp_().sum(dim=-1).double()
        c0 = _NUCLEUS_CANDIDATES if dev.type == "cpu" else vocab
        c = min(vocab, max([k for k, h in zip(top_k, has_k) if h] + [c0]))
        vals, idx = _top(x, c)

    def keep_of(v: torch.Tensor, rows: torch.Tensor | slice) -> tuple[torch.Tensor, torch.Tensor]:
        w = (v - m[rows]).double().exp_()
        cum = w.cumsum(dim=-1)
        j = torch.arange(v.shape[1], device=dev)
        zk = cum.gather(1, (k_t[rows] - 1).clamp(max=v.shape[1] - 1))
        z = torch.where(has_k_t[rows].view(-1, 1), zk, z_full[rows].view(-1, 1))
        keep = (j < k_t[rows]) & (p_off[rows] | ((cum - w) < p_col[rows] * z)) & (w >= mp_col[rows])
        keep[:, 0] = True
        return keep, w

    keep, w = keep_of(vals, slice(None))
    cum = (w * keep).cumsum(dim=-1)
    tokens = idx.gather(1, _inverse_cdf(cum, u).view(-1, 1)).squeeze(1)
    if c < vocab and not all(has_k):  # CPU only (c0 == V elsewhere): grow the rows whose nucleus filled C
        pending = ~(has_k_t | ~keep[:, -1] | bad)
        while bool(pending.any()):
            rows = pending.nonzero().flatten()
            c = c * _GROW if c * _GROW <= vocab // 8 else vocab  # topk of a large k costs more than a sort
            v2, i2 = _top(x[rows], c)
            k2, w2 = keep_of(v2, rows)
            fin = ~k2[:, -1] | (c >= vocab)
            sel = rows[fin]
            if sel.numel():
                cum2 = (w2[fin] * k2[fin]).cumsum(dim=-1)
                tokens[sel] = i2[fin].gather(1, _inverse_cdf(cum2, u[sel]).view(-1, 1)).squeeze(1)
                pending[sel] = False
    return torch.where(bad, fb, tokens)


def _rows_of(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """A scratch copy of ``logits[rows]`` (one index_select; small per CPU chunk)."""
    return logits.index_select(0, torch.tensor(rows, device=logits.device))


def _draw_compiled(logits: torch.Tensor, rows: list[int], ps: list[SamplingParams], u: torch.Tensor,
                   keys: list[int]) -> torch.Tensor | None:
    """CPU rows without top-k through :mod:`shiftnode_kernels.cpu_sampling_numba` (rejection top-p, no sort):
    tokens ``[len(rows)]`` int64, or None (nothing done) when the kernel does not apply."""
    res = cpu_sampling_numba.draw(logits, rows, [p.temperature for p in ps], [p.top_p for p in ps],
                                  [p.min_p for p in ps], u, keys)
    if res is None:
        return None
    tok, bad = res
    if bool(bad.any()):
        idx = bad.nonzero().flatten()
        tok[idx] = logits.index_select(0, torch.tensor(rows)[idx]).argmax(dim=-1)
    return tok


def _draw(logits: torch.Tensor, reqs: list[SampleRequest], rows: list[int], u: torch.Tensor,
          keys: list[int]) -> torch.Tensor:
    """Tokens ``[len(rows)]`` int64 for the non-greedy ``rows`` of the penalised ``logits [N, V]``.
    ``u [len(rows)]`` float64, ``keys`` the rows' 64-bit round keys. On the CPU, rows without top-k go
    to the compiled kernel when it applies. The others split by kind (full / sorted, from their own
    parameters) and, on the CPU, into chunks of ≈``_CHUNK_ELEMS`` elements so temporaries stay small."""
    dev = logits.device
    vocab = logits.shape[1]
    out = torch.empty(len(rows), dtype=torch.int64, device=dev)
    ps = [reqs[i].params for i in rows]
    todo = list(range(len(rows)))  # rows the torch path below still has to draw
    no_k = [j for j, p in enumerate(ps) if not (0 < p.top_k < vocab)]
    if dev.type == "cpu" and no_k and CPU_SAMPLER != "torch":
        sel = torch.tensor(no_k)
        tok = _draw_compiled(logits, [rows[j] for j in no_k], [ps[j] for j in no_k], u[sel], [keys[j] for j in no_k])
        if tok is not None:
            out[sel] = tok
            todo = [j for j, p in enumerate(ps) if 0 < p.top_k < vocab]
    full = [j for j in todo if not (0 < ps[j].top_k < vocab) and ps[j].top_p >= 1.0]
    srt = [j for j in todo if (0 < ps[j].top_k < vocab) or ps[j].top_p < 1.0]
    step = max(1, _CHUNK_ELEMS // vocab) if dev.type == "cpu" else len(rows)
    for kind in (full, srt):
        for a in range(0, len(kind), step):
            js = kind[a : a + step]
            x = _rows_of(logits, [rows[j] for j in js])
            temp = torch.tensor([ps[j].temperature for j in js], dtype=torch.float32, device=dev)
            mp_list = [ps[j].min_p for j in js]
            mp = torch.tensor(mp_list, dtype=torch.float32, device=dev)
            uj = u[torch.tensor(js, device=dev)]
            if kind is full:
                tok = _draw_full(x, temp, mp if any(v > 0 for v in mp_list) else None, uj)
            else:
                ks = [ps[j].top_k if 0 < ps[j].top_k < vocab else vocab for j in js]
                tp = torch.tensor([ps[j].top_p for j in js], dtype=torch.float32, device=dev)
                tok = _draw_sorted(x, temp, ks, tp, mp, uj)
            out[torch.tensor(js, device=dev)] = tok
    return out


def sample(logits: torch.Tensor, reqs: list[SampleRequest], generator: torch.Generator,
           grammar_mask: tuple[torch.Tensor, list[int]] | None = None) -> tuple[list[int], list[TokenLogprobs | None]]:
    """Draw one token per row, with the raw-distribution logprobs rows ask for.

    Args:
        logits: ``[N, V]`` float32 on any device; penalised rows are modified in place.
        reqs: ``N`` sample requests, one per row.
        generator: the node's generator for unseeded rows (one ``torch.rand`` per step, on its device).
        grammar_mask: ``(bitmask [N, ceil(V / 32)] int32, rows)``: structured output; the tokens a row's
            grammar does not allow get ``-inf`` after the penalties, before any draw
            (:func:`node.worker.grammar.apply_mask`). Logprobs stay those of the raw distribution.

    Returns:
        ``(tokens, logprobs)``: ``N`` python ints, and per row a ``TokenLogprobs`` with
        ``params.logprobs`` alternatives when ``params.logprobs is not None``, else ``None``.
    """
    n, vocab = logits.shape
    if n != len(reqs):
        raise ValueError(f"{n} logits rows for {len(reqs)} sample requests")
    dev = logits.device
    if n == 0:
        return [], []
    params = [r.params for r in reqs]
    # Raw logprobs first (log_softmax makes a new tensor, so the penalties below cannot touch it).
    lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    lp = top_v = top_i = None
    k_lp = 0
    if lp_rows:
        raw = logits if len(lp_rows) == n else logits.index_select(0, torch.tensor(lp_rows, device=dev))
        lp = torch.log_softmax(raw.float(), dim=-1)
        k_lp = min(vocab, max(params[i].logprobs for i in lp_rows))
        if k_lp > 0:
            top_v, top_i = lp.topk(k_lp, dim=-1)
    apply_token_masks(logits, reqs)  # logit_bias, allowed_token_ids, bad_words (after the raw logprobs)
    apply_penalties(logits, reqs)
    if grammar_mask is not None:
        apply_mask(logits, *grammar_mask)

    greedy = [i for i, p in enumerate(params) if p.greedy or p.temperature <= 0.0]
    sampled = [i for i, p in enumerate(params) if not (p.greedy or p.temperature <= 0.0)]
    if len(greedy) == n:
        tokens = logits.argmax(dim=-1)
    else:
        tokens = torch.empty(n, dtype=torch.int64, device=dev)
        if greedy:
            g = torch.tensor(greedy, device=dev)
            tokens[g] = logits.index_select(0, g).argmax(dim=-1)
        seeded = [j for j, i in enumerate(sampled) if params[i].seed is not None]
        unseeded = [j for j, i in enumerate(sampled) if params[i].seed is None]
        u = torch.empty(len(sampled), dtype=torch.float64, device=dev)
        keys = [0] * len(sampled)
        if seeded:
            for j in seeded:
                keys[j] = seed_key(params[sampled[j]].seed, reqs[sampled[j]].output_index)
            host = [_uniform_of_key(keys[j]) for j in seeded]  # seeded_uniform, the key kept for later rounds
            u[torch.tensor(seeded, device=dev)] = torch.tensor(host, dtype=torch.float64).to(dev)
        if unseeded:
            gdev = generator.device
            r = torch.rand(len(unseeded), generator=generator, dtype=torch.float64, device=gdev)
            u[torch.tensor(unseeded, device=dev)] = r.to(dev)
            if dev.type == "cpu":  # keys of the compiled kernel's later rounds, from the same generator
                rk = torch.randint(-(2**63), 2**63 - 1, (len(unseeded),), generator=generator, dtype=torch.int64)
                for j, kk in zip(unseeded, rk.tolist()):
                    keys[j] = kk & _MASK64
        tokens[torch.tensor(sampled, device=dev)] = _draw(logits, reqs, sampled, u, keys)

    # One host copy: tokens, chosen logprobs, top values and ids, packed as float64 (ids < 2^53).
    parts = [tokens.double()]
    if lp is not None:
        sel = tokens if len(lp_rows) == n else tokens[torch.tensor(lp_rows, device=dev)]
        parts.append(lp.gather(1, sel.view(-1, 1)).squeeze(1).double())
        if top_v is not None:
            parts += [top_v.double().flatten(), top_i.double().flatten()]
    host = torch.cat(parts).tolist()
    toks = [int(t) for t in host[:n]]
    out_lp: list[TokenLogprobs | None] = [None] * n
    if lp is not None:
        nl = len(lp_rows)
        chosen = host[n : n + nl]
        tv = host[n + nl : n + nl + nl * k_lp]
        ti = host[n + nl + nl * k_lp :]
        for j, i in enumerate(lp_rows):
            k = params[i].logprobs
            base = j * k_lp
            top = [(int(ti[base + a]), tv[base + a]) for a in range(min(k, k_lp))]
            out_lp[i] = TokenLogprobs(toks[i], chosen[j], top)
    return toks, out_lp
