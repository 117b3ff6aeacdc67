"""A receiver that already caches the sequence's first blocks is sent only the rest (TransferAccept's
``cached_blocks``): byte-exact for the blocks sent, untouched cached blocks, fewer bytes."""

from __future__ import annotations

import pytest
import torch

from node.transport import KVClient
from node.transport.layers import skip_blocks
from node.transport.tensors import gather_layer, scatter_layer_bytes
from transport_fakes import HOST, SECRET, FakeReceiver, layer_source, make_seq, random_cache, run

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here


class CachingReceiver(FakeReceiver):
    """Says its first ``cached`` reserved blocks hold the prefix already; writes only the rest."""

    def __init__(self, kv, cached: int):
        super().__init__(kv)
        self.cached = cached

    async def reserve(self, offer):
        blocks = await super().reserve(offer)
        return None if blocks is None else (blocks, self.cached)

    def on_layer(self, tid, layer, data):
        self.layers[tid].append(layer)
        scatter_layer_bytes(data, self.layout, self.kv, layer, self.reserved[tid][self.cached:])


@pytest.mark.parametrize("cached", [0, 1, 3])
@pytest.mark.parametrize("as_bytes", [False, True])
def test_only_blocks_after_the_cached_prefix_travel(cached, as_bytes):
    async def main():
        src = random_cache(seed=5)
        dst = torch.zeros_like(src)
        sentinel = torch.full_like(dst[:, :, 0], 7.0)
        rx = CachingReceiver(dst, cached)
        seq, nblocks = make_seq(num_cached=4 * 16 + 5, prompt_len=60, block_size=16)  # 5 blocks
        src_blocks = [9, 2, 30, 11, 4]
        fn = layer_source(src, src_blocks)
        source = (lambda i: bytes(fn(i).contiguous().view(torch.uint8).numpy())) if as_bytes else fn
        reserved_first = rx.free[::-1][:nblocks]
        for b in reserved_first[:cached]:
            dst[:, :, b] = sentinel  # the receiver's own cached content: must stay as it is
        async with rx.server() as server, await KVClient.connect(HOST, server.port, SECRET, node_id="s",
                                                                   layout=rx.layout) as client:
            report = await client.send_sequence(rx.layout, seq, source, nblocks, transfer_id="t")
        got = rx.adopted["t"]
        assert got.block_ids == reserved_first and got.cached_blocks == cached == report.cached_blocks
        L = src.shape[0]
        assert report.nbytes == got.nbytes == L * rx.layout.layer_bytes(nblocks - cached)
        for layer in range(L):
            assert torch.equal(gather_layer(src, layer, src_blocks[cached:]), gather_layer(dst, layer, got.block_ids[cached:]))
        for b in got.block_ids[:cached]:
            assert torch.equal(dst[:, :, b], sentinel)
    run(main())


def test_skip_blocks_keeps_k_and_v_halves():
    kv = torch.arange(2 * 4 * 3, dtype=torch.float32).view(2, 4, 3)  # [2, blocks, payload]
    view = memoryview(kv.numpy().tobytes())
    out = torch.frombuffer(bytearray(skip_blocks(view, 1, 4)), dtype=torch.float32).view(2, 3, 3)
    assert torch.equal(out, kv[:, 1:])
