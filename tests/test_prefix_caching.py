"""Prefix caching through the HTTP API on stories260k (float32, greedy): a cache hit gives exactly the
tokens of the same request computed from scratch (REF: a node with ``--no-prefix-caching``), reports
``usage.prompt_tokens_details.cached_tokens``, shares blocks between concurrent requests without any
request seeing another's content (KV-REUSE cases B22, B23, B40), and leaves no live KV behind: only
reclaimable cached blocks."""

from __future__ import annotations

import concurrent.futures as cf

import pytest

from support import STORIES, NodeProcess, reference_cases, stream
from test_metrics import scrape

B = 16  # the nodes' --block-size (the default)
NATURAL = reference_cases()[0]["prompt_token_ids"] + reference_cases()[0]["output_token_ids"]  # 205 story tokens


@pytest.fixture(scope="module")
def ref_node():
    node = NodeProcess("--model", str(STORIES), "--no-prefix-caching")
    yield node
    node.close()


@pytest.fixture(scope="module")
def cache_node(stories_node):
    """The shared stories260k node (the same flags: prefix caching is on by default). The prompts here
    start with a salt token (``fresh``) no other test sends first, so each one's first use is a miss."""
    return stories_node


def complete(node: NodeProcess, prompt: list[int], max_tokens: int = 24) -> dict:
    r = node.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                                   "ignore_eos": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()


def tokens(body: dict) -> list[int]:
    return body["choices"][0]["token_ids"]


def cached(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def fresh(salt: int, n: int) -> list[int]:
    """``n`` natural story tokens after a salt token no other test uses, so the first use is a miss."""
    return [300 + salt] + NATURAL[: n - 1]


@pytest.mark.parametrize("length", [B - 1, B, B + 1, 3 * B + 5])
def test_a_hit_equals_the_uncached_request(ref_node, cache_node, length):
    """B22: the same prompt three times; the hits give the first run's tokens and report whole blocks
    short of the last token as cached."""
    prompt = fresh(length, length)
    ref = tokens(complete(ref_node, prompt))
    runs = [complete(cache_node, prompt) for _ in range(3)]
    assert [tokens(r) for r in runs] == [ref] * 3
    assert [cached(r) for r in runs] == [0] + [B * ((length - 1) // B)] * 2
    assert all(r["usage"]["prompt_tokens"] == length for r in runs)
    assert cached(complete(ref_node, prompt)) == 0


@pytest.mark.quick
def test_stream_usage_reports_cached_tokens(cache_node):
    prompt = fresh(90, 2 * B + 3)
    complete(cache_node, prompt, 4)
    events = stream(cache_node.client, "/v1/completions", {"prompt": prompt, "max_tokens": 4, "temperature": 0,
                                                           "stream_options": {"include_usage": True}})
    use = events[-2]["usage"]
    assert use["prompt_tokens"] == 2 * B + 3 and use["prompt_tokens_details"]["cached_tokens"] == 2 * B
    # n=2: the prompt counts once, and so do its cached tokens (B17: never more than the prompt)
    r = cache_node.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0, "n": 2})
    assert r.json()["usage"]["prompt_tokens"] == 2 * B + 3
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 2 * B


def test_concurrent_requests_on_a_fresh_shared_prefix_equal_their_references(ref_node, cache_node):
    """B23: 32 requests at once on a prefix no one has computed yet (admitted in the same steps, so they
    share blocks registered in the step that writes them)."""
    prefix = fresh(91, 3 * B + 5)
    prompts = [prefix + NATURAL[100 + i : 100 + i + 1 + i % 7] for i in range(32)]
    ref = [tokens(complete(ref_node, p, 16)) for p in prompts]
    before = scrape(cache_node)
    with cf.ThreadPoolExecutor(32) as pool:
        got = list(pool.map(lambda p: complete(cache_node, p, 16), prompts))
    assert [tokens(r) for r in got] == ref
    after = scrape(cache_node)
    hits = after["shiftnode_prefix_cache_hits_tokens_total{device=cpu:0}"] - before.get(
        "shiftnode_prefix_cache_hits_tokens_total{device=cpu:0}", 0)
    assert hits >= 16 * 3 * B  # most of them reused the shared head
    assert sum(cached(r) for r in got) == hits
    st = cache_node.wait_idle()
    d = st["devices"][0]
    assert d["kv_blocks_used"] == 0 and d["kv_blocks_reclaimable"] > 0 and d["kv_blocks_cached"] >= 3
    assert d["kv_blocks_free"] == d["kv_blocks_total"]  # reclaimable blocks count as free
    m = scrape(cache_node)
    assert m["shiftnode_kv_blocks_used{device=cpu:0}"] == 0
    assert m["shiftnode_kv_blocks_reclaimable{device=cpu:0}"] == d["kv_blocks_reclaimable"]


def conversation_turns(node: NodeProcess, ref: NodeProcess, conv: int, turns: int) -> list[tuple[list[int], list[int]]]:
    """A multi-turn conversation: each turn's prompt is the last prompt, its answer and a new user
    message (as chat traffic repeats its history). Returns (got, REF) per turn."""
    system = NATURAL[:2 * B + 3]  # shared by every conversation
    prompt = system + NATURAL[60 + conv : 60 + conv + 5]
    out = []
    for t in range(turns):
        got = tokens(complete(node, prompt, 12))
        out.append((got, tokens(complete(ref, prompt, 12))))
        prompt = prompt + got + NATURAL[120 + 3 * t + conv : 124 + 3 * t + conv]
    return out


@pytest.mark.parametrize("mode", ["time-shared", "colocated"])
def test_conversations_on_a_small_pool_never_see_each_others_content(ref_node, mode):
    """B22/B23 under pressure: 8 conversations of 4 turns at once on a pool of 20 blocks, little more
    than one max-length sequence (eviction; in colocated mode, which reserves nothing, preemption too),
    each turn equal to its REF; afterwards no live KV, and the cache is reclaimable."""
    node = NodeProcess("--model", str(STORIES), "--mode", mode, "--max-model-len", "256",
                       "--kv-cache-memory", str(20 * B * 1280), "--max-num-batched-tokens", "64")
    try:
        with cf.ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda c: conversation_turns(node, ref_node, c, 4), range(8)))
        for conv, turns in enumerate(results):
            for t, (got, ref) in enumerate(turns):
                assert got == ref, (conv, t)
        st = node.wait_idle()
        d = st["devices"][0]
        assert d["kv_blocks_used"] == 0 and d["kv_blocks_total"] == 20
        assert d["prefix_cache"]["hit_tokens"] > 0 and d["prefix_cache"]["evictions"] > 0
        assert d["preemptions"] > 0 or mode != "colocated", d
        assert d["kv_blocks_free"] == 20
    finally:
        node.close()


