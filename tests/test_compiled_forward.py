"""``--compile inductor``: the forward compiled per token-count bucket gives the greedy references
exactly, pads steps into its bucket without writing padding to the KV pool, and leaves larger steps
eager. One stories260k runner with a single bucket (8 tokens) is compiled once for the module: 20-45 s
on the busy 2-core machine with a cold inductor cache, under 10 s with a warm one; the module's four
tests then take a few seconds."""

from __future__ import annotations

import argparse

import pytest
import torch

from node.cli import DEFAULT_COMPILE, config_from_args, serve_parser
from node.config import ConfigError, NodeConfig
from node.core.sequence import SamplingParams
from node.worker.compiled_forward import (DEFAULT_COMPILE_SIZES, DEFAULT_CUDA_COMPILE_SIZES, CompiledForward,
                                         compile_sizes, compile_unsupported, inductor_options, traced_ops)
from node.worker.loader import build_runner, load_model_info, select_ops
from node.worker.runner import ModelRunner, SeqInput, StepInput
from node.worker.sampler import SampleRequest
from shiftnode_kernels import reference
from shiftnode_kernels.ops import get_ops
from shiftnode_kernels.custom_ops import StepMetadata, step_metadata, unified_attention
from support import STORIES, reference_cases, require_shared

GREEDY = SamplingParams(max_tokens=256, temperature=0.0)
BLOCKS_PER_SEQ = 32  # 512 positions / 16
BUCKET = 8


def _config(**kw) -> NodeConfig:
    require_shared()
    return NodeConfig(model=str(STORIES), kv_cache_memory_bytes=4 << 20, **kw)


def _runner(config: NodeConfig) -> ModelRunner:
    info = load_model_info(config)
    return build_runner(config, info, "cpu:0", select_ops("auto", "cpu"))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread, as a CPU engine process runs on this 2-core machine: two intra-op threads on a
    busy machine make every parallel GEMM wait for a descheduled thread (100x slower steps)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def compiled(one_thread) -> ModelRunner:
    runner = _runner(_config(compile="inductor", compile_sizes=[BUCKET]))
    assert runner.compiled is not None and runner.compiled.sizes == (BUCKET,) and runner.compiled.warmed
    assert not runner.kv_cache.any(), "compiling (padding-only warm-up runs) wrote to the KV pool"
    return runner


@pytest.fixture(scope="module")
def eager() -> ModelRunner:
    runner = _runner(_config())
    assert runner.compiled is None
    return runner


def _seq(i: int, tokens: list[int], start: int, sample: bool = True) -> SeqInput:
    blocks = list(range(1 + i * BLOCKS_PER_SEQ, 1 + (i + 1) * BLOCKS_PER_SEQ))
    return SeqInput(f"s{i}", tokens, start, blocks, SampleRequest(GREEDY, [], 0, 0) if sample else None)


def _prefill(runner: ModelRunner, i: int, prompt: list[int]) -> int:
    """Prefill in chunks of at most :data:`BUCKET` tokens (chunked prefill); the first token."""
    for at in range(0, len(prompt), BUCKET):
        last = at + BUCKET >= len(prompt)
        out = runner.execute(StepInput([_seq(i, prompt[at : at + BUCKET], at, sample=last)]))
    return out[f"s{i}"].token_id


def _generate(runner: ModelRunner, prompts: list[list[int]], new: int) -> list[list[int]]:
    """Each prompt prefilled alone, then all decoded together, greedily."""
    outs = [[_prefill(runner, i, p)] for i, p in enumerate(prompts)]
    for _ in range(new - 1):
        step = StepInput([_seq(i, [o[-1]], len(p) + len(o) - 1) for i, (p, o) in enumerate(zip(prompts, outs))])
        res = runner.execute(step)
        for i, o in enumerate(outs):
            o.append(res[f"s{i}"].token_id)
    return outs


