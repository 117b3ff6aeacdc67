"""Our model against Hugging Face transformers on random weights for every tiny config family.

Each ``tiny_configs/`` folder is built with transformers from a fixed seed, saved as a checkpoint, and
loaded by the node's loader; logits over every position of a few prompts must agree within float32
tolerance and greedy generations must be identical.
"""

import asyncio
import shutil

import pytest
import torch
import transformers

import shiftnode_kernels.reference as ops
from node.config import NodeConfig
from node.core.sequence import SamplingParams
from node.runtime.node import Node
from node.worker.model import AttentionMetadata
from node.worker.model_config import ModelConfig
from node.worker.weights import build_model
from support import SHARED, STORIES, require_shared

FAMILIES = ["llama3-style", "qwen2-style", "qwen3-style"]
PROMPTS = [[1, 403, 407, 261, 378], [1, 5, 77, 300, 12, 9, 400, 33, 21, 64, 65, 66, 101, 250, 17, 3, 2, 8, 9]]


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    require_shared()
    src = SHARED / "models" / "stories260k" / "tiny_configs" / request.param
    torch.manual_seed(0)
    cfg = transformers.AutoConfig.from_pretrained(src)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # HF initialises norms to 1 and biases to 0: perturb them so they are tested
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(torch.randn_like(p) * 0.1)
    out = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(out, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(STORIES / f, out / f)
    return out, model


@pytest.mark.quick
def test_logits_match_transformers(checkpoint):
    folder, hf = checkpoint
    cfg = ModelConfig.from_folder(folder)
    ours = build_model(cfg, folder=folder, load_format="safetensors", dtype=torch.float32,
                       device=torch.device("cpu"), max_positions=256, ops=ops)
    bs, nb = 8, 16
    kv = torch.zeros(cfg.num_layers, 2, nb, bs, cfg.num_kv_heads, cfg.head_dim)
    # Both prompts in one varlen batch, on disjoint blocks.
    tables = [list(range(0, 4)), list(range(4, 8))]
    ids, pos, slots, cu, lens = [], [], [], [0], []
    for p, table in zip(PROMPTS, tables):
        ids += p
        pos += range(len(p))
        slots += [table[i // bs] * bs + i % bs for i in range(len(p))]
        cu.append(cu[-1] + len(p))
        lens.append(len(p))
    meta = AttentionMetadata(torch.tensor(slots), torch.tensor(tables, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32),
                             torch.tensor(cu, dtype=torch.int32), max(lens))
    logits = ours.compute_logits(ours(torch.tensor(ids), torch.tensor(pos), kv, meta))
    for i, p in enumerate(PROMPTS):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0]
        got = logits[cu[i] : cu[i + 1]]
        err = (got - ref).abs().max().item()
        assert err < 1e-4 * max(1.0, ref.abs().max().item()), err


def test_greedy_generation_matches_transformers(checkpoint):
    folder, hf = checkpoint

    async def ours():
        node = await Node.create(NodeConfig(model=str(folder), max_model_len=128, kv_cache_memory_bytes=8 << 20))
        node.start()
        try:
            outs = []
            for p in PROMPTS:
                toks = []
                async for _, d in node.generate(f"r{len(outs)}", p, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)):
                    toks += d.token_ids
                outs.append(toks)
            return outs
        finally:
            await node.close()

    got = asyncio.run(ours())
    for p, toks in zip(PROMPTS, got):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(p):].tolist()
        assert toks == ref
