"""CPU projections on oneDNN-packed weights (node.worker.cpu_linear) and bfloat16 on the CPU: the packed
float32 runner gives the stories260k greedy references exactly; bfloat16 stays within the documented
tolerance of float32 (logits relative error <= 1e-2, the same greedy tokens over a short run).
stories260k's weights are all under the packing threshold, so the tests of the packed path lower it
(``pack_everything``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from node.config import NodeConfig
from node.core.sequence import SamplingParams
from node.worker import cpu_linear
from node.worker.cpu_linear import linear, pack_weight, packing_unsupported
from node.worker.loader import build_runner, load_model_info, select_ops
from node.worker.runner import ModelRunner, SeqInput, StepInput
from node.worker.sampler import SampleRequest
from support import STORIES, reference_cases, require_shared

GREEDY = SamplingParams(max_tokens=256, temperature=0.0)
BF16_LOGITS_REL_ERR = 1e-2  # docs/user-guide.md, "CPU engines"
BF16_GREEDY_TOKENS = 32  # tokens of each reference that bfloat16 must reproduce


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def pack_everything(monkeypatch):
    monkeypatch.setattr(cpu_linear, "PACK_MIN_ELEMENTS", 0)


def _runner(**kw) -> ModelRunner:
    require_shared()
    config = NodeConfig(model=str(STORIES), kv_cache_memory_bytes=4 << 20, **kw)
    return build_runner(config, load_model_info(config), "cpu:0", select_ops("auto", "cpu"))


def _seq(tokens: list[int], start: int) -> SeqInput:
    return SeqInput("s", tokens, start, list(range(1, 33)), SampleRequest(GREEDY, [], 0, 0))


def _greedy(runner: ModelRunner, prompt: list[int], new: int) -> list[int]:
    out = [runner.execute(StepInput([_seq(prompt, 0)]))["s"].token_id]
    while len(out) < new:
        out.append(runner.execute(StepInput([_seq([out[-1]], len(prompt) + len(out) - 1)]))["s"].token_id)
    return out


def _prompt_logits(runner: ModelRunner, prompt: list[int]) -> torch.Tensor:
    """float32 ``[len(prompt), vocab]`` logits of every prompt row."""
    with torch.inference_mode():
        return runner.model.compute_logits(runner._forward(StepInput([_seq(prompt, 0)])))


@pytest.mark.quick
def test_packed_linear_matches_f_linear_with_and_without_bias():
    assert packing_unsupported(torch.device("cpu"), torch.float32) is None
    torch.manual_seed(0)
    w, b = torch.randn(96, 64), torch.randn(96)
    packed = pack_weight(w)
    assert packed.is_mkldnn
    for rows in (1, 5, 64):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(linear(x, w, None, packed), F.linear(x, w), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(linear(x, w, b, packed), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    wb, xb = w.bfloat16(), torch.randn(3, 64).bfloat16()  # bfloat16 rows run on the packed weight
    torch.testing.assert_close(linear(xb, wb, None, pack_weight(wb)).float(), F.linear(xb.float(), wb.float()),
                               rtol=2e-2, atol=2e-2)
    assert packing_unsupported(torch.device("cpu"), torch.float16) is not None


@pytest.mark.quick
def test_small_weights_stay_plain_and_large_ones_are_packed():
    runner = _runner()  # stories260k: every weight far under the threshold, where F.linear is faster
    assert all(layer.packed is None for layer in runner.model.layers) and runner.model.head_packed is None
    assert runner.model.layers[0].shard.qkv_weight.is_contiguous()
    from node.worker.model_config import ModelConfig
    from node.worker.weights import build_model

    cfg = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "hidden_size": 512, "intermediate_size": 128,
                                 "num_hidden_layers": 1, "num_attention_heads": 8, "num_key_value_heads": 8,
                                 "vocab_size": 300, "max_position_embeddings": 64, "tie_word_embeddings": True})
    model = build_model(cfg, folder=None, load_format="dummy", dtype=torch.float32, device=torch.device("cpu"),
                        max_positions=64, ops=None)
    cpu_linear.pack_model(model)
    p = model.layers[0].packed  # q|k|v [1536, 512] and o [512, 512] packed; gate|up [256, 512], down [512, 128] not
    assert p.qkv is not None and p.o is not None and p.gate_up is None and p.down is None
    assert model.layers[0].shard.qkv_weight.t().is_contiguous() and model.layers[0].shard.down_weight.is_contiguous()
    assert model.head_packed is None  # tied, 300 x 512 rows: under the threshold


def test_packed_float32_runner_gives_the_greedy_references_exactly(pack_everything):
    runner = _runner()
    assert all(layer.packed is not None and layer.packed.qkv.is_mkldnn for layer in runner.model.layers)
    assert runner.model.head_packed is not None and runner.model.head_packed.is_mkldnn
    # float32 projections stored column-major for single-row steps (cpu_linear.linear)
    assert runner.model.layers[0].shard.qkv_weight.t().is_contiguous()
    for case in reference_cases():
        assert _greedy(runner, case["prompt_token_ids"], case["max_new_tokens"]) == case["output_token_ids"], case["prompt"]


def test_a_new_tensor_parallel_view_drops_the_packed_copies(pack_everything):
    runner = _runner()
    model = runner.model
    model.set_tensor_parallel(model.tp)
    assert model.layers[0].packed is None and model.head_packed is None


def test_packing_off_keeps_plain_weights_and_the_same_logits(pack_everything):
    plain, packed = _runner(cpu_weight_packing=False), _runner()
    assert plain.model.layers[0].packed is None and plain.model.head_packed is None
    assert plain.model.layers[0].shard.qkv_weight.is_contiguous()
    prompt = reference_cases()[0]["prompt_token_ids"]
    torch.testing.assert_close(_prompt_logits(packed, prompt), _prompt_logits(plain, prompt), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(packing_unsupported(torch.device("cpu"), torch.bfloat16) is not None,
                    reason="no oneDNN bfloat16 on this CPU: --dtype bfloat16 then runs unpacked")
def test_bfloat16_runner_within_tolerance_of_float32(pack_everything):
    fp32, bf16 = _runner(), _runner(dtype="bfloat16")
    assert bf16.model.layers[0].packed is not None and bf16.kv_cache.dtype == torch.bfloat16
    for case in reference_cases():
        prompt = case["prompt_token_ids"]
        want, got = _prompt_logits(fp32, prompt), _prompt_logits(bf16, prompt)
        rel = ((got - want).norm() / want.norm()).item()
        assert rel <= BF16_LOGITS_REL_ERR, (case["prompt"], rel)
        assert _greedy(bf16, prompt, BF16_GREEDY_TOKENS) == case["output_token_ids"][:BF16_GREEDY_TOKENS], case["prompt"]
