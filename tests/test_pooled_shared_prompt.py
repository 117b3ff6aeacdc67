"""A pooled hand-off of a request's n choices sends their shared prompt blocks once (node.runtime.copy_batch).

In-process pooled nodes (prefill cpu:0, decode cpu:1) with the ledger self-check on after every step: the
choices of one n=8 request, which share their prompt's full blocks on the prefill device, share them on the
decode device too (referenced, not copied again), so the KV sent is about one prompt plus eight tails; the
greedy outputs equal a colocated node's; and, with the request aborted while its copy is in flight, every
block comes back on both devices and block ownership checks out.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from node.core.sequence import SamplingParams
from node.runtime import block_pins, moves
from node.runtime.node import Node
from support import reference_cases
from test_engine_faults import with_node
from test_engine_incarnation import wait_for

pytestmark = pytest.mark.slow_only("two in-process nodes with two engine processes each")

PROMPT = [t for c in reference_cases() for t in c["prompt_token_ids"]] * 4  # 112 tokens: 6 full blocks of 16 before the last (each choice computes that one itself)
N = 8


@pytest.fixture(autouse=True)
def ledger_check(monkeypatch):
    monkeypatch.setattr(block_pins, "LEDGER_CHECK", True)


async def choices(node: Node, rid: str, params: SamplingParams, n: int = N) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    async for _, d in node.generate(rid, PROMPT, params, n):
        assert not d.error, d.error
        out.setdefault(d.index, []).extend(d.token_ids)
    return out


def idle_and_owned(node: Node) -> None:
    for e in node.engines:
        assert e.batcher.ledger.num_used == 0, (e.device_id, e.batcher.ledger.num_used)
        e.check_ownership()
        e.batcher.ledger.check()


def test_n_choices_send_their_shared_prompt_once_and_decode_like_colocated():
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    got: dict = {}

    async def colocated(node: Node):
        got["ref"] = await choices(node, "ref", params)

    async def pooled(node: Node):
        got["out"] = await choices(node, "r", params)
        await wait_for(lambda: all(e.batcher.ledger.num_used == 0 for e in node.engines), 10)
        idle_and_owned(node)
        got["moved"] = [m for m in node.migrations if m.seq_id.startswith("r")]
        got["block_bytes"] = node.engines[0].runner.kv_cache[:, :, 0].numel() * node.engines[0].runner.kv_cache.element_size()

    with_node(colocated, mode="colocated", devices=["cpu:0"])
    with_node(pooled, mode="pooled", prefill_devices=["cpu:0"], decode_devices=["cpu:1"])
    assert got["out"] == got["ref"] and len(got["out"]) == N
    moved, bb = got["moved"], got["block_bytes"]
    assert len(moved) == N and all(m.src == "cpu:0" and m.dst == "cpu:1" for m in moved)
    full = (len(PROMPT) - 1) // 16  # full blocks before the last prompt token: the choices share these on the prefill device
    tails = sum(m.blocks for m in moved) - N * full  # each choice's own blocks (its partial block and later)
    assert sum(m.shared_blocks for m in moved) == (N - 1) * full
    assert sum(m.nbytes for m in moved) == (full + tails) * bb  # one prompt plus eight tails, not eight prompts


def test_an_abort_during_a_shared_copy_frees_every_block(monkeypatch):
    """The request is cancelled while the one copy of its eight choices is in flight: no choice is
    adopted, both devices' blocks all come back, and ownership checks out; the node then serves on."""
    gate, real = threading.Event(), moves.copy_sharded_blocks

    def gated(*args, **kw):
        gate.wait(60)
        return real(*args, **kw)

    monkeypatch.setattr(moves, "copy_sharded_blocks", gated)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    async def body(node: Node):
        prefill = node.engine("cpu:0")
        run = asyncio.create_task(choices(node, "r", params))
        batch = await wait_for(lambda: prefill.moves.copying, 60)
        assert len(batch.moves) == N and sum(m.shared for m in batch.moves) == (N - 1) * ((len(PROMPT) - 1) // 16)
        run.cancel()
        await asyncio.sleep(0.2)
        gate.set()
        await wait_for(lambda: all(e.batcher.ledger.num_used == 0 for e in node.engines), 10)
        idle_and_owned(node)
        assert not [m for m in node.migrations if m.seq_id.startswith("r")]  # none adopted
        again = await choices(node, "again", SamplingParams(max_tokens=8, temperature=0.0), 2)
        assert len(again) == 2 and again[0] == again[1]
        await wait_for(lambda: all(e.batcher.ledger.num_used == 0 for e in node.engines), 10)
        idle_and_owned(node)

    with_node(body, mode="pooled", prefill_devices=["cpu:0"], decode_devices=["cpu:1"])
