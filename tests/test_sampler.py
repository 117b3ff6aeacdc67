"""Batched sampler (node/worker/sampler.py) against a straightforward per-row torch reference."""

from __future__ import annotations

import math

import pytest
import torch

from node.core.sequence import SamplingParams
from shiftnode_kernels import cpu_sampling_numba
from node.worker import sampler as S
from node.worker.penalties import apply_penalties
from node.worker.sampler import SampleRequest, TokenLogprobs, logprobs_of, sample, seed_key, seeded_uniform

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def P(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=16, **kw)


def R(params: SamplingParams, history=(), prompt_len=0, index=0) -> SampleRequest:
    return SampleRequest(params, list(history), prompt_len, index)


# ---------------------------------------------------------------- reference (one row at a time)


def ref_penalise(row: torch.Tensor, req: SampleRequest) -> torch.Tensor:
    """The former per-row implementation, on a ``[V]`` float32 row."""
    row = row.clone()
    p = req.params
    prompt, out = req.token_ids[: req.prompt_len], req.token_ids[req.prompt_len :]
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt) | set(out)), dtype=torch.long)
        if seen.numel():
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and out:
        counts = torch.bincount(torch.tensor(out), minlength=row.shape[-1]).to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    return row


def ref_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Filtered distribution ``[V]`` float64 of a penalised row: temperature → top-k → top-p → min-p."""
    x = row.double() / p.temperature
    v = x.shape[-1]
    if 0 < p.top_k < v:
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, -math.inf)
    if p.top_p < 1.0:
        sx, order = torch.sort(x, descending=True)
        probs = torch.softmax(sx, -1)
        drop = (torch.cumsum(probs, -1) - probs) >= p.top_p
        drop[0] = False
        x = torch.empty_like(x).scatter_(0, order, sx.masked_fill(drop, -math.inf))
    if p.min_p > 0.0:
        probs = torch.softmax(x, -1)
        x = x.masked_fill(probs < p.min_p * probs.max(), -math.inf)
    return torch.softmax(x, -1)


def ref_draw(row: torch.Tensor, p: SamplingParams, u: float) -> int:
    """Inverse CDF in the documented order: descending probability for rows with top-k/top-p,
    vocabulary order otherwise."""
    probs = ref_probs(row, p)
    if 0 < p.top_k < row.shape[-1] or p.top_p < 1.0:
        sp, order = torch.sort(probs, descending=True)
    else:
        sp, order = probs, torch.arange(probs.shape[-1])
    cum = torch.cumsum(sp, -1)
    i = int(torch.searchsorted(cum, torch.tensor([u * float(cum[-1])], dtype=torch.float64), right=True))
    return int(order[min(i, len(order) - 1)])


def ref_round_uniform(key: int, k: int) -> float:
    """Round ``k >= 1`` uniform of the compiled kernel: SplitMix64 of ``key ^ k * ROUND_STRIDE``."""
    return (S._splitmix64(key ^ ((k * cpu_sampling_numba.ROUND_STRIDE) & S._MASK64)) >> 11) * 2.0**-53


def ref_draw_rejection(row: torch.Tensor, p: SamplingParams, u: float, key: int) -> int:
    """The CPU kernel's draw (rows without top-k), in float64: inverse CDF in vocabulary order over the
    proposal set (weights ``>= min_p``, above the pivot), accepted when the mass strictly above the token
    is under ``top_p * Z``, else the pivot rises to its weight and the next round's uniform is used."""
    x = row.double() / p.temperature
    w = torch.exp(x - x.max())
    z = float(w.sum())
    ok = (w >= p.min_p) & (w > 0)
    k = 0
    while True:
        cum = torch.where(ok, w, 0.0).cumsum(0)
        j = min(int(torch.searchsorted(cum, torch.tensor([u * float(cum[-1])], dtype=torch.float64), right=True)),
                len(cum) - 1)
        if p.top_p >= 1.0 or float(w[w > w[j]].sum()) < p.top_p * z:
            return j
        ok &= w > w[j]
        k += 1
        u = ref_round_uniform(key, k)


