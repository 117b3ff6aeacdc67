"""Speculative decoding (n-gram) end to end on stories260k, the real model: greedy output is token for token
the output without speculation (the reference, and a plain node's on prompts that repeat), seeded sampling
too, stops, max_tokens and EOS end where they would, rejected drafts leave no KV block behind, a sequence
moved between devices after verify steps goes on exactly, and the counts show under vLLM's names."""

from __future__ import annotations

import asyncio

import pytest

from node.config import NodeConfig
from node.core.sequence import SamplingParams
from node.core.spec_config import SpeculativeConfig
from node.runtime.node import Node
from support import STORIES, NodeProcess, generate_moving, reference_cases, stream, stream_text

pytestmark = pytest.mark.slow_only("each test starts in-process nodes of its own, with and without speculation")

# up to 8 sequences speculate: the concurrent requests below (6 sequences) verify drafts beside prompt chunks
SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=2, disable_by_batch_size=8)


async def collect(node: Node, rid: str, prompt: list[int], params: SamplingParams, n: int = 1) -> list[dict]:
    """Each choice's tokens, text, finish reason and logprobs."""
    out = [{"ids": [], "text": "", "finish": None, "lps": []} for _ in range(n)]
    async for _req, d in node.generate(rid, prompt, params, n=n):
        assert d.error is None, d.error
        o = out[d.index]
        o["ids"] += d.token_ids
        o["text"] += d.text
        o["lps"] += d.logprobs
        o["finish"] = d.finish_reason or o["finish"]
    return out


async def staggered(delay_s: float, coro):
    await asyncio.sleep(delay_s)
    return await coro


def repeating_prompts() -> list[list[int]]:
    """Prompts whose continuations copy spans of them: a story, its greedy continuation, and the story again."""
    cases = reference_cases()
    return [c["prompt_token_ids"] + c["output_token_ids"][:60] + c["prompt_token_ids"] + c["output_token_ids"][:8]
            for c in cases[:3]]


def config(mode: str = "adaptive", **kw) -> NodeConfig:
    return NodeConfig(model=str(STORIES), mode=mode, imbalance_threshold=0.0, **kw)


def test_greedy_output_is_unchanged_and_rejected_drafts_leave_no_blocks():
    cases = reference_cases()
    greedy = [SamplingParams(max_tokens=c["max_new_tokens"], temperature=0.0) for c in cases]
    rep_params = SamplingParams(max_tokens=80, temperature=0.0)

    async def go():
        # colocated: every step may mix (the adaptive policy may prefill a burst in a window of its own)
        plain, spec = await Node.create(config("colocated")), await Node.create(config("colocated", speculative_config=SPEC))
        plain.start()
        spec.start()
        try:
            ref_rep = [await collect(plain, f"p{i}", p, rep_params) for i, p in enumerate(repeating_prompts())]
            one = [await collect(spec, f"a{i}", c["prompt_token_ids"], g) for i, (c, g) in enumerate(zip(cases, greedy))]
            # several at once: verify items of three sequences in one step, beside other sequences' prompts
            many = await asyncio.gather(*[collect(spec, f"b{i}", c["prompt_token_ids"], g, n=1 + i % 2)
                                          for i, (c, g) in enumerate(zip(cases, greedy))])
            # staggered: each prompt arrives while the ones before it decode, so its chunk shares a step with their drafts
            rep = await asyncio.gather(*[staggered(0.15 * i, collect(spec, f"r{i}", p, rep_params))
                                         for i, p in enumerate(repeating_prompts())])
            (e,) = spec.engines
            return (ref_rep, one, many, rep, e.spec.stats, e.spec.rolled_back_blocks, e.batcher.ledger,
                    spec.metrics.render().decode())
        finally:
            await plain.close()
            await spec.close()

    ref_rep, one, many, rep, stats, rolled_back, ledger, metrics = asyncio.run(go())
    for c, got in zip(cases, one):
        assert got[0]["ids"] == c["output_token_ids"] and got[0]["text"] == c["output_text"]
    for c, got in zip(cases, many):
        for choice in got:
            assert choice["ids"] == c["output_token_ids"]
    assert [r[0]["ids"] for r in rep] == [r[0]["ids"] for r in ref_rep]
    assert stats.drafts > 50 and stats.accepted_tokens > 50 and stats.accepted_tokens < stats.draft_tokens
    assert rolled_back > 0  # some verify steps had drafts in a block no kept token reached
    assert ledger.num_used == 0
    ledger.check()
    for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_draft_acceptance_rate"):
        assert f"{name}{{" in metrics, name
    assert f'vllm:spec_decode_num_accepted_tokens_total{{model_name="{config().model_name}"}} {float(stats.accepted_tokens)}' in metrics


