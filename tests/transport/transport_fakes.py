"""Shared helpers for the transport tests: a fake receiving engine with a block pool, random caches."""

from __future__ import annotations

import asyncio
import math

import torch

from node.transport import KVServer, Layout, SeqState
from node.transport.tensors import gather_layer, layout_of, scatter_layer_bytes

SECRET = "s3cret-for-tests"
HOST = "127.0.0.1"


def run(coro, timeout_s: float = 20.0):
    """Run one test coroutine with a hard bound on its duration."""
    async def bounded():
        async with asyncio.timeout(timeout_s):
            return await coro
    return asyncio.run(bounded())


def random_cache(num_layers=4, num_blocks=32, block_size=16, heads=2, head_dim=8, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(num_layers, 2, num_blocks, block_size, heads, head_dim, generator=g)
    return kv.to(dtype)


def make_seq(num_cached: int, prompt_len: int, block_size: int, request_id: str = "req-1") -> tuple[SeqState, int]:
    """A decoding sequence with ``num_cached`` tokens in the cache (+1 sampled, not cached)."""
    n = num_cached + 1
    seq = SeqState(request_id=request_id, seq_id=f"{request_id}-0", token_ids=[(7 * i + 3) % 500 for i in range(n)],
                   prompt_len=prompt_len, num_computed=num_cached, max_len=n + 64,
                   sampling={"temperature": 0.0, "max_tokens": 64}, age_s=0.25, first_token_age_s=0.05)
    return seq, math.ceil(num_cached / block_size)


class FakeReceiver:
    """What the lead's engine does on the receiving side: a block free list and a KV cache."""

    def __init__(self, kv: torch.Tensor, model_id: str = "tiny", reserve_delay_s: float = 0.0,
                 fail_on_layer: int | None = None, refuse: bool = False, scatter: bool = True,
                 fail_with: type[Exception] = RuntimeError):
        self.kv = kv
        self.layout: Layout = layout_of(kv, model_id)
        self.free = list(range(kv.shape[2]))[::-1]
        self.reserved: dict[str, list[int]] = {}
        self.adopted: dict[str, object] = {}
        self.aborted: dict[str, str] = {}
        self.layers: dict[str, list[int]] = {}
        self.reserve_calls = 0
        self.reserve_delay_s = reserve_delay_s
        self.fail_on_layer = fail_on_layer
        self.fail_with = fail_with  # what on_layer raises at fail_on_layer
        self.refuse = refuse
        self.scatter = scatter
        self.event = asyncio.Event()

    @property
    def num_free(self) -> int:
        return len(self.free)

    async def reserve(self, offer):
        self.reserve_calls += 1
        if self.reserve_delay_s:
            await asyncio.sleep(self.reserve_delay_s)
        if self.refuse or offer.num_blocks > len(self.free):
            return None
        blocks = [self.free.pop() for _ in range(offer.num_blocks)]
        self.reserved[offer.transfer_id] = blocks
        self.layers[offer.transfer_id] = []
        return blocks

    def on_layer(self, tid: str, layer: int, data: bytearray) -> None:
        if layer == self.fail_on_layer:
            raise self.fail_with("scatter failed (test)")
        self.layers[tid].append(layer)
        if self.scatter:
            scatter_layer_bytes(data, self.layout, self.kv, layer, self.reserved[tid])

    def on_done(self, tid: str, report) -> None:
        self.adopted[tid] = report
        self.event.set()

    def on_abort(self, tid: str, reason: str) -> None:
        self.free.extend(self.reserved.pop(tid))
        self.aborted[tid] = reason
        self.event.set()

    def server(self, **kw) -> KVServer:
        kw.setdefault("secret", SECRET)
        return KVServer(HOST, 0, layout=self.layout, reserve=self.reserve, on_layer=self.on_layer,
                        on_done=self.on_done, on_abort=self.on_abort, node_id="receiver", **kw)

    async def wait(self, timeout_s: float = 5.0) -> None:
        async with asyncio.timeout(timeout_s):
            await self.event.wait()


def layer_source(kv: torch.Tensor, blocks: list[int]):
    """Sender's payloads: one layer's blocks gathered on demand (a tensor)."""
    return lambda layer: gather_layer(kv, layer, blocks)
