"""The CPU serving attention (``--attention-backend cpu``) against the torch reference.

Every case draws fresh random inputs: ragged contexts over blocks scattered in the pool, block tables
holding -1 past each sequence's blocks, and caches holding NaN in every slot outside a context (the
reference reads such slots, so it gets a clean copy). Both decode kernels run: the compiled Numba
kernel (``auto``, skipped where Numba is missing) and the torch chunks (``torch``). Errors are
norm-relative, float32 <= 1e-5 (bf16/fp16 caches: 1e-2).
"""

from __future__ import annotations


import pytest
import torch

from shiftnode_kernels import cpu_attention, cpu_decode_numba
from shiftnode_kernels import reference as ref
from shiftnode_kernels.ops import get_ops, resolve_backend

KERNELS = ["auto", "torch"]  # numba is a dependency: the compiled decode path is tested, never skipped
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


@pytest.fixture(params=KERNELS)
def decode_kernel(request, monkeypatch):
    monkeypatch.setattr(cpu_attention, "DECODE_KERNEL", request.param)
    return request.param


def make_case(q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, block_size, dtype=torch.float32, seed=0):
    """Returns ``(args with NaN-poisoned caches, args with clean caches)`` for ``paged_attention``."""
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-c // block_size) for c in ctx_lens]
    num_blocks = sum(blocks) + 3
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.full((len(ctx_lens), max(blocks, default=0) + 2), -1, dtype=torch.int32)
    used = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    nxt = 0
    for s, (nb, ctx) in enumerate(zip(blocks, ctx_lens)):
        table[s, :nb] = perm[nxt : nxt + nb].to(torch.int32)
        pos = torch.arange(ctx)
        used[table[s, pos // block_size].long(), pos % block_size] = True
        nxt += nb
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(*shape, generator=g).to(dtype)
    v_cache = torch.randn(*shape, generator=g).to(dtype)
    k_bad, v_bad = k_cache.clone(), v_cache.clone()
    k_bad[~used] = float("nan")
    v_bad[~used] = float("nan")
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=g).to(dtype)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(q_lens, dtype=torch.int32), 0)
    meta = (table, torch.tensor(ctx_lens, dtype=torch.int32), cu, max(q_lens, default=0), head_dim**-0.5)
    return (q, k_bad, v_bad, *meta), (q, k_cache, v_cache, *meta)


def check(args, ref_args):
    out = cpu_attention.paged_attention(*args)
    expect = ref.paged_attention(*ref_args)
    assert out.shape == expect.shape and out.dtype == expect.dtype
    assert not torch.isnan(out).any(), f"{int(torch.isnan(out).sum())} NaN of {out.numel()}"
    if expect.numel():
        err = float((out.float() - expect.float()).norm() / expect.float().norm().clamp_min(1e-30))
        assert err <= TOL[expect.dtype], err
    return out


def ragged(n, max_ctx, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, max_ctx + 1, (n,), generator=g).tolist()


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("head_dim", [8, 32, 64, 128])
def test_decode_matches_reference(decode_kernel, block_size, group, head_dim):
    ctx = ragged(9, 150, seed=block_size * 1000 + group * 100 + head_dim) + [1, block_size, block_size + 1]
    check(*make_case([1] * len(ctx), ctx, 2 * group, 2, head_dim, block_size, seed=head_dim + group))


@pytest.mark.parametrize("num_seqs,max_ctx", [(1, 700), (40, 300), (3, 2100)])
def test_decode_long_and_wide(decode_kernel, num_seqs, max_ctx):
    """Several chunks per sequence in the torch path (and its scatter-max), long contexts."""
    ctx = ragged(num_seqs, max_ctx, seed=num_seqs)
    check(*make_case([1] * num_seqs, ctx, 8, 4, 32, 16, seed=num_seqs))