def test_greedy_references_exact_through_padded_buckets(compiled):
    cases = reference_cases()
    prompts = [c["prompt_token_ids"] for c in cases]
    assert len(cases) < BUCKET and any(len(p) > BUCKET for p in prompts)  # a padded decode batch; a chunked prompt
    new = max(c["max_new_tokens"] for c in cases)
    before = compiled.compiled.steps
    outs = _generate(compiled, prompts, new)
    for c, out in zip(cases, outs):
        assert out[: c["max_new_tokens"]] == c["output_token_ids"], c["prompt"]
    chunks = sum(-(-len(p) // BUCKET) for p in prompts)
    assert compiled.compiled.steps - before == chunks + new - 1  # every step ran compiled
    assert compiled.compiled.fallbacks == 0


@pytest.mark.quick
def test_mixed_step_compiled_and_larger_step_eager_match_eager_runner(compiled, eager):
    cases = reference_cases()
    p0, p1, p2 = (c["prompt_token_ids"] for c in cases[:3])
    for r in (compiled, eager):
        r.execute(StepInput([_seq(0, p0, 0)]))
    first = cases[0]["output_token_ids"][0]
    # A mixed step (one decode row and a prompt chunk, within the bucket), then one over the bucket.
    mixed = StepInput([_seq(0, [first], len(p0)), _seq(1, p1[:4], 0, sample=False)])
    larger = StepInput([_seq(1, p1[4:], 4), _seq(2, p2, 0)])
    assert len(p1[4:]) + len(p2) > BUCKET
    steps = compiled.compiled.steps
    got = [{k: v.token_id for k, v in compiled.execute(s).items() if v.token_id is not None} for s in (mixed, larger)]
    assert compiled.compiled.steps == steps + 1  # the larger step ran eagerly
    want = [{k: v.token_id for k, v in eager.execute(s).items() if v.token_id is not None} for s in (mixed, larger)]
    assert got == want
    assert got[0]["s0"] == cases[0]["output_token_ids"][1]
    assert got[1]["s1"] == cases[1]["output_token_ids"][0]
    assert got[1]["s2"] == cases[2]["output_token_ids"][0]


@pytest.mark.quick
def test_unified_attention_writes_real_rows_only_and_zeroes_padding():
    torch.manual_seed(0)
    kc, vc = torch.zeros(4, 4, 2, 8), torch.zeros(4, 4, 2, 8)
    q, k, v = torch.randn(3, 4, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    meta = StepMetadata(2, torch.tensor([5, 6]), torch.tensor([[1, 2]], dtype=torch.int32),
                        torch.tensor([3], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32), 2)
    kc.view(-1, 2, 8)[4] = torch.randn(2, 8)  # the cached first token of the sequence
    vc.view(-1, 2, 8)[4] = torch.randn(2, 8)
    kr, vr = kc.clone(), vc.clone()
    reference.reshape_and_cache(k[:2], v[:2], kr, vr, meta.slot_mapping)
    want = reference.paged_attention(q[:2], kr, vr, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q, 2, 0.3)
    with step_metadata(meta):
        out = unified_attention(q, k, v, kc, vc, 0.3, "torch")
    assert torch.equal(kc, kr) and torch.equal(vc, vr)  # row 2 (padding) wrote nothing
    torch.testing.assert_close(out[:2], want)
    assert not out[2].any()
    with pytest.raises(RuntimeError, match="step_metadata"):
        unified_attention(q, k, v, kc, vc, 0.3, "torch")


@pytest.mark.quick
def test_decode_steps_plan_once_per_step_on_the_cpu_backend():
    """A pure decode step on the ``cpu`` backend: the first layer converts and checks the step's
    metadata into a plan that the other layers reuse; K/V land in their slots, the output equals the
    reference and padding rows are zeros."""
    from shiftnode_kernels import cpu_decode_numba

    assert cpu_decode_numba.available(), cpu_decode_numba._lazy.error  # Numba is a dependency
    torch.manual_seed(1)
    layers = [(torch.randn(6, 4, 2, 8), torch.randn(6, 4, 2, 8)) for _ in range(2)]
    q, k, v = torch.randn(3, 4, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    # two sequences: contexts 6 (blocks 1, 3) and 1 (block 5); slots of their new tokens 13 and 20
    meta = StepMetadata(2, torch.tensor([13, 20]), torch.tensor([[1, 3], [5, 0]], dtype=torch.int32),
                        torch.tensor([6, 1], dtype=torch.int32), torch.tensor([0, 1, 2], dtype=torch.int32), 1)
    plans = []
    for kc, vc in layers:
        kr, vr = kc.clone(), vc.clone()
        reference.reshape_and_cache(k[:2], v[:2], kr, vr, meta.slot_mapping)
        want = reference.paged_attention(q[:2], kr, vr, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q, 1, 0.3)
        with step_metadata(meta):
            out = unified_attention(q, k, v, kc, vc, 0.3, "cpu")
        plans.append(meta.decode_plan)
        assert torch.equal(kc, kr) and torch.equal(vc, vr)
        torch.testing.assert_close(out[:2], want, rtol=1e-5, atol=1e-6)
        assert out.shape == q.shape and not out[2].any()
    assert isinstance(plans[0], cpu_decode_numba.DecodePlan) and plans[1] is plans[0]


@pytest.mark.quick
def test_flags_sizes_and_where_compile_applies():
    p = argparse.ArgumentParser()
    serve_parser(p.add_subparsers())
    a = p.parse_args(["serve", "--compile", "inductor", "--compile-sizes", "1,8,64"])
    cfg = config_from_args(a)
    assert (cfg.compile, cfg.compile_sizes) == ("inductor", [1, 8, 64])
    assert config_from_args(p.parse_args(["serve"])).compile == DEFAULT_COMPILE  # docs/user-guide.md
    for bad in (["--compile", "jit"], ["--compile-sizes", "1,x"], ["--compile-sizes", "0"]):
        with pytest.raises(SystemExit):
            p.parse_args(["serve", *bad])
    with pytest.raises(ConfigError, match="--compile"):
        NodeConfig(compile="jit").validate()
    assert compile_sizes(2048) == DEFAULT_COMPILE_SIZES
    assert compile_sizes(48, [64, 1, 8, 8, 32]) == (1, 8, 32)
    assert compile_sizes(4, [8]) == (1,)
    assert compile_sizes(4096, None, "cuda") == DEFAULT_CUDA_COMPILE_SIZES
    assert compile_sizes(512, None, "cuda") == (16, 64, 256, 512)
    model = object()
    assert "benchmark" in compile_unsupported(torch.device("cpu"), model)
    assert "benchmark" in compile_unsupported(torch.device("cuda", 0), model)
    assert "CPU and CUDA" in compile_unsupported(torch.device("meta"), model)


@pytest.mark.quick
def test_cuda_devices_are_supported_with_their_own_options(eager):
    """A degree-1 model compiles on CUDA too (no CUDA needed to decide it), with inductor options valid
    there: no C++ wrapper nor CPU thread grain, no CUDA graphs of inductor's own."""
    assert compile_unsupported(torch.device("cuda", 0), eager.model) is None
    assert compile_unsupported(torch.device("cpu"), eager.model) is None
    cpu, cuda = inductor_options(torch.device("cpu")), inductor_options(torch.device("cuda", 0))
    assert cpu["cpp_wrapper"] and "cpp.min_chunk_size" in cpu
    assert cuda == {"size_asserts": False, "triton.cudagraphs": False}
    ops = get_ops("torch")
    on_cuda, on_cpu = traced_ops(ops, "cuda"), traced_ops(get_ops("cpu"), "cpu")
    assert (on_cuda.rms_norm, on_cuda.rotary_embedding, on_cuda.silu_and_mul) == (
        reference.rms_norm, reference.rotary_embedding, reference.silu_and_mul)
    assert on_cpu.backend == "cpu" and on_cpu.rotary_embedding is not reference.rotary_embedding


@pytest.fixture(scope="module")
def cuda_path(one_thread) -> ModelRunner:
    """A runner whose compiled forward traces what a CUDA device traces: the torch reference elementwise
    operators, attention through the Triton kernels (run by Triton's interpreter here, as the tests set
    ``TRITON_INTERPRET=1``), with CUDA's inductor options (the Python wrapper calls the attention op)."""
    runner = _runner(_config())
    runner.compiled = CompiledForward(runner.model, runner.kv_cache, (BUCKET,), ops=traced_ops(get_ops("triton"), "cuda"),
                                      options=inductor_options(torch.device("cuda", 0)))
    runner.compiled.warm_all()
    assert runner.compiled.warmed and set(runner.compiled.compile_ms_by_size) == {BUCKET}
    return runner


def test_cuda_operator_path_gives_the_greedy_references(cuda_path):
    """Chunked prefill (the Triton prefill kernel, ``max_seqlen_q > 1``), padded decode batches and a
    mixed step (two decode rows beside a whole 6-token prompt, ``max_seqlen_q`` 6) through the CUDA
    path's graph give the greedy references exactly."""
    cases = reference_cases()
    prompts = [c["prompt_token_ids"] for c in cases]
    steps = cuda_path.compiled.steps
    outs = _generate(cuda_path, prompts, 4)
    for c, out in zip(cases, outs):
        assert out == c["output_token_ids"][:4], c["prompt"]
    last = cases[3]["prompt_token_ids"]
    assert len(last) == BUCKET - 2
    mixed = StepInput([_seq(0, [outs[0][3]], len(prompts[0]) + 3), _seq(1, [outs[1][3]], len(prompts[1]) + 3),
                       _seq(4, last, 0)])
    got = {k: v.token_id for k, v in cuda_path.execute(mixed).items()}
    assert got == {"s0": cases[0]["output_token_ids"][4], "s1": cases[1]["output_token_ids"][4],
                   "s4": cases[3]["output_token_ids"][0]}
    chunks = sum(-(-len(p) // BUCKET) for p in prompts)
    assert cuda_path.compiled.steps - steps == chunks + 3 + 1 and cuda_path.compiled.fallbacks == 0


@pytest.mark.quick
def test_fake_attention_output_is_contiguous_as_every_backends_is():
    """Inductor plans the attention output's consumers from the fake kernel's strides (and on CUDA no
    size assertion checks them): they must be the real kernels' contiguous ones, also for a query that
    is dense but permuted."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(3, 4, 8).transpose(0, 1)  # [4, 3, 8], dense, not contiguous
        k = v = torch.empty(4, 1, 8)
        kc = vc = torch.empty(2, 4, 1, 8)
        out = unified_attention(q, k, v, kc, vc, 0.3, "torch")
    assert out.shape == q.shape and out.is_contiguous()


def test_a_failed_compile_leaves_a_cuda_device_eager_and_stops_a_cpu_start(monkeypatch, eager):
    """On CUDA a compile that raises is logged and the steps stay eager (the node still starts, as after
    a failed decode-graph capture); on the CPU it still stops the start-up, as before."""
    import types

    from node.worker import loader

    def broken(*args, **kwargs):
        raise RuntimeError("inductor broke")

    monkeypatch.setattr(loader, "CompiledForward", broken)
    runner = types.SimpleNamespace(device=torch.device("cuda", 0), model=eager.model, kv_cache=eager.kv_cache,
                                   compiled=None, compiled_error=None)
    loader.attach_compiled_forward(runner, _config(compile="inductor"), "cuda:0")
    assert runner.compiled is None and "inductor broke" in runner.compiled_error
    runner.device = torch.device("cpu")
    with pytest.raises(RuntimeError, match="inductor broke"):
        loader.attach_compiled_forward(runner, _config(compile="inductor"), "cpu:0")
