"""KV transfers with their layers written over NIXL (UCX, loopback), the TCP channel carrying the rest:
byte-exact WRITEs into the receiver's reserved blocks (cached ones skipped), the fall-back to TCP
when the receiver has no NIXL or no registered pool for the device, and a sender that stops
mid-transfer making the receiver free its reservation. Real NIXL agents, two in this process."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from node.transport import AuthError, KVClient, TransportError
from node.transport import protocol as p
from node.transport.wire import client_handshake, encode, read_msg
from node.transport.nixl_agent import NixlAgent
from node.transport.nixl_descriptors import block_runs
from node.transport.nixl_plane import info_of
from node.transport.tensors import gather_layer
from support import require_nixl
from transport_fakes import HOST, SECRET, FakeReceiver, layer_source, make_seq, random_cache, run

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here

@pytest.fixture(scope="module")
def agents():
    """A sender's and a receiver's agent (about 0.5 s each to start), shared by the module's tests."""
    require_nixl()
    a, b = asyncio.run(_two())
    yield a, b
    asyncio.run(a.close())
    asyncio.run(b.close())


async def _two():
    return await asyncio.gather(NixlAgent.create("sender"), NixlAgent.create("receiver"))


class NixlReceiver(FakeReceiver):
    """The fake receiver with its pool registered: reserve answers which pool, unless ``pool`` is None."""

    def __init__(self, kv, pool: int | None, cached: int = 0, **kw):
        super().__init__(kv, **kw)
        self.pool, self.cached = pool, cached

    async def reserve(self, offer):
        blocks = await super().reserve(offer)
        return None if blocks is None else (blocks, self.cached, self.pool)


def test_block_runs_merge_what_is_consecutive_on_both_sides():
    import numpy as np
    ls, rs, n = block_runs(np.array([3, 4, 5, 9, 1]), np.array([10, 11, 12, 13, 40]))
    assert (ls.tolist(), rs.tolist(), n.tolist()) == ([3, 9, 1], [10, 13, 40], [3, 1, 1])


def test_layers_written_over_nixl_are_byte_exact_and_skip_cached_blocks(agents):
    a, b = agents

    async def main():
        src, dst = random_cache(seed=3), torch.zeros_like(random_cache())
        src_pool, dst_pool = len(a.pools), len(b.pools)
        await a.register(src)
        await b.register(dst)
        rx = NixlReceiver(dst, dst_pool, cached=1)
        seq, nblocks = make_seq(num_cached=45, prompt_len=40, block_size=16)
        src_blocks = [17, 18, 29]
        server = rx.server(nixl=b, nixl_info=info_of(b, await b.metadata()))
        async with server, await KVClient.connect(HOST, server.port, SECRET, node_id="sender", layout=rx.layout,
                                                  nixl=a) as client:
            assert client.nixl_route is not None and client.nixl_route.pools == tuple(b.pools)
            report = await client.send_sequence(rx.layout, seq, layer_source(src, src_blocks), nblocks,
                                                transfer_id="t1", nixl_blocks=(src_pool, src_blocks))
        got = rx.adopted["t1"]
        assert rx.layers["t1"] == [] and not rx.aborted  # nothing came over TCP
        L = src.shape[0]
        assert len(got.layer_arrival_s) == L and len(report.layer_end_s) == L and report.cached_blocks == 1
        assert report.nbytes == got.nbytes == L * rx.layout.layer_bytes(nblocks - 1)
        for layer in range(L):  # the blocks after the cached one are exact; the cached one was not written
            want = gather_layer(src, layer, src_blocks[1:])
            assert torch.equal(gather_layer(dst, layer, got.block_ids[1:]).view(torch.uint8), want.view(torch.uint8))
        others = [i for i in range(dst.shape[2]) if i not in got.block_ids[1:]]
        assert not dst[:, :, others].any()
    run(main())


@pytest.mark.parametrize("receiver", ["tcp_node", "no_pool"])
def test_without_nixl_on_the_receiving_device_the_layers_go_over_tcp(agents, receiver):
    a, b = agents

    async def main():
        src, dst = random_cache(seed=4), torch.zeros_like(random_cache())
        src_pool = len(a.pools)
        await a.register(src)
        rx = NixlReceiver(dst, None)
        server = rx.server() if receiver == "tcp_node" else rx.server(nixl=b, nixl_info=info_of(b, await b.metadata()))
        seq, nblocks = make_seq(num_cached=30, prompt_len=20, block_size=16)
        async with server, await KVClient.connect(HOST, server.port, SECRET, node_id="sender", layout=rx.layout,
                                                  nixl=a) as client:
            assert (client.nixl_route is None) == (receiver == "tcp_node")
            await client.send_sequence(rx.layout, seq, layer_source(src, [5, 6]), nblocks, transfer_id="t2",
                                       nixl_blocks=(src_pool, [5, 6]))
        assert rx.layers["t2"] == list(range(src.shape[0]))  # every layer came over TCP
        assert torch.equal(dst[:, :, rx.adopted["t2"].block_ids], src[:, :, [5, 6]])
    run(main())


