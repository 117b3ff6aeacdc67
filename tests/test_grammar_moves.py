"""Issue 44 item 1: a sequence's grammar state travels with it. Each move below rebuilds the matcher on
the engine that samples next from the tokens already emitted, so the greedy output equals the
unmoved run's and validates against its schema:

* a KV move between devices mid-output (``DeviceEngine.migrate``, as the time-shared fallback moves), and
  one whose copy overlaps the source's next steps (as the adaptive hand-off moves);
* a resume after the engine carrying the sequence is killed (recomputed on the other device, or on the
  restarted engine of a one-device node);
* a pooled hand-off inside one node (prefill device → decode device);
* a pooled hand-off to a peer node over TCP.

And none of them costs a step: the sequence is held out of its new device's steps
(``Sequence.grammar_wait``, :mod:`node.runtime.grammar_gate`) until that engine's grammar thread has
compiled its grammar and replayed its emitted tokens into a matcher, so no step compiles a grammar or
rebuilds a matcher (each device's ``grammar_in_step`` stays 0; before, every arrival rebuilt its matcher
in its first step there, and a peer node's or a revived engine's also compiled the grammar in it).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal

import jsonschema
import pytest

from node.config import NodeConfig
from node.core.grammar_spec import GrammarSpec
from node.core.sequence import SamplingParams
from node.runtime.node import Node
from support import STORIES

pytestmark = pytest.mark.slow_only("each test moves a grammar-constrained sequence between devices or nodes (in-process, pooled node, peer pair)")

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 30},
        "story": {"type": "string", "maxLength": 240},
        "mood": {"enum": ["happy", "sad", "brave"]},
        "pages": {"type": "integer", "minimum": 1, "maximum": 99},
    },
    "required": ["title", "story", "mood", "pages"],
}
PROMPT = "Once upon a time, there was a little girl named Lily."
MAX_TOKENS = 200


def params() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, grammar=GrammarSpec("json_schema", json.dumps(SCHEMA)))


def valid(text: str) -> dict:
    doc = json.loads(text)
    jsonschema.validate(doc, SCHEMA)
    return doc


async def _run(node: Node, rid: str, at: int | None = None, act=None) -> tuple[list[int], str, str | None]:
    """Generate greedily; when ``at`` output tokens have arrived, await ``act(node, seq)`` once."""
    ids, text, finish, done = [], "", None, at is None
    async for req, d in node.generate(rid, node.tokenizer.encode(PROMPT), params()):
        assert d.error is None, d.error
        ids += d.token_ids
        text += d.text
        finish = d.finish_reason or finish
        if not done and len(ids) >= at:
            done = True
            await act(node, req.seqs[0])
    assert done, "the output ended before the move"
    return ids, text, finish


def test_device_moves_a_hand_off_and_an_engine_kill_keep_the_grammar_and_the_greedy_output():
    async def migrate(node, seq):
        src = node.engine(seq.device_id)
        dst = next(e for e in node.engines if e is not src)
        assert await src.migrate(seq, dst, "manual") is not None

    async def hand_off(node, seq):  # as the adaptive hand-off moves: the copy overlaps the source's next steps
        src = node.engine(seq.device_id)
        dst = next(e for e in node.engines if e is not src)
        assert await src.migrate(seq, dst, "handoff", overlap=True) is not None

    async def kill(node, seq):
        pid = next(d["engine"]["pid"] for d in node.status()["devices"] if d["device"] == seq.device_id)
        os.kill(pid, signal.SIGKILL)

    async def go():
        node = await Node.create(NodeConfig(model=str(STORIES), devices=["cpu:0", "cpu:1"], imbalance_threshold=0.0,
                                            engine_restart_max=0))
        node.start()
        try:
            unmoved = await _run(node, "still")
            moved = await _run(node, "moved", 12, migrate)
            moved_back = await _run(node, "moved-twice", 25, migrate)
            handed = await _run(node, "handed-off", 15, hand_off)
            killed = await _run(node, "killed", 18, kill)
            used = [e.batcher.ledger.num_used for e in node.engines if e.failure is None]
            in_step = {e.device_id: e.grammar_in_step for e in node.engines}
            held = sum(e.grammar_gate.num_held for e in node.engines)
            return unmoved, moved, moved_back, handed, killed, used, node.metrics.render().decode(), in_step, held
        finally:
            await node.close()

    unmoved, moved, moved_back, handed, killed, used, metrics, in_step, held = asyncio.run(go())
    ids, text, finish = unmoved
    assert finish == "stop" and len(ids) > 30, (finish, len(ids))  # long enough that the moves fall mid-output
    valid(text)
    assert moved == unmoved and moved_back == unmoved and handed == unmoved and killed == unmoved
    assert "shiftnode_kv_recomputes_total 1.0" in metrics  # the killed engine's sequence was recomputed elsewhere
    assert used == [0]  # the surviving device holds no block
    # every arrival (two moves, a hand-off, a resume) was prepared off the step: no step of either
    # device compiled a grammar or rebuilt a matcher
    assert in_step == {"cpu:0": 0, "cpu:1": 0}, in_step
    assert held >= 4, held
    assert 'shiftnode_grammar_in_step_total{device="cpu:0"} 0.0' in metrics


def _complete(node, body: dict) -> dict:
    r = node.client.post("/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


BODY = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True,
        "response_format": {"type": "json_schema", "json_schema": {"name": "story", "schema": SCHEMA}}}


def test_a_resume_on_the_revived_engine_prepares_the_grammar_off_the_step():
    """One device, its engine killed mid-output and restarted: the sequence resumes on the new engine
    process, whose grammar cache is empty (before, that engine's first step built the cache, compiled the
    grammar and rebuilt the matcher: seconds of every stream's time on a 2-core CPU)."""
    async def kill(node, seq):
        os.kill(node.status()["devices"][0]["engine"]["pid"], signal.SIGKILL)

    async def go():
        node = await Node.create(NodeConfig(model=str(STORIES), devices=["cpu:0"], engine_restart_max=1))
        node.start()
        try:
            unmoved = await _run(node, "still")
            first = node.status()["devices"][0]["engine"]["pid"]
            killed = await _run(node, "killed", 15, kill)
            e = node.engines[0]
            return unmoved, killed, first, node.status()["devices"][0]["engine"]["pid"], e.grammar_in_step, e.grammar_gate.num_held
        finally:
            await node.close()

    unmoved, killed, first, second, in_step, held = asyncio.run(go())
    valid(unmoved[1])
    assert second != first and killed == unmoved  # resumed on the restarted engine, same greedy output
    assert in_step == 0 and held >= 2, (in_step, held)


def grammar_counts(node) -> tuple[int, int]:
    """A node's ``(grammar_in_step, grammar_held)`` summed over its devices (``/v1/node``)."""
    devices = node.status()["devices"]
    return sum(d["grammar_in_step"] for d in devices), sum(d["grammar_held"] for d in devices)


def test_a_pooled_hand_off_inside_a_node_keeps_the_grammar(stories_node, pooled_node):
    before = pooled_node.status()["kv_transfers"]
    in_step, held = grammar_counts(pooled_node)
    one = _complete(stories_node, BODY)
    handed = _complete(pooled_node, BODY)
    assert len(pooled_node.status()["kv_transfers"]) > len(before)  # it was handed off
    valid(one["text"])
    assert handed["token_ids"] == one["token_ids"] and handed["text"] == one["text"]
    after_in_step, after_held = grammar_counts(pooled_node)
    assert after_in_step == in_step and after_held > held  # held on the decode device, never rebuilt in a step


def test_a_pooled_hand_off_to_a_peer_node_over_tcp_keeps_the_grammar(stories_node, peer_pair):
    prefill, decode = peer_pair
    in_step, held = grammar_counts(decode)
    one = _complete(stories_node, BODY)
    handed = _complete(prefill, BODY)
    valid(one["text"])
    assert handed["token_ids"] == one["token_ids"] and handed["text"] == one["text"]
    # the peer never saw the request: its engine compiled the grammar and replayed the matcher off the step
    after_in_step, after_held = grammar_counts(decode)
    assert after_in_step == in_step and after_held > held, (in_step, after_in_step, held, after_held)


def test_a_grammar_that_does_not_compile_on_the_engine_ends_the_request_with_an_error_and_frees_its_blocks():
    """A sequence placed on a device with a grammar the engine cannot compile (the API never checked it:
    the node's own generate) is held, then failed with an error event; nothing is left behind, and a
    sequence beside it runs meanwhile."""
    bad = SamplingParams(max_tokens=8, temperature=0.0, grammar=GrammarSpec("ebnf", "root ::= undefined_rule"))

    async def go():
        node = await Node.create(NodeConfig(model=str(STORIES), devices=["cpu:0"]))
        node.start()
        try:
            async def failing():
                return [d async for _req, d in node.generate("bad", node.tokenizer.encode(PROMPT), bad)]

            side = asyncio.ensure_future(_run(node, "beside"))
            deltas = await asyncio.wait_for(failing(), 120)
            beside = await side
            e = node.engines[0]
            return deltas, beside, e.batcher.ledger.num_used, e.grammar_in_step, e.grammar_gate.num_held
        finally:
            await node.close()

    deltas, beside, used, in_step, held = asyncio.run(go())
    [last] = [d for d in deltas if d.error is not None]
    assert "does not compile" in last.error and last.error_status == 400 and last.error_code == "grammar_error"
    assert not any(d.token_ids for d in deltas)  # never stepped
    valid(beside[1])
    assert used == 0 and in_step == 0 and held == 2, (used, in_step, held)
