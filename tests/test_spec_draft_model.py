"""Speculative decoding with a draft model (``--speculative-config '{"model": PATH, ...}'``) end to end on
stories260k, the real model, in both engine layouts: stories260k drafting for itself gives the reference's
greedy output with every draft kept; a draft with perturbed weights (same vocabulary, other predictions)
keeps greedy and seeded sampled output token for token the plain node's while drafts are rejected and their
blocks rolled back, leaving none behind; a sequence moved between devices has its draft KV recomputed on
arrival, as is a pooled hand-off's (every self-draft still kept); the counts show under vLLM's names; drafts the target cannot verify are
refused at start-up, naming the key."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_copies import copy_model
from node.config import NodeConfig
from node.core.sequence import SamplingParams
from node.core.spec_config import SpeculativeConfig
from node.runtime.node import Node
from node.runtime.node_status import node_status
from node.worker.draft_model import check_draft_model
from node.worker.loader import StartupError, load_model_info
from support import STORIES, generate_moving, reference_cases

# the quick tier runs the start-up refusals; the others start in-process nodes of their own


def perturbed_draft(tmp_path: Path, scale: float = 0.1, seed: int = 0) -> Path:
    """stories260k with Gaussian noise of ``scale`` times each weight matrix's own standard deviation added to
    every matrix (norms kept): the same vocabulary and geometry, predictions that differ often (at 0.1 about a
    third of the drafts are rejected on the reference prompts)."""
    folder = copy_model(tmp_path, f"draft-{scale}-{seed}")
    tensors = load_file(folder / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    for name, t in tensors.items():
        if t.dim() == 2:
            tensors[name] = (t + torch.randn(t.shape, generator=gen, dtype=t.dtype) * t.std() * scale).contiguous()
    save_file(tensors, folder / "model.safetensors")
    return folder


def spec(draft: Path | str, k: int = 3) -> SpeculativeConfig:
    return SpeculativeConfig(model=str(draft), num_speculative_tokens=k, disable_by_batch_size=8)


def config(draft: Path | str | None, mode: str = "colocated", **kw) -> NodeConfig:
    return NodeConfig(model=str(STORIES), mode=mode, imbalance_threshold=0.0,
                      speculative_config=None if draft is None else spec(draft), **kw)


async def collect(node: Node, rid: str, prompt: list[int], params: SamplingParams) -> list[int]:
    ids: list[int] = []
    async for _req, d in node.generate(rid, prompt, params):
        assert d.error is None, d.error
        ids += d.token_ids
    return ids


def greedy(case: dict) -> SamplingParams:
    return SamplingParams(max_tokens=case["max_new_tokens"], temperature=0.0)


@pytest.mark.parametrize("layout", ["process", "thread"])
def test_stories260k_drafting_for_itself_keeps_every_draft_and_the_reference_output(layout):
    cases = reference_cases()

    async def go():
        node = await Node.create(config(STORIES, engine_layout=layout))
        node.start()
        try:
            one = [await collect(node, f"a{i}", c["prompt_token_ids"], greedy(c)) for i, c in enumerate(cases)]
            (e,) = node.engines
            st = e.spec.stats
            alone = (st.drafts, st.draft_tokens, st.accepted_tokens)
            # several at once: the draft catches up on several sequences' prompts in one batch beside verify items
            many = await asyncio.gather(*[collect(node, f"b{i}", c["prompt_token_ids"], greedy(c))
                                          for i, c in enumerate(cases)])
            return one, many, alone, e.batcher.ledger
        finally:
            await node.close()

    one, many, (drafts, draft_tokens, accepted), ledger = asyncio.run(go())
    assert one == [c["output_token_ids"] for c in cases]
    assert many == [c["output_token_ids"] for c in cases]
    assert drafts > 50 and accepted == draft_tokens  # acceptance rate 1.0: the draft is the target
    assert ledger.num_used == 0
    ledger.check()


def test_a_different_draft_keeps_greedy_and_seeded_output_and_leaks_no_block(tmp_path):
    """A perturbed stories260k drafts: greedy and seeded sampled choices are the plain node's token for token
    (the kept tokens are the target's own draws: a greedy draft is a point mass, node.worker.draft_model), some
    drafts are rejected and their blocks rolled back, no block stays used, and /metrics has vLLM's names."""
    cases = reference_cases()
    draft = perturbed_draft(tmp_path)
    sampled = [SamplingParams(max_tokens=60, temperature=t, seed=s, top_p=p)
               for t, s, p in ((0.8, 7, 1.0), (1.0, 11, 0.9), (0.6, 3, 1.0), (1.0, 5, 1.0))]
    prompt = cases[1]["prompt_token_ids"]

    async def run(node: Node, tag: str):
        g = await asyncio.gather(*[collect(node, f"{tag}g{i}", c["prompt_token_ids"], greedy(c))
                                   for i, c in enumerate(cases)])
        s = [await collect(node, f"{tag}s{i}", prompt, p) for i, p in enumerate(sampled)]
        return g, s

    async def go():
        plain, spec_node = await Node.create(config(None)), await Node.create(config(draft))
        plain.start()
        spec_node.start()
        try:
            want = await run(plain, "p")
            got = await run(spec_node, "s")
            (e,) = spec_node.engines
            assert node_status(spec_node)["devices"][0]["speculative"]["method"] == "draft_model"
            return want, got, e.spec.stats, e.spec.rolled_back_blocks, e.batcher.ledger, spec_node.metrics.render().decode()
        finally:
            await plain.close()
            await spec_node.close()

    (want_g, want_s), (got_g, got_s), stats, rolled_back, ledger, metrics = asyncio.run(go())
    assert got_g == [c["output_token_ids"] for c in cases] == want_g
    assert got_s == want_s
    assert stats.drafts > 50 and 0 < stats.accepted_tokens < stats.draft_tokens
    assert 0.05 < stats.acceptance_rate < 0.95, stats.acceptance_rate
    assert rolled_back > 0
    assert ledger.num_used == 0
    ledger.check()
    name = config(None).model_name
    assert f'vllm:spec_decode_num_draft_tokens_total{{model_name="{name}"}} {float(stats.draft_tokens)}' in metrics
    assert f'vllm:spec_decode_num_accepted_tokens_total{{model_name="{name}"}} {float(stats.accepted_tokens)}' in metrics
    assert "vllm:spec_decode_num_drafts_total{" in metrics and "vllm:spec_decode_draft_acceptance_rate{" in metrics


def test_a_moved_sequence_has_its_draft_kv_recomputed_on_arrival():
    """Self-drafting, choice 0 moves cpu:0 → cpu:1 after 30 tokens and back after 90. The move copies the
    target's KV only; the arriving engine's draft recomputes the sequence's draft KV at its first verify step,
    so every draft is still kept on both devices (a draft reading stale or missing KV would propose other
    tokens), and the output is the reference's."""
    case = reference_cases()[0]

    async def go():
        # no prefix cache: the sequence comes back to blocks other than those it left (whose draft KV is stale)
        node = await Node.create(NodeConfig(model=str(STORIES), devices=["cpu:0", "cpu:1"], imbalance_threshold=0.0,
                                            prefix_caching=False, speculative_config=spec(STORIES)))
        node.start()
        try:
            got, moves = await generate_moving(node, "m", case["prompt_token_ids"], greedy(case))
            moved = sum(rec is not None for rec, _ in moves)
            return got, moved, [e.batcher.ledger.num_used for e in node.engines], [e.spec.stats for e in node.engines]
        finally:
            await node.close()

    got, moved, used, stats = asyncio.run(go())
    assert got == case["output_token_ids"]
    assert moved == 2 and used == [0, 0]
    for st in stats:
        assert st.drafts > 0 and st.accepted_tokens == st.draft_tokens


def test_pooled_hand_offs_recompute_the_draft_kv_on_the_decode_device():
    """Pooled mode: cpu:0 prefills, cpu:1 decodes what is handed to it (the target's KV only). The decode
    device's draft catches up on each handed-off prompt at its first verify step: every self-draft is kept
    there, the prefill device never drafts, and the outputs are the reference's."""
    cases = reference_cases()

    async def go():
        node = await Node.create(NodeConfig(model=str(STORIES), mode="pooled", prefill_devices=["cpu:0"],
                                            decode_devices=["cpu:1"], speculative_config=spec(STORIES)))
        node.start()
        try:
            got = await asyncio.gather(*[collect(node, f"h{i}", c["prompt_token_ids"], greedy(c))
                                         for i, c in enumerate(cases)])
            by_device = {e.device_id: e for e in node.engines}
            return got, by_device["cpu:0"].spec.stats, by_device["cpu:1"].spec.stats, [
                e.batcher.ledger.num_used for e in node.engines]
        finally:
            await node.close()

    got, prefill, decode, used = asyncio.run(go())
    assert got == [c["output_token_ids"] for c in cases]
    assert prefill.drafts == 0 and decode.drafts > 20 and decode.accepted_tokens == decode.draft_tokens
    assert used == [0, 0]


@pytest.mark.quick
def test_the_draft_proposes_the_reference_tokens_and_recomputes_what_it_lost():
    """The engine's draft model alone (stories260k, 64 blocks of 16): its greedy proposals continue a
    reference story as the reference does, the catch-up covers exactly the tokens it has not seen, and after a
    cut (a block table replaced) its pool is read again only where it was rewritten: zeroing the pool and
    cutting to 0 gives the same proposals, while zeroing it without the cut changes them."""
    from node.worker.draft_model import DraftRequest, build_draft_model
    from node.worker.loader import select_ops

    case = reference_cases()[0]
    cfg = config(STORIES)
    draft = build_draft_model(cfg, load_model_info(cfg), "cpu:0", select_ops("auto", "cpu"), 64)
    toks = case["prompt_token_ids"] + case["output_token_ids"][:20]
    out = case["output_token_ids"]
    blocks = list(range(10, 10 + -(-(len(toks) + 8) // 16)))
    got = draft.propose([DraftRequest("s", toks, blocks, 4)])
    assert got == [out[20:24]] and draft.known["s"] == len(toks)
    draft.verified("s", len(toks), 4, 4)  # all kept: the draft computed the first 3 drafts' KV, not the 4th
    assert draft.known["s"] == len(toks) + 3
    longer = toks + out[20:25]  # the 4 drafts and the bonus token
    assert draft.propose([DraftRequest("s", longer, blocks, 3)]) == [out[25:28]]
    draft.verified("s", len(longer), 3, 1)
    assert draft.known["s"] == len(longer) + 1
    draft.runner.kv_cache.zero_()
    draft.cut("s", 0)
    again = toks + out[20:27]
    assert draft.propose([DraftRequest("s", again, blocks, 3)]) == [out[27:30]]
    draft.runner.kv_cache.zero_()  # stale pool, bookkeeping not told: the proposals go wrong
    assert draft.propose([DraftRequest("s", again, blocks, 3)]) != [out[27:30]]


def _folder_with_config(tmp_path: Path, **changes) -> Path:
    folder = copy_model(tmp_path, "changed")
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.quick
@pytest.mark.parametrize("case, words", [
    ("vocab", "vocab_size 1000 differs from the target's 512"),
    ("positions", "max_position_embeddings 64 is below --max-model-len"),
    ("missing", "no config.json"),
    ("tp", "single-device engines only"),
    ("benchmark", "--benchmark-model"),
])
def test_drafts_the_target_cannot_verify_are_refused_naming_the_key(tmp_path, case, words):
    draft: Path | str = STORIES
    kw: dict = {}
    if case == "vocab":
        draft = _folder_with_config(tmp_path, vocab_size=1000)
    elif case == "positions":
        draft = _folder_with_config(tmp_path, max_position_embeddings=64)
    elif case == "missing":
        draft = tmp_path / "nowhere"
    elif case == "tp":
        kw = dict(devices=["cpu:0", "cpu:1"], tensor_parallel_size=2)
    else:
        kw = dict(benchmark_model="zero")
    cfg = config(draft, **kw)
    with pytest.raises(StartupError, match="--speculative-config model") as e:
        check_draft_model(cfg, load_model_info(cfg))
    assert words in str(e.value)


def test_a_node_refuses_a_draft_of_another_vocabulary_at_start(tmp_path):
    async def go():
        await Node.create(config(_folder_with_config(tmp_path, vocab_size=1000)))

    with pytest.raises(StartupError, match="--speculative-config model .*vocab_size 1000"):
        asyncio.run(go())