def test_stops_lengths_seeds_and_logprobs_are_those_without_speculation():
    case = reference_cases()[1]  # its output repeats itself: several drafts are kept per step
    prompt, ids, text = case["prompt_token_ids"], case["output_token_ids"], case["output_text"]
    stop_id = ids[40]
    cut = text.index("with the box")
    checks = [SamplingParams(max_tokens=m, temperature=0.0) for m in (1, 2, 3, 5, 17, 46)]
    checks += [SamplingParams(max_tokens=100, temperature=0.0, stop_token_ids=(stop_id,)),
               SamplingParams(max_tokens=100, temperature=0.0, stop=("with the box",)),
               SamplingParams(max_tokens=100, temperature=0.0, stop=("with the box",), include_stop_str_in_output=True),
               SamplingParams(max_tokens=60, temperature=0.8, seed=7),
               SamplingParams(max_tokens=60, temperature=0.7, top_p=0.9, seed=11),
               SamplingParams(max_tokens=60, temperature=1.0, top_k=8, seed=5),
               SamplingParams(max_tokens=40, temperature=0.0, logprobs=2),
               SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=False)]

    async def go():
        plain, spec = await Node.create(config()), await Node.create(config(speculative_config=SPEC))
        plain.start()
        spec.start()
        try:
            a = [await collect(plain, f"p{i}", prompt, p) for i, p in enumerate(checks)]
            b = [await collect(spec, f"s{i}", prompt, p) for i, p in enumerate(checks)]
            return a, b, spec.engines[0].spec.stats.accepted_tokens, spec.engines[0].batcher.ledger.num_used
        finally:
            await plain.close()
            await spec.close()

    plain, spec, accepted, used = asyncio.run(go())
    for p, (x,), (y,) in zip(checks, plain, spec):
        assert (y["ids"], y["text"], y["finish"]) == (x["ids"], x["text"], x["finish"]), p
        assert len(y["lps"]) == (len(y["ids"]) if p.logprobs is not None else 0)
        for u, v in zip(x["lps"], y["lps"]):
            assert u.token_id == v.token_id and u.logprob == pytest.approx(v.logprob, abs=1e-4)
            assert [t for t, _ in u.top] == [t for t, _ in v.top]
    assert [x["finish"] for (x,) in spec[:6]] == ["length"] * 6 and [len(x["ids"]) for (x,) in spec[:6]] == [1, 2, 3, 5, 17, 46]
    assert spec[6][0]["finish"] == "stop" and spec[6][0]["ids"][-1] == stop_id
    assert spec[7][0]["text"] == text[:cut] and spec[8][0]["text"] == text[: cut + len("with the box")]
    assert accepted > 0 and used == 0


