"""A failure part-way through one step's deltas of a streamed request still sends the tokens the step
produced before it, then the error event and ``[DONE]`` (the API writes each step's deltas in one call)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp.test_utils import TestServer
import pytest

from node.api.app import create_app
from node.config import NodeConfig
from node.runtime.node import Node
from support import STORIES, reference_cases

CASE = reference_cases()[0]


@pytest.mark.quick
def test_tokens_before_a_failure_in_the_same_step_are_sent():
    """With ``n = 2`` both choices' deltas of a step arrive in one batch, choice 0's first. Accounting
    choice 1's third token fails: choice 0's third token, from the same step, must still reach the
    client (before the fix the whole step's events were dropped)."""
    real = Node.account
    seen = {"choice1": 0}

    def flaky(self, req, delta, now):
        if delta.index == 1 and delta.token_ids:
            seen["choice1"] += 1
            if seen["choice1"] == 3:
                raise RuntimeError("injected")
        return real(self, req, delta, now)

    async def go() -> list[str]:
        node = await Node.create(NodeConfig(model=str(STORIES)))
        server = TestServer(create_app(node.config, node=node))
        await server.start_server()
        body = {"prompt": CASE["prompt"], "max_tokens": 20, "temperature": 0.0, "n": 2, "stream": True}
        Node.account = flaky
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s, \
                    s.post(server.make_url("/v1/completions"), json=body) as r:
                assert r.status == 200
                text = (await r.read()).decode()
        finally:
            Node.account = real
            await server.close()
        return [e for e in text.split("\n\n") if e]

    events = asyncio.run(go())
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][len("data: "):])["error"]["code"] == "internal_error"
    tokens = [json.loads(e[len("data: "):])["choices"][0]["index"] for e in events[:-2]]
    assert tokens.count(0) == 3 and tokens.count(1) == 2, tokens