@pytest.mark.quick
def test_decode_groups_under_gather_budget(monkeypatch):
    """A batch bigger than the gather budget runs in several groups and still matches."""
    monkeypatch.setattr(cpu_attention, "DECODE_KERNEL", "torch")
    monkeypatch.setattr(cpu_attention, "GATHER_BUDGET_BYTES", 40_000)
    ctx = ragged(20, 200, seed=7)
    check(*make_case([1] * 20, ctx, 4, 2, 16, 8, seed=7))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_half_caches(decode_kernel, dtype):
    ctx = ragged(12, 90, seed=3)
    check(*make_case([1] * 12, ctx, 8, 2, 64, 16, dtype=dtype, seed=3))


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("group,head_dim", [(1, 64), (2, 8), (4, 32), (8, 128)])
def test_prefill_and_chunked_prefill_on_cached_context(block_size, group, head_dim):
    # whole prompts (q_len == ctx), chunks after a cached prefix (q_len < ctx), a 2-token chunk
    q_lens = [37, 16, 5, 2, 29]
    ctx = [37, 80, 5 + 3 * block_size, 2 + block_size, 29 + 1]
    check(*make_case(q_lens, ctx, 2 * group, 2, head_dim, block_size, seed=block_size + group))


@pytest.mark.parametrize("block_size", [8, 16])
def test_short_queries_run_as_decode_rows(decode_kernel, block_size, monkeypatch):
    """Verify items (a last token plus drafts: 2 to SHORT_QUERY_TOKENS new tokens at the end of a context)
    beside decode rows, a longer prompt chunk, and sequences with no new tokens; each short query's rows
    go to the decode kernel (one per row, its own context) and match the causal reference."""
    seen = []
    real = cpu_attention._decode
    monkeypatch.setattr(cpu_attention, "_decode", lambda q, *a: (seen.append(q.shape[0]), real(q, *a))[1])
    n = cpu_attention.SHORT_QUERY_TOKENS
    q_lens = [5, 1, 0, 2, n, 12, 3, 0]
    ctx = [5 + 3 * block_size, 40, 9, 2, n + 1, 30, block_size + 1, 0]
    check(*make_case(q_lens, ctx, 8, 2, 32, block_size, seed=block_size))
    assert seen == [5 + 1 + 2 + n + 3]  # every short-query and decode row in one call; the 12-token chunk apart
    seen.clear()
    check(*make_case([2, 0], [7, 3], 4, 2, 16, block_size, seed=1))  # all rows decode rows, not one per sequence
    assert seen == [2]
    seen.clear()
    check(*make_case([n + 1], [n + 4], 4, 2, 16, block_size, seed=2))  # past the bound: the prefill path
    assert seen == []


def test_mixed_step_with_empty_and_single_token_sequences(decode_kernel):
    # decode rows, prompt chunks, a sequence with no new tokens and one with no context at all
    q_lens = [1, 12, 0, 1, 7, 1, 0, 1]
    ctx = [40, 12, 33, 1, 50, 129, 0, 17]
    out = check(*make_case(q_lens, ctx, 8, 2, 32, 16, seed=11))
    assert out.shape[0] == sum(q_lens)


@pytest.mark.quick
def test_empty_batches(decode_kernel):
    args, _ = make_case([], [], 4, 2, 8, 16)
    assert cpu_attention.paged_attention(*args).shape == (0, 4, 8)
    args, _ = make_case([0, 0, 0], [5, 0, 9], 4, 2, 8, 16)
    assert cpu_attention.paged_attention(*args).shape == (0, 4, 8)


@pytest.mark.quick
def test_rejects_bad_shapes():
    args, _ = make_case([1], [5], 6, 4, 8, 16)
    with pytest.raises(ValueError, match="multiple"):
        cpu_attention.paged_attention(*args)
    for q_lens, ctx in (([3], [2]), ([1, 1], [4, 0])):  # a query row must see at least itself
        args, _ = make_case(q_lens, ctx, 4, 2, 8, 16)
        with pytest.raises(ValueError, match="new tokens"):
            cpu_attention.paged_attention(*args)


@pytest.mark.quick
def test_chunk_size_follows_mean_context():
    assert cpu_attention.chunk_blocks_for(1, 16) == 1
    assert cpu_attention.chunk_blocks_for(256, 16) * 16 == 128
    assert cpu_attention.chunk_blocks_for(10_000, 16) * 16 == cpu_attention.MAX_CHUNK_TOKENS
    assert cpu_attention.chunk_blocks_for(10_000, 512) == 1


