"""On a GPU, ``--compile inductor`` gives the eager forward's results on prefill and mixed steps, and
pure decode steps keep replaying their CUDA graphs (issue 31, item 1; skipped without CUDA, run by
``scripts/gpu_check``).

A tiny Llama-shaped model with dummy weights is built by the node's loader with one compiled bucket of 32
tokens (one inductor compile, well under a minute cold), decode graphs attached as ``shiftnode serve``
attaches them; in bfloat16 (the serving dtype: relative error <= 1e-2) and in float32, where the compiled
path must give the eager forward's numbers (<= 1e-5) and the same greedy tokens: the exact check that a
32-layer bf16 model cannot give (its rounding differences grow to a few percent, bench/device/e2e_compiled.py).
"""

from __future__ import annotations

import pytest
import torch

# the quick tier (bash scripts/test --quick) runs every test here (on a GPU machine; elsewhere they skip)
pytestmark = [pytest.mark.quick, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BUCKET = 32
BLOCK = 16
NEAR_TIE_NATS = 0.1  # a greedy choice flipped where eager's top-2 logits are this close is bf16 rounding
TINY = {"architectures": ["LlamaForCausalLM"], "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 512,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}


MAX_REL_ERR = {torch.bfloat16: 1e-2, torch.float32: 1e-5}


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def runner(request):
    from node.config import NodeConfig
    from node.worker.loader import LoadedModel, build_runner
    from node.worker.model_config import ModelConfig
    from node.worker.tokenizer import TextTokenizer
    from shiftnode_kernels.ops import get_ops

    cfg = ModelConfig.from_dict(TINY)
    dtype = request.param
    config = NodeConfig(load_format="dummy", devices=["cuda:0"], dtype=str(dtype).removeprefix("torch."),
                        max_model_len=512, block_size=BLOCK, kv_cache_memory_bytes=64 * 512 * cfg.kv_bytes_per_token(dtype),
                        max_num_seqs=8, attention_backend="triton", seed=0, compile="inductor",
                        compile_sizes=[BUCKET])
    info = LoadedModel(cfg, TextTokenizer.byte_level(), 512, dtype)
    r = build_runner(config, info, "cuda:0", get_ops("triton"))
    assert r.compiled is not None and r.compiled.warmed, "the loader did not compile the forward on CUDA"
    assert r.graphs is not None and r.graphs.captured, "decode graphs are no longer attached beside --compile"
    return r


def _seq(i: int, tokens: list[int], start: int):
    from node.core.sequence import SamplingParams
    from node.worker.runner import SeqInput
    from node.worker.sampler import SampleRequest

    blocks = list(range(1 + i * 8, 1 + (i + 1) * 8))  # 128 positions per sequence
    return SeqInput(f"s{i}", tokens, start, blocks, SampleRequest(SamplingParams(max_tokens=16, temperature=0.0), [], 0, 0))


def _compare(runner, step) -> None:
    """Compiled vs eager final hidden states of ``step`` (relative error <= :data:`MAX_REL_ERR` of the dtype,
    never NaN) and the greedy token of every row (equal; in bf16 flipped only at an eager near tie)."""
    ids, pos, meta = runner._pack(step)
    dev = runner.device
    with torch.inference_mode():
        want = runner.model(torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), runner.kv_cache, meta)
        steps = runner.compiled.steps
        got = runner.compiled.run(ids, pos, meta)
        assert got is not None and runner.compiled.steps == steps + 1, "the step did not run compiled"
        dtype = runner.model.embed_tokens.weight.dtype
        assert got.shape == want.shape and got.dtype == want.dtype == dtype
        assert torch.isfinite(got.float()).all()
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        assert err <= MAX_REL_ERR[dtype], f"compiled vs eager relative error {err:.3g} ({dtype})"
        lw, lg = runner.model.compute_logits(want), runner.model.compute_logits(got)
    top = lw.topk(2, dim=-1)
    differ = (lg.argmax(-1) != top.indices[:, 0]).nonzero().flatten().tolist()
    gaps = [(row, (top.values[row, 0] - top.values[row, 1]).item()) for row in differ]
    tie = NEAR_TIE_NATS if dtype is torch.bfloat16 else 1e-4
    assert all(g <= tie for _, g in gaps), f"greedy tokens differ at rows (row, eager top-2 gap) {gaps}"


def test_prefill_and_mixed_steps_match_eager(runner):
    from node.worker.runner import StepInput

    g = torch.Generator().manual_seed(0)
    tok = lambda n: torch.randint(3, 512, (n,), generator=g).tolist()  # noqa: E731
    a, b = tok(20), tok(8)
    _compare(runner, StepInput([_seq(0, a, 0), _seq(1, b, 0)]))  # 28 tokens, padded to 32; writes both prompts' KV
    # two decode rows beside a 30-token prompt chunk: 32 tokens, max_seqlen_q 30
    _compare(runner, StepInput([_seq(0, tok(1), 20), _seq(1, tok(1), 8), _seq(2, tok(30), 0)]))


def test_pure_decode_steps_keep_their_cuda_graphs(runner):
    from node.worker.runner import StepInput

    replays, steps = runner.graphs.replays, runner.compiled.steps
    out = runner.execute(StepInput([_seq(0, [5], 21), _seq(1, [6], 9)]))
    assert runner.graphs.replays == replays + 1 and runner.compiled.steps == steps
    assert all(0 <= o.token_id < 512 for o in out.values())
    runner.execute(StepInput([_seq(3, [7] * 12, 0)]))  # a prefill step runs compiled, not as a graph
    assert runner.graphs.replays == replays + 1 and runner.compiled.steps == steps + 1
