"""Every ``--block-size`` the flag accepts serves: 1 and 2 (below the start-up warm-up's 3 tokens)
failed with ``list index out of range`` before any request (found by a fresh user)."""
import asyncio

import pytest

from node.config import NodeConfig
from node.core.sequence import SamplingParams
from node.runtime.node import Node
from support import STORIES, reference_cases


@pytest.mark.quick
@pytest.mark.parametrize("block_size", [1, 2])
def test_tiny_blocks_start_and_reproduce_the_reference(block_size):
    case = reference_cases()[0]

    async def go():
        node = await Node.create(NodeConfig(model=str(STORIES), block_size=block_size, engine_layout="thread",
                                            kv_cache_memory_bytes=64 << 20))
        node.start()
        try:
            ids = []
            params = SamplingParams(max_tokens=case["max_new_tokens"], temperature=0.0)
            async for _, d in node.generate("r", case["prompt_token_ids"], params):
                assert d.error is None, d.error
                ids += d.token_ids
            return ids
        finally:
            await node.close()

    assert asyncio.run(go()) == case["output_token_ids"]