def ref_seeded(row: torch.Tensor, req: SampleRequest, device: str = "cpu", compiled: bool = True) -> int:
    """The token a seeded row must get: the compiled kernel's draw for CPU rows without top-k, the
    sorted inverse CDF otherwise."""
    p = req.params
    u = seeded_uniform(p.seed, req.output_index)
    if device == "cpu" and compiled and not (0 < p.top_k < row.shape[-1]):
        return ref_draw_rejection(row, p, u, seed_key(p.seed, req.output_index))
    return ref_draw(row, p, u)


@pytest.fixture
def torch_path(monkeypatch):
    """Force the torch sampling path on the CPU (as without Numba)."""
    monkeypatch.setattr(S, "CPU_SAMPLER", "torch")


def gen(seed=0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def run(logits, reqs, device="cpu", seed=0):
    return sample(logits.clone().to(device), reqs, gen(seed))


# ---------------------------------------------------------------- penalties


@pytest.mark.quick
def test_penalties_exact_against_reference():
    torch.manual_seed(0)
    v = 300
    logits = torch.randn(6, v) * 4
    hist = [[1, 2, 2, 3, 299, 7, 7, 7], [5, 5, 0], [], [9, 8, 9, 8, 9], [4, 4, 4, 4], [10, 11, 12, 10]]
    params = [P(repetition_penalty=1.3), P(presence_penalty=0.7, frequency_penalty=0.3),
              P(repetition_penalty=1.5, presence_penalty=1.0), P(), P(frequency_penalty=-0.5, repetition_penalty=0.8),
              P(repetition_penalty=1.2, presence_penalty=0.4, frequency_penalty=0.9)]
    reqs = [R(p, h, pl) for p, h, pl in zip(params, hist, [3, 1, 0, 2, 0, 4])]
    got = logits.clone()
    apply_penalties(got, reqs)
    want = torch.stack([ref_penalise(logits[i], r) for i, r in enumerate(reqs)])
    assert torch.equal(got, want)
    # Greedy rows see the penalised logits.
    toks, _ = run(logits, [R(P(temperature=0.0, repetition_penalty=r.params.repetition_penalty,
                                 presence_penalty=r.params.presence_penalty,
                                 frequency_penalty=r.params.frequency_penalty), r.token_ids, r.prompt_len)
                           for r in reqs])
    assert toks == want.argmax(-1).tolist()


@pytest.mark.quick
def test_penalty_rows_do_not_touch_other_rows_and_history_not_read():
    class Trap(list):  # a history the sampler must not read: the row has no penalty
        def __iter__(self):
            raise AssertionError("history of an unpenalised row was read")

        def __len__(self):
            raise AssertionError("history of an unpenalised row was read")

    logits = torch.randn(2, 50)
    reqs = [SampleRequest(P(), Trap([1, 2]), 1, 0), R(P(repetition_penalty=2.0), [3], 1)]
    got = logits.clone()
    apply_penalties(got, reqs)
    assert torch.equal(got[0], logits[0])
    sample(logits.clone(), reqs, gen())


# ---------------------------------------------------------------- greedy and filters


@pytest.mark.quick
@pytest.mark.parametrize("device", DEVICES)
def test_greedy_and_argmax_equivalents(device):
    torch.manual_seed(1)
    logits = torch.randn(8, 5000) * 3
    am = logits.argmax(-1).tolist()
    for p in [P(temperature=0.0), P(temperature=0.9, top_k=1, seed=1), P(temperature=1.3, top_p=1e-6),
              P(temperature=0.8, min_p=1.0), P(temperature=2.0, top_k=40, top_p=1e-9, seed=5)]:
        toks, lps = run(logits, [R(p, index=i) for i in range(8)], device)
        assert toks == am, p
        assert lps == [None] * 8


@pytest.mark.quick
@pytest.mark.parametrize("device", DEVICES)
def test_seeded_tokens_equal_reference_draw(device):
    """Exact equality with the per-row reference using the same documented uniform."""
    torch.manual_seed(2)
    v = 700
    logits = torch.randn(40, v) * 2.5
    kinds = [P(temperature=1.0), P(temperature=0.7, top_k=20), P(temperature=1.2, top_p=0.9),
             P(temperature=0.9, top_k=50, top_p=0.8, min_p=0.05), P(temperature=1.1, min_p=0.2),
             P(temperature=0.6, top_p=0.5, min_p=0.01)]
    reqs = []
    for i in range(40):
        k = kinds[i % len(kinds)]
        reqs.append(R(SamplingParams(**{f: getattr(k, f) for f in k.__struct_fields__} | {"seed": 1000 + i}), index=i))
    toks, _ = run(logits, reqs, device)
    assert toks == [ref_seeded(logits[i], r, device) for i, r in enumerate(reqs)]


@pytest.mark.quick
def test_seeded_tokens_equal_reference_draw_torch_path(torch_path):
    """The torch path (CPU without Numba): the sorted inverse CDF for every row with top-k or top-p."""
    torch.manual_seed(2)
    logits = torch.randn(30, 700) * 2.5
    kinds = [P(temperature=1.0), P(temperature=1.2, top_p=0.9), P(temperature=0.6, top_p=0.5, min_p=0.01)]
    reqs = [R(SamplingParams(**{f: getattr(k, f) for f in k.__struct_fields__} | {"seed": 1000 + i}), index=i)
            for i, k in enumerate(kinds * 10)]
    assert run(logits, reqs)[0] == [ref_seeded(logits[i], r, compiled=False) for i, r in enumerate(reqs)]


@pytest.mark.quick
def test_min_p_and_top_k_masks_support():
    torch.manual_seed(3)
    v = 64
    row = torch.randn(v) * 2
    n = 4000
    logits = row.expand(n, v).contiguous()
    for p in [P(temperature=1.0, min_p=0.3), P(temperature=1.5, top_k=5), P(temperature=1.0, top_p=0.6),
              P(temperature=1.0, top_k=10, top_p=0.9, min_p=0.1)]:
        support = set(torch.nonzero(ref_probs(row, p)).flatten().tolist())
        toks, _ = run(logits, [R(p)] * n)
        assert set(toks) <= support, p
        assert len(set(toks)) == len(support), p  # every kept token appears in 4000 draws here


@pytest.mark.parametrize("seeded", [False, True])
def test_empirical_frequencies_match_reference(seeded):
    torch.manual_seed(4)
    v, n = 16, 20000
    row = torch.randn(v) * 1.5
    hist = [3, 3, 5, 7, 7, 7]
    logits = row.expand(n, v).contiguous()
    for p in [P(temperature=1.0), P(temperature=0.7, top_k=6), P(temperature=1.3, top_p=0.8),
              P(temperature=1.0, min_p=0.15), P(temperature=0.9, top_k=8, top_p=0.9, min_p=0.05),
              P(temperature=1.0, repetition_penalty=1.4, frequency_penalty=0.2, presence_penalty=0.3)]:
        reqs = [R(SamplingParams(**{f: getattr(p, f) for f in p.__struct_fields__} | {"seed": s if seeded else None}),
                  hist, 2, 3) for s in range(n)]
        toks, _ = run(logits, reqs)
        freq = torch.bincount(torch.tensor(toks), minlength=v).double() / n
        want = ref_probs(ref_penalise(row, reqs[0]), p)
        tol = 4.5 * torch.sqrt(want * (1 - want) / n) + 1e-4
        assert torch.all((freq - want).abs() <= tol), (p, freq, want)


# ---------------------------------------------------------------- seeds and batching


def _batch_invariance_case(device):
    torch.manual_seed(5)
    v = 3000
    target = torch.randn(v) * 2
    seeded = [P(temperature=1.0, top_p=0.9, seed=1234), P(temperature=0.8, top_k=30, seed=7),
              P(temperature=1.2, seed=99), P(temperature=0.9, min_p=0.05, seed=3, repetition_penalty=1.2,
                                                 presence_penalty=0.5),
              P(temperature=1.0, top_p=0.999, seed=11, logprobs=2)]
    hist = [5, 6, 7, 7, 100]
    fillers = [P(temperature=0.0), P(temperature=1.0), P(temperature=0.7, top_k=3), P(temperature=1.0, top_p=0.5),
               P(temperature=1.0, logprobs=3), P(temperature=1.1, frequency_penalty=1.0, seed=5),
               P(temperature=1.0, top_k=2000)]
    for sp in seeded:
        alone = []
        for idx in range(4):
            toks, _ = run(target.view(1, v), [R(sp, hist, 2, idx)], device)
            alone.append(toks[0])
        for trial in range(4):
            g = torch.Generator().manual_seed(trial)
            n = int(torch.randint(2, 40, (1,), generator=g))
            pos = int(torch.randint(0, n, (1,), generator=g))
            logits = torch.randn(n, v, generator=g) * 3
            logits[pos] = target
            for idx in range(4):
                reqs = [R(fillers[int(torch.randint(0, len(fillers), (1,), generator=g))], [1, 2, 3], 1, idx)
                        for _ in range(n)]
                reqs[pos] = R(sp, hist, 2, idx)
                toks, _ = sample(logits.clone().to(device), reqs, torch.Generator().manual_seed(trial + 100))
                assert toks[pos] == alone[idx], (sp, trial, idx)
        assert len(set(alone)) > 1 or sp.top_k == 30  # the index changes the draw


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_row_independent_of_batch(device):
    _batch_invariance_case(device)


@pytest.mark.quick
def test_seeded_row_independent_of_chunking_and_candidate_growth(monkeypatch, torch_path):
    torch.manual_seed(6)
    v = 4096
    # Flat rows: the 0.99 nucleus holds thousands of tokens, beyond any small candidate set.
    logits = torch.randn(24, v) * 0.5
    reqs = [R(P(temperature=1.0, top_p=0.99 if i % 3 else 0.3, min_p=0.0 if i % 4 else 0.2, seed=i), index=i)
            for i in range(24)]
    base, _ = run(logits, reqs)
    assert base == [ref_seeded(logits[i], r, compiled=False) for i, r in enumerate(reqs)]
    monkeypatch.setattr(S, "_NUCLEUS_CANDIDATES", 8)
    monkeypatch.setattr(S, "_GROW", 3)
    monkeypatch.setattr(S, "_CHUNK_ELEMS", 3 * v)  # 3 rows per chunk
    assert run(logits, reqs)[0] == base
    monkeypatch.setattr(S, "_NUCLEUS_CANDIDATES", v)  # full sort from the start
    assert run(logits, reqs)[0] == base


@pytest.mark.quick
def test_unseeded_rows_follow_the_generator():
    logits = torch.randn(32, 500)
    reqs = [R(P(temperature=1.0, top_p=0.95)) for _ in range(32)]
    a, _ = run(logits, reqs, seed=1)
    b, _ = run(logits, reqs, seed=1)
    c, _ = run(logits, reqs, seed=2)
    assert a == b and a != c


@pytest.mark.quick
def test_seeded_uniform_is_uniform_and_in_range():
    us = [seeded_uniform(s, i) for s in range(200) for i in range(100)]
    assert all(0.0 <= u < 1.0 for u in us)
    assert abs(sum(us) / len(us) - 0.5) < 0.01
    assert seeded_uniform(-5, 0) == seeded_uniform(-5, 0) != seeded_uniform(-5, 1)
    assert 0.0 <= seeded_uniform(2**80 + 3, 2**70) < 1.0


# ---------------------------------------------------------------- logprobs


@pytest.mark.quick
@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_are_raw_log_softmax(device):
    torch.manual_seed(7)
    v = 1000
    logits = torch.randn(5, v) * 3
    reqs = [R(P(temperature=0.0, logprobs=3, repetition_penalty=2.0), [1, 2, 3], 1),
            R(P(temperature=1.0, top_k=5, logprobs=0, seed=1)),
            R(P(temperature=1.0)),
            R(P(temperature=0.8, top_p=0.9, logprobs=5, presence_penalty=2.0), [4, 4], 0),
            R(P(temperature=1.0, logprobs=1, seed=2))]
    toks, lps = run(logits, reqs, device)
    ref = torch.log_softmax(logits, -1)  # raw: before penalties
    assert lps[2] is None
    for i in (0, 1, 3, 4):
        lp = lps[i]
        assert isinstance(lp, TokenLogprobs) and lp.token_id == toks[i]
        assert lp.logprob == pytest.approx(float(ref[i, toks[i]]), abs=1e-5)
        k = reqs[i].params.logprobs
        vals, idx = ref[i].topk(k) if k else (torch.empty(0), torch.empty(0, dtype=torch.long))
        assert [t for t, _ in lp.top] == idx.tolist()
        assert [x for _, x in lp.top] == pytest.approx(vals.tolist(), abs=1e-5)
    # Same answers as the standalone helper kept for prompt logprobs.
    ref_lp = logprobs_of(logits[[0]], torch.tensor([toks[0]]), 3)[0]
    assert ref_lp.token_id == lps[0].token_id and ref_lp.logprob == pytest.approx(lps[0].logprob, abs=1e-6)


# ---------------------------------------------------------------- degenerate rows


@pytest.mark.quick
@pytest.mark.parametrize("device", DEVICES)
def test_degenerate_rows_fall_back_to_argmax(device):
    torch.manual_seed(8)
    v = 2000
    logits = torch.randn(7, v)
    logits[0, 10] = float("nan")
    logits[1, 20] = float("inf")
    logits[2] = float("-inf")
    logits[4, 33] = float("nan")
    logits[5, 44] = float("inf")
    kinds = [P(temperature=1.0, seed=1), P(temperature=1.0, top_p=0.9, seed=1), P(temperature=0.5, top_k=3),
             P(temperature=1e-42, seed=4), P(temperature=1.0, top_k=5, logprobs=2), P(temperature=0.0),
             P(temperature=1.0, top_p=0.9, seed=9)]
    alone_last, _ = run(logits[6:7], [R(kinds[6])], device)
    toks, lps = run(logits, [R(p) for p in kinds], device)
    assert toks[:3] == [10, 20, 0]
    assert toks[3] == int(logits[3].argmax())  # temperature so small that x / T overflows
    assert toks[4] == 33 and toks[5] == 44
    assert toks[6] == alone_last[0]  # the healthy neighbour is unaffected
    assert lps[4] is not None and lps[4].token_id == 33


@pytest.mark.quick
def test_empty_and_mismatched():
    assert sample(torch.empty(0, 10), [], gen()) == ([], [])
    with pytest.raises(ValueError):
        sample(torch.zeros(2, 10), [R(P())], gen())


# ---------------------------------------------------------------- the compiled CPU kernel (no sort)


@pytest.mark.quick
@pytest.mark.parametrize("v", [7, 1023, 1024, 1025, 5000])
def test_compiled_draw_equals_rejection_reference(v):
    """Exact tokens against the float64 reference over vocabularies within, at and across block edges,
    flat and peaked rows, every filter, and nuclei that take many rejection rounds (tiny top_p)."""
    assert cpu_sampling_numba.available()
    g = torch.Generator().manual_seed(v)
    kinds = [P(temperature=1.0), P(temperature=0.8, top_p=0.95), P(temperature=1.3, top_p=0.5),
             P(temperature=1.0, top_p=0.05), P(temperature=0.7, top_p=1e-6), P(temperature=1.0, min_p=0.1),
             P(temperature=0.9, top_p=0.9, min_p=0.05), P(temperature=2.0, top_p=0.3, min_p=0.5)]
    rows, reqs = [], []
    for i in range(48):
        scale = [0.05, 1.0, 4.0][i % 3]  # flat, spread, peaked
        rows.append(torch.randn(v, generator=g) * scale)
        k = kinds[i % len(kinds)]
        reqs.append(R(SamplingParams(**{f: getattr(k, f) for f in k.__struct_fields__} | {"seed": 7 * i + v}), index=i))
    logits = torch.stack(rows)
    toks, _ = run(logits, reqs)
    assert toks == [ref_seeded(logits[i], r) for i, r in enumerate(reqs)]
    tiny = [i for i, r in enumerate(reqs) if r.params.top_p == 1e-6]
    assert all(toks[i] == int(logits[i].argmax()) for i in tiny)  # the nucleus is the maximum alone


@pytest.mark.quick
def test_compiled_draw_never_picks_masked_tokens():
    """-inf logits have no weight: never drawn, not even by the rounding fallbacks; a row whose only
    finite logit sits in the last block still finds it."""
    v = 3000
    logits = torch.full((64, v), -math.inf)
    allowed = [5, 1030, 2999]
    logits[:, allowed] = torch.tensor([0.0, 0.5, -0.2])
    logits[1::2, :2999] = -math.inf  # odd rows: only the very last token is finite
    reqs = [R(P(temperature=1.0, top_p=[1.0, 0.9, 0.4][i % 3], seed=i), index=i) for i in range(64)]
    toks, _ = run(logits, reqs)
    assert all(t in allowed for t in toks)
    assert all(toks[i] == 2999 for i in range(1, 64, 2))
    assert {toks[i] for i in range(0, 64, 2)} == set(allowed)


@pytest.mark.quick
def test_compiled_draw_flags_degenerate_rows():
    """A NaN anywhere, an infinite maximum or a temperature that overflows the scaled maximum: the kernel
    leaves the row to the caller, which takes the argmax."""
    v = 2050
    logits = torch.randn(4, v)
    logits[0, 1500] = float("nan")
    logits[1, 0] = float("nan")  # first element of a block
    logits[2, 77] = math.inf
    logits[3] = torch.randn(v) * 1e30
    tok, bad = cpu_sampling_numba.draw(logits, [0, 1, 2, 3], [1.0, 1.0, 1.0, 1e-20], [0.9] * 4, [0.0] * 4,
                                       torch.full((4,), 0.5, dtype=torch.float64), [1, 2, 3, 4])
    assert bad.tolist() == [True] * 4
    ok, bad = cpu_sampling_numba.draw(torch.randn(2, v), [0, 1], [1.0] * 2, [0.9] * 2, [0.0] * 2,
                                      torch.full((2,), 0.5, dtype=torch.float64), [1, 2])
    assert bad.tolist() == [False, False] and all(0 <= t < v for t in ok.tolist())


def test_compiled_draw_frequencies_across_blocks():
    """Empirical frequencies of a 3-block vocabulary under top-p and min-p match the nucleus distribution
    (unseeded rows: the first uniform and the round keys come from the node's generator)."""
    torch.manual_seed(8)
    v, n = 2500, 20000
    row = torch.randn(v) * 0.3 - 4.0  # distinct values: no ties at the nucleus boundary
    top = torch.tensor([3, 900, 1024, 2048, 2499])  # the mass sits in a few tokens spread over the blocks
    row[top] = torch.tensor([1.0, 0.6, 0.2, -0.3, 0.9])
    logits = row.expand(n, v).contiguous()
    for p in [P(temperature=1.0, top_p=0.8), P(temperature=0.9, top_p=0.95, min_p=0.02)]:
        toks, _ = run(logits, [R(p)] * n)
        freq = torch.bincount(torch.tensor(toks), minlength=v).double() / n
        want = ref_probs(row, p)
        tol = 4.5 * torch.sqrt(want * (1 - want) / n) + 1e-4
        assert torch.all((freq - want).abs() <= tol), (p, freq[top], want[top])


@pytest.mark.quick
def test_compiled_draw_with_an_empty_proposal_set_takes_the_maximum():
    """min_p above 1, or a top_p of 0 (refused by the API, but a top_p under ~1e-45 passes it and rounds
    to 0 in float32): no token is eligible, and the kernel returns the row's maximum instead of looping."""
    v = 2100
    logits = torch.randn(2, v)
    logits[:, 1500] = 9.0
    tok, bad = cpu_sampling_numba.draw(logits, [0, 1], [1.0, 1.0], [1.0, 0.0], [1.5, 0.0],
                                       torch.full((2,), 0.7, dtype=torch.float64), [3, 4])
    assert tok.tolist() == [1500, 1500] and bad.tolist() == [False, False]
    # through the sampler: a top_p the API accepts but float32 rounds to 0 (it hung the engine once)
    reqs = [R(P(temperature=1.0, top_p=1e-50, seed=1)), R(P(temperature=1.0, top_p=1e-50))]
    assert run(logits, reqs)[0] == [1500, 1500]