def test_a_sequence_moved_after_verify_steps_goes_on_exactly():
    """Decoding with speculation, choice 0 moves cpu:0 → cpu:1 after 30 tokens and back after 90: each move
    carries the KV of the kept tokens only (the rejected drafts' blocks are gone), and the output is the
    reference's, token for token. The case whose output repeats itself throughout (drafts are kept before,
    between and after the moves, whether they are looked up on known tokens or after a guessed one)."""
    case = reference_cases()[1]

    async def go():
        node = await Node.create(NodeConfig(model=str(STORIES), devices=["cpu:0", "cpu:1"], imbalance_threshold=0.0,
                                            speculative_config=SPEC))
        node.start()
        try:
            params = SamplingParams(max_tokens=case["max_new_tokens"], temperature=0.0)
            got, moves = await generate_moving(node, "m", case["prompt_token_ids"], params)
            assert all(rec is not None for rec, _ in moves)
            moved = [(rec.blocks, -(-computed // 16)) for rec, computed in moves]  # no rejected draft's block moved
            stats = [e.spec.stats for e in node.engines]
            return got, moved, [e.batcher.ledger.num_used for e in node.engines], stats
        finally:
            await node.close()

    got, moved, used, stats = asyncio.run(go())
    assert got == case["output_token_ids"]
    assert len(moved) == 2 and all(sent == needed for sent, needed in moved) and used == [0, 0]
    assert all(s.accepted_tokens > 0 for s in stats)  # both devices verified drafts, before and after a move


def test_api_front_ends_stream_the_kept_tokens_exactly():
    """Through ``--api-processes 2`` (the control loop sends token ids only; a front end detokenizes and ends
    stop strings): greedy streams equal the reference's text, a verify step's tokens come as one chunk of
    several, a stop string cuts the text where it would, and ``/metrics`` counts the drafts under vLLM's names."""
    cases = reference_cases()
    node = NodeProcess("--model", str(STORIES), "--api-processes", "2", "--speculative-config",
                       '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}')
    try:
        multi = 0
        for c in cases:
            events = stream(node.client, "/v1/completions", {"prompt": c["prompt_token_ids"], "temperature": 0,
                                                             "max_tokens": c["max_new_tokens"], "return_token_ids": True})
            assert stream_text(events)[0] == c["output_text"]
            chunks = [e["choices"][0].get("token_ids") or [] for e in events if e != "[DONE]" and e.get("choices")]
            assert [t for ch in chunks for t in ch] == c["output_token_ids"]
            multi += sum(1 for ch in chunks if len(ch) > 1)
        assert multi > 10  # verify steps kept several tokens, streamed together
        c = cases[1]
        cut = c["output_text"].index("with the box")
        events = stream(node.client, "/v1/completions", {"prompt": c["prompt_token_ids"], "temperature": 0,
                                                         "max_tokens": 100, "stop": ["with the box"]})
        assert stream_text(events)[0] == c["output_text"][:cut]
        metrics = node.client.get("/metrics").text
        drafts = [line for line in metrics.splitlines() if line.startswith("vllm:spec_decode_num_drafts_total{")]
        assert drafts and float(drafts[0].split()[-1]) > 0
        # a stop string is ended by the front end, which then tells the control loop: its blocks go a moment later
        status = node.wait_idle()["devices"][0]
        assert status["speculative"]["accepted_tokens"] > 0 and status["kv_blocks_used"] == 0
    finally:
        node.close()


def test_grammar_rows_decode_one_token_beside_verify_items():
    """A structured-output choice (never speculated) in the same steps as verify items: its mask rows are
    numbered over every sampled row of the step, so its output is the plain node's, token for token, and
    the speculating choice beside it keeps drafts."""
    from node.core.grammar_spec import GrammarSpec

    prompt = repeating_prompts()[1]
    # digits only: nothing the model would write unmasked, so a mask on the wrong row shows in both choices
    json_params = SamplingParams(max_tokens=40, temperature=0.0, grammar=GrammarSpec("regex", "[0-9]{1,30}"))
    free = SamplingParams(max_tokens=160, temperature=0.0)

    async def both(node: Node, tag: str):
        # the free choice first; the grammar choice arrives once the free one is decoding (on the speculating node,
        # once a step verified its drafts), and the free one goes on four times as long, so the grammar choice's
        # tokens share steps with verify items however slow the host
        decoding = asyncio.Event()
        node.engines[0].step_listeners.append(lambda e, plan, s: decoding.set() if any(
            it.draft or (it.num_tokens == 1 and node.engines[0].spec is None) for it in plan.items) else None)

        async def grammar_after_decoding():
            await decoding.wait()
            return await collect(node, f"{tag}-j", prompt, json_params)

        # the grammar compiled first (its cache): the grammar choice's prompt is scheduled as soon as it arrives,
        # not after a compile that may outlast the free choice
        await collect(node, f"{tag}-warm", prompt, SamplingParams(max_tokens=2, temperature=0.0, grammar=json_params.grammar))
        f, j = await asyncio.gather(collect(node, f"{tag}-f", prompt, free), grammar_after_decoding())
        return j, f

    async def go():
        # colocated: every step may mix a prompt chunk with decodes (adaptive may prefill in a window of its own)
        plain = await Node.create(config("colocated"))
        spec = await Node.create(config("colocated", speculative_config=SPEC))
        plain.start()
        spec.start()
        # steps whose grammar row comes after a verify item's rows (its mask row's index counts them): the grammar
        # choice's prompt chunk (a mixed step) or one of its decode tokens
        mixed = []

        def after_verify(e, plan, s):
            kinds = [("verify" if it.draft else "grammar" if it.seq.params.grammar is not None else "") for it in plan.items]
            mixed.append("verify" in kinds and "grammar" in kinds[kinds.index("verify"):])

        spec.engines[0].step_listeners.append(after_verify)
        try:
            return await both(plain, "p"), await both(spec, "s"), spec.engines[0].spec.stats.accepted_tokens, any(mixed)
        finally:
            await plain.close()
            await spec.close()

    (pj, pf), (sj, sf), accepted, mixed = asyncio.run(go())
    assert mixed, "no step sampled a grammar row after a verify item's rows"
    assert sj[0]["ids"] == pj[0]["ids"] and sj[0]["text"] == pj[0]["text"] and sj[0]["text"].isdigit()
    assert sf[0]["ids"] == pf[0]["ids"]
    assert accepted > 0
