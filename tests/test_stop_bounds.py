"""Stopping a node is bounded (issue 32): a KV copy in flight on a slow link does not hold SIGTERM.

A pooled hand-off is copied in the node's worker thread, paced by ``--link-gbps``; the node's stop
used to queue the engine's stop behind that copy, so a slow link held the process for as long as the
copy took (minutes here). Now the copy gets a short grace (none when its request already ended) and
is then aborted between layers or during its pacing wait.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from node.config import NodeConfig
from node.core.sequence import SamplingParams
from node.runtime.node import Node
from support import STORIES, require_shared

pytestmark = pytest.mark.slow_only("its one test times a node's stop against a KV copy on a deliberately slow link (seconds)")


def test_stop_aborts_a_slow_kv_copy_in_flight():
    require_shared()
    # 10 kbit/s: a 120-token prompt's KV (1,280 B per token on stories260k) takes about 2 minutes.
    config = NodeConfig(model=str(STORIES), mode="pooled", prefill_devices=["cpu:0"], decode_devices=["cpu:1"],
                        link_gbps=1e-5)

    async def go():
        node = await Node.create(config)
        node.start()
        try:
            params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
            async for _ in node.generate("r", list(range(3, 123)), params):
                break  # the first token (from the prefill device): the hand-off's copy starts; the client leaves
            await asyncio.sleep(0.3)
            assert any(e.moves.copying is not None for e in node.engines), "no copy in flight to abort"
        finally:
            t0 = time.monotonic()
            await asyncio.wait_for(node.close(), 30)
        return time.monotonic() - t0

    assert asyncio.run(go()) < 30