@pytest.mark.quick
def test_numba_kernel_runs_where_it_applies():
    args, _ = make_case([1, 1], [20, 3], 4, 2, 8, 16)
    q, k, v, table, lens, _, _, scale = args
    out = torch.empty_like(q)
    assert cpu_decode_numba.paged_decode(q, k, v, table, lens, scale, out)
    assert not cpu_decode_numba.paged_decode(q, k.bfloat16(), v.bfloat16(), table, lens, scale, out)  # q float32
    assert not cpu_decode_numba.paged_decode(q, k.transpose(1, 2), v, table, lens, scale, out)
    assert not cpu_decode_numba.paged_decode(q.half(), k.half(), v.half(), table, lens, scale, out.half())


@pytest.mark.parametrize("head_dim", [64, 128])
def test_numba_kernel_reads_bfloat16_caches_in_place_exactly_widened(head_dim):
    """A bfloat16 cache runs the compiled kernel on its bits: the same float32 math as the kernel on
    the cache widened to float32 (so the same result once rounded), and within bfloat16 rounding of
    the reference."""
    ctx = ragged(6, 120, seed=head_dim) + [1, 17]
    args, ref_args = make_case([1] * len(ctx), ctx, 8, 2, head_dim, 16, dtype=torch.bfloat16, seed=head_dim)
    q, k, v, table, lens, _, _, scale = ref_args
    out = torch.empty_like(q)
    assert cpu_decode_numba.paged_decode(q, k, v, table, lens, scale, out)
    out32 = torch.empty_like(q, dtype=torch.float32)
    assert cpu_decode_numba.paged_decode(q.float(), k.float(), v.float(), table, lens, scale, out32)
    assert torch.equal(out, out32.bfloat16())
    check(args, ref_args)  # NaN-poisoned slots past each context are never read


@pytest.mark.quick
def test_backend_selection():
    assert resolve_backend("auto", "cpu") == "cpu"
    assert resolve_backend("auto", "cuda") == "triton"
    assert resolve_backend("torch", "cpu") == "torch"
    with pytest.raises(ValueError):
        resolve_backend("fast", "cpu")
    ops = get_ops("cpu")
    assert ops.backend == "cpu" and ops.paged_attention is cpu_attention.paged_attention
    assert get_ops("torch").paged_attention is ref.paged_attention