def test_a_sender_that_stops_mid_transfer_makes_the_receiver_free_its_blocks(agents):
    """The sender is cancelled between layers (a slow link): it aborts and hangs up; the receiver,
    waiting for notifications, frees the reservation once, and adopts nothing."""
    a, b = agents

    async def main():
        src, dst = random_cache(num_blocks=64, seed=5), torch.zeros_like(random_cache(num_blocks=64))
        src_pool, dst_pool = len(a.pools), len(b.pools)
        await a.register(src)
        await b.register(dst)
        rx = NixlReceiver(dst, dst_pool)
        seq, nblocks = make_seq(num_cached=300, prompt_len=300, block_size=16)
        blocks = list(range(nblocks))
        server = rx.server(nixl=b, nixl_info=info_of(b, await b.metadata()))
        async with server:
            client = await KVClient.connect(HOST, server.port, SECRET, node_id="sender", layout=rx.layout, nixl=a,
                                            link_gbps=0.002)  # ~19 KB per layer: ~80 ms each
            send = asyncio.create_task(client.send_sequence(rx.layout, seq, layer_source(src, blocks), nblocks,
                                                            transfer_id="t3", nixl_blocks=(src_pool, blocks)))
            while "t3" not in server.in_flight:
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.08)
            send.cancel()
            with pytest.raises((asyncio.CancelledError, TransportError)):
                await send
            await rx.wait()
            await client.close()
        assert list(rx.aborted) == ["t3"] and not rx.adopted and rx.num_free == 64
        assert b._expect == {}  # the receiver stopped awaiting its notifications
    run(main())


def test_metadata_is_only_taken_from_a_server_that_proved_the_secret(agents):
    """A server with another secret: the handshake fails before any NIXL message, so nothing of it is
    loaded into our agent; a client that never proved the secret gets no NixlInfo either."""
    a, b = agents

    async def main():
        rx = NixlReceiver(torch.zeros_like(random_cache()), None)
        server = rx.server(secret="another-secret", nixl=b, nixl_info=info_of(b, await b.metadata()))
        loaded = dict(a._remotes)
        async with server:
            with pytest.raises(AuthError):
                await KVClient.connect(HOST, server.port, SECRET, node_id="sender", layout=rx.layout, nixl=a)
            reader, writer = await asyncio.open_connection(HOST, server.port)  # asks before any handshake
            writer.write(encode(p.NixlQuery(agent="mallory")))
            bye = await read_msg(reader, 1 << 16, 2.0)
            assert isinstance(bye, p.Goodbye) and not isinstance(bye, p.NixlInfo)
            writer.close()
        assert a._remotes == loaded
    run(main())


def test_a_sender_that_never_writes_is_given_up_on_and_the_blocks_freed(agents):
    """An offer accepted for NIXL whose layers never come (a raw client sends TransferDone at once):
    the receiver waits twice the stall timeout for the notifications, then aborts and frees."""
    a, b = agents

    async def main():
        dst = torch.zeros_like(random_cache())
        dst_pool = len(b.pools)
        await b.register(dst)
        rx = NixlReceiver(dst, dst_pool)
        seq, nblocks = make_seq(num_cached=20, prompt_len=20, block_size=16)
        async with rx.server(nixl=b, nixl_info=info_of(b, await b.metadata()), stall_timeout_s=0.2) as server:
            reader, writer = await asyncio.open_connection(HOST, server.port)
            await client_handshake(reader, writer, SECRET.encode(), "raw", None, 2.0)
            writer.write(encode(p.TransferOffer(transfer_id="t4", layout=rx.layout, seq=seq, num_blocks=nblocks,
                                                nbytes_per_layer=rx.layout.layer_bytes(nblocks), nixl=True)))
            accept = await read_msg(reader, 1 << 16, 2.0)
            assert isinstance(accept, p.TransferAccept) and accept.nixl_pool == dst_pool
            assert accept.block_ids == rx.reserved["t4"]
            t0 = time.monotonic()
            writer.write(encode(p.TransferDone(transfer_id="t4")))
            await rx.wait()
            assert 0.3 < time.monotonic() - t0 < 2.0
            abort = await read_msg(reader, 1 << 16, 2.0)
            assert isinstance(abort, p.TransferAbort) and "NIXL notification" in abort.reason
            writer.close()
        assert list(rx.aborted) == ["t4"] and not rx.adopted and rx.num_free == dst.shape[2]
        assert "t4" not in b._expect
    run(main())
