"""Liveness under KV pressure, end to end (issue: time-shared mode must always make progress).

The two reproductions of the time-shared deadlock, in time-shared and colocated modes: full-length
streams (``ignore_eos``) far beyond what the KV pool holds at once, so sequences are preempted and
recomputed. Every stream ends with the greedy tokens of the same request on an unpressured node, and
every block is free afterwards.
"""

from __future__ import annotations

import concurrent.futures as cf

import pytest

from support import STORIES, NodeProcess, sse_events

pytestmark = pytest.mark.slow_only("each case starts a node of its own with a deliberately small KV pool")

BLOCK_BYTES = 5 * 2 * 16 * 4 * 8 * 4  # stories260k: layers x (K, V) x block size x KV heads x head dim x fp32
PROMPTS = ["Once upon a time", "Lily and Ben went to the park", "The little dog was sad"]
CASES = [  # (KV blocks, concurrent streams, max_tokens): 128 blocks hold 4 of the 12 full-context streams
    pytest.param(128, 12, 480, id="128blocks-12x480"),
    pytest.param(48, 8, 400, id="48blocks-8x400"),
]


def body(i: int, max_tokens: int) -> dict:
    return {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "return_token_ids": True}


def streamed_ids(node: NodeProcess, b: dict) -> list[int]:
    with node.client.stream("POST", "/v1/completions", json={**b, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        events = sse_events(list(r.iter_lines()))
    assert not any(e != "[DONE]" and "error" in e for e in events), events[-2:]
    ids = [t for e in events if e != "[DONE]" for c in e["choices"] for t in c.get("token_ids") or []]
    return ids


@pytest.fixture(scope="module")
def references(stories_node) -> dict[tuple[str, int], list[int]]:
    """Each prompt's greedy ``ignore_eos`` tokens on the unpressured shared node, for every case's
    ``max_tokens``. One request per prompt, at the longest length: a shorter greedy run is the longer one's
    prefix (each token depends only on the prompt and the tokens before it)."""
    longest = max(c.values[2] for c in CASES)
    out = {}
    for i, p in enumerate(PROMPTS):
        r = stories_node.client.post("/v1/completions", json=body(i, longest))
        ids = r.json()["choices"][0]["token_ids"]
        assert len(ids) == longest, r.text
        for _, _, max_tokens in (c.values for c in CASES):
            out[(p, max_tokens)] = ids[:max_tokens]
    return out


@pytest.mark.parametrize("mode", ["time-shared", "colocated"])
@pytest.mark.parametrize("blocks,streams,max_tokens", CASES)
def test_full_length_streams_beyond_the_pool_all_finish_exactly(request, mode, blocks, streams, max_tokens):
    node = NodeProcess("--model", str(STORIES), "--mode", mode, "--kv-cache-memory", str(blocks * BLOCK_BYTES),
                       wait=False)
    try:
        references = request.getfixturevalue("references")  # computed once, the first time while the node starts
        node.wait_up()
        with cf.ThreadPoolExecutor(streams) as pool:
            got = list(pool.map(lambda i: streamed_ids(node, body(i, max_tokens)), range(streams)))
        for i, ids in enumerate(got):
            assert len(ids) == max_tokens
            assert ids == references[(PROMPTS[i % len(PROMPTS)], max_tokens)], f"stream {i} differs"
        st = node.wait_idle()
        assert all(d["kv_blocks_used"] == 0 for d in st["devices"]), st
        preemptions = sum(d["preemptions"] for d in st["devices"])
        assert preemptions > 0, "the load did not preempt: it does not test what it claims"
    finally:
        node.close()


def test_a_request_no_empty_device_could_hold_is_a_400_not_a_hang():
    """``n`` copies of a prompt that together exceed a whole device's pool can never be placed."""
    # the role policies' placement (adaptive): it reserves n x the prompt (colocated shares the copies' prompt
    # blocks and serves this request)
    node = NodeProcess("--model", str(STORIES), "--mode", "adaptive", "--kv-cache-memory", str(16 * BLOCK_BYTES),
                       "--max-model-len", "256")
    try:
        r = node.client.post("/v1/completions", json={"prompt": "Once upon a time " * 12, "max_tokens": 4, "n": 8})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "kv_capacity_exceeded" and "KV" in r.json()["error"]["message"]
        # streamed, the same answer before any event (it used to be a 200 whose stream held the error)
        r = node.client.post("/v1/completions", json={"prompt": "Once upon a time " * 12, "max_tokens": 4, "n": 8,
                                                      "stream": True})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "kv_capacity_exceeded"
        r = node.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Once upon a time " * 12}],
                                                           "max_tokens": 4, "n": 8, "stream": True})
        assert r.status_code == 400 and r.json()["error"]["code"] == "kv_capacity_exceeded", r.text
        ok = node.client.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 4})
        assert ok.status_code == 200
        node.wait_idle()
    finally:
        node.close()