@pytest.mark.parametrize("k", [B - 1, B, B + 1, 2 * B + 7])
def test_decode_side_reuses_its_cached_prefix_and_receives_the_rest(ref_node, pooled_node, k):
    """B40: the decode device holds the first K tokens' full blocks from an earlier hand-off; a request
    sharing those K tokens receives only the blocks after them, at the block boundary below K (the
    partial block always comes from the prefill side), and equals its REF."""
    head = fresh(60 + k, k)
    first = complete(pooled_node, head, 8)
    assert tokens(first) == tokens(complete(ref_node, head, 8))
    before = len(pooled_node.status()["kv_transfers"])
    prompt = head + NATURAL[150 : 150 + 9]
    got = complete(pooled_node, prompt, 20)
    assert tokens(got) == tokens(complete(ref_node, prompt, 20))
    assert cached(got) == B * (k // B)  # the prefill device reused the same prefix
    moved = pooled_node.status()["kv_transfers"][before:]
    assert len(moved) == 1 and moved[0]["dst"] == "cpu:1"
    per_block = 1280 * B  # stories260k: 5 layers x 2 x 4 heads x 8 dims x 4 bytes per token
    assert moved[0]["nbytes"] == (moved[0]["blocks"] - k // B) * per_block
    st = pooled_node.wait_idle()
    assert all(d["kv_blocks_used"] == 0 for d in st["devices"])


def test_time_shared_placement_follows_the_cached_prefix(ref_node):
    """Two devices. A conversation's first turn lands on cpu:1 (cpu:0 is busy decoding a long request);
    its next turn, sent when both devices are idle (where placement alone would pick cpu:0), goes to
    cpu:1, which holds its prefix, and equals its REF."""
    node = NodeProcess("--model", str(STORIES), "--mode", "adaptive", "--devices", "cpu:0,cpu:1")
    try:
        with cf.ThreadPoolExecutor(1) as pool:
            long = pool.submit(complete, node, fresh(210, 20), 400)
            while not any(d["resident_decoding"] for d in node.status()["devices"]):
                pass
            head = fresh(211, 12 * B)
            complete(node, head, 4)
            long.result()
        before = {d["device"]: d["prefix_cache"]["hit_tokens"] for d in node.wait_idle()["devices"]}
        prompt = head + NATURAL[170 : 170 + 6]
        got = complete(node, prompt, 12)
        assert tokens(got) == tokens(complete(ref_node, prompt, 12))
        assert cached(got) == 12 * B
        after = {d["device"]: d["prefix_cache"]["hit_tokens"] for d in node.wait_idle()["devices"]}
        assert {d: after[d] - before[d] for d in after} == {"cpu:0": 0, "cpu:1": 12 * B}
    finally:
        node.close()


def test_a_peer_node_reuses_its_cached_prefix_and_receives_the_rest(ref_node, peer_pair):
    """B40 across nodes: the decode node holds the first K tokens' full blocks from an earlier
    hand-off; the next request sharing them is sent only the blocks after them (TransferAccept's
    cached_blocks), for K around B, and equals its REF."""
    p, d = peer_pair  # the session's prefill node and its decode peer (conftest)
    for k in (B - 1, B, B + 1):
        head = fresh(120 + k, k)
        assert tokens(complete(p, head, 8)) == tokens(complete(ref_node, head, 8))
        before = len(p.status()["kv_transfers"])
        prompt = head + NATURAL[180 : 180 + 9]
        got = complete(p, prompt, 20)
        assert tokens(got) == tokens(complete(ref_node, prompt, 20)), k
        moved = [t for t in p.status()["kv_transfers"][before:] if t["dst"].startswith("peer:")]
        assert len(moved) == 1
        assert moved[0]["nbytes"] == (moved[0]["blocks"] - k // B) * 1280 * B, (k, moved[0])
    assert d.wait_idle()["devices"][0]["kv_blocks_used"] == 0
    assert p.wait_idle()["devices"][0]["kv_blocks_used"] == 0