def test_stories260k_greedy_equals_reference(decode_kernel):
    """Greedy tokens through the model runner on the cpu backend equal the llama2.c references
    (prefill of the prompt, then one decode step per token)."""
    from support import reference_cases, STORIES, require_shared

    from node.config import NodeConfig
    from node.core.sequence import SamplingParams
    from node.worker.loader import build_runner, load_model_info
    from node.worker.runner import SeqInput, StepInput
    from node.worker.sampler import SampleRequest

    require_shared()
    config = NodeConfig(model=str(STORIES), kv_cache_memory_bytes=8 << 20)
    runner = build_runner(config, load_model_info(config), "cpu:0", get_ops("cpu"))
    # two sequences decoding side by side, their blocks interleaved in the pool
    cases = reference_cases()[:2]
    state = []
    for j, case in enumerate(cases):
        total = len(case["prompt_token_ids"]) + case["max_new_tokens"]
        blocks = [2 * b + j for b in range(-(-total // runner.block_size))]
        state.append({"ids": list(case["prompt_token_ids"]), "start": 0, "blocks": blocks, "case": case})
    while any(len(st["ids"]) < len(st["case"]["prompt_token_ids"]) + st["case"]["max_new_tokens"] for st in state):
        live = [st for st in state if len(st["ids"]) < len(st["case"]["prompt_token_ids"]) + st["case"]["max_new_tokens"]]
        seqs = []
        for j, st in enumerate(live):
            n_prompt = len(st["case"]["prompt_token_ids"])
            params = SamplingParams(max_tokens=st["case"]["max_new_tokens"], temperature=0.0)
            req = SampleRequest(params, st["ids"][:n_prompt], st["ids"][n_prompt:], len(st["ids"]) - n_prompt)
            seqs.append(SeqInput(str(j), st["ids"][st["start"]:], st["start"], st["blocks"], sample=req))
        outs = runner.execute(StepInput(seqs))
        for j, st in enumerate(live):
            st["start"] = len(st["ids"])
            st["ids"].append(outs[str(j)].token_id)
    for st in state:
        assert st["ids"][len(st["case"]["prompt_token_ids"]):] == st["case"]["output_token_ids"]


@pytest.mark.quick
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_write_and_rotary_match_reference(dtype):
    from shiftnode_kernels import cpu_ops

    g = torch.Generator().manual_seed(5)
    k_cache = torch.zeros(6, 16, 2, 32, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    key, value = torch.randn(7, 2, 32, generator=g).to(dtype), torch.randn(7, 2, 32, generator=g).to(dtype)
    for slots in (torch.randperm(96, generator=g)[:7], torch.tensor([3, -1, 40, 41, -1, 90, 0])):
        kc, vc = k_cache.clone(), v_cache.clone()
        cpu_ops.reshape_and_cache(key, value, kc, vc, slots)
        ref.reshape_and_cache(key, value, k_cache, v_cache, slots)
        assert torch.equal(kc, k_cache) and torch.equal(vc, v_cache)
    table = ref.rope_cos_sin_cache(1.0 / 10000 ** (torch.arange(0, 32, 2).float() / 32), 128)
    positions = torch.randint(0, 128, (7,), generator=g)
    q = torch.randn(7, 4, 32, generator=g).to(dtype)
    q1, k1, q2, k2 = q.clone(), key.clone(), q.clone(), key.clone()
    cpu_ops.rotary_embedding(positions, q1, k1, table)
    ref.rotary_embedding(positions, q2, k2, table)
    torch.testing.assert_close(q1, q2, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k1, k2, rtol=1e-6, atol=1e-6)


@pytest.mark.quick
@pytest.mark.parametrize("head_dim", [2, 12, 40])
def test_decode_head_dims_off_the_vector_width(decode_kernel, head_dim):
    """Head dims that are not a multiple of the SIMD width (the compiled loops' remainders)."""
    ctx = ragged(10, 120, seed=head_dim) + [1, 17]
    check(*make_case([1] * len(ctx), ctx, 6, 2, head_dim, 16, seed=head_dim))


@pytest.mark.quick
def test_decode_peaked_softmax(decode_kernel):
    """Scores hundreds apart: the kernel's exp clamps below -87 (where exp underflows anyway)."""
    ctx = ragged(12, 200, seed=4)
    args, ref_args = make_case([1] * 12, ctx, 8, 4, 32, 16, seed=4)
    q = args[0] * 40.0
    check((q, *args[1:]), (q, *ref_args[1:]))


@pytest.mark.quick
def test_numba_kernel_zero_contexts_and_prefetch_across_sequences():
    """Direct kernel call with empty contexts first, in the middle and last (they get zeros and the
    prefetch cursor skips them), one-token and exactly-one-block sequences, every block size."""
    for block_size in (8, 16, 32):
        ctx = [0, 5, 0, 0, 3 * block_size + 1, 1, block_size, 0, 70, 0]
        live = [i for i, c in enumerate(ctx) if c]
        args, ref_args = make_case([1] * len(live), [ctx[i] for i in live], 8, 2, 32, block_size, seed=block_size)
        q, k, v, table, _, _, _, scale = args
        full_q = torch.randn(len(ctx), 8, 32)
        full_q[live] = q
        full_table = torch.full((len(ctx), table.shape[1]), -1, dtype=torch.int32)
        full_table[live] = table
        out = torch.full_like(full_q, float("nan"))
        assert cpu_decode_numba.paged_decode(full_q, k, v, full_table, torch.tensor(ctx, dtype=torch.int32), scale, out)
        expect = ref.paged_attention(*ref_args)
        dead = [i for i, c in enumerate(ctx) if not c]
        assert torch.equal(out[dead], torch.zeros_like(out[dead]))
        assert float((out[live] - expect).norm() / expect.norm()) <= TOL[torch.float32]
