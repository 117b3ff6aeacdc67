"""``--stream-interval N``: a stream's events carry N tokens each (the first token at once, the rest
with the end), and what a client assembles equals the non-streamed answer."""
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


def events(text: str) -> list:
    out = [e[len("data: "):] for e in text.split("\n\n") if e.startswith("data: ")]
    assert out[-1] == "[DONE]"
    return [json.loads(e) for e in out[:-1]]


@pytest.mark.quick
def test_events_carry_n_tokens_and_add_up_to_the_whole_answer():
    async def go():
        node = await Node.create(NodeConfig(model=str(STORIES), stream_interval=4))
        server = TestServer(create_app(node.config, node=node))
        await server.start_server()
        try:
            async with aiohttp.ClientSession() as s:
                async def post(path: str, body: dict) -> str:
                    async with s.post(server.make_url(path), json=body) as r:
                        assert r.status == 200, await r.text()
                        return await r.text()

                body = {"prompt": CASE["prompt"], "max_tokens": 11, "temperature": 0, "return_token_ids": True,
                        "logprobs": 2}
                whole = json.loads(await post("/v1/completions", body))["choices"][0]
                streamed = events(await post("/v1/completions", {**body, "stream": True}))
                chat_body = {"messages": [{"role": "user", "content": CASE["prompt"]}], "max_tokens": 9,
                             "temperature": 0, "n": 2}
                chat_whole = json.loads(await post("/v1/chat/completions", chat_body))
                chat = events(await post("/v1/chat/completions", {**chat_body, "stream": True}))
        finally:
            await server.close()
        return whole, streamed, chat_whole, chat

    whole, streamed, chat_whole, chat = asyncio.run(go())
    sizes = [len(e["choices"][0]["token_ids"]) for e in streamed]
    assert sizes == [1, 4, 4, 2], sizes  # the first token alone, then 4 per event, the rest with the end
    assert [t for e in streamed for t in e["choices"][0]["token_ids"]] == whole["token_ids"] == CASE["output_token_ids"][:11]
    assert "".join(e["choices"][0]["text"] for e in streamed) == whole["text"]
    lp = [e["choices"][0]["logprobs"] for e in streamed]
    assert [t for x in lp for t in x["tokens"]] == whole["logprobs"]["tokens"]
    assert [t for x in lp for t in x["text_offset"]] == whole["logprobs"]["text_offset"]
    assert streamed[-1]["choices"][0]["finish_reason"] == whole["finish_reason"] == "length"
    for i in range(2):  # chat, n=2: each choice's deltas add up to its message
        mine = [c for e in chat for c in e["choices"] if c["index"] == i]
        assert "".join(c["delta"].get("content", "") for c in mine) == chat_whole["choices"][i]["message"]["content"]
        assert len(mine) == 4  # the role, the first token, then 4 + 4 tokens (the end with the last)
        assert mine[-1]["finish_reason"] == "length"
