"""Capacity queries and the token relay that follows a ``relay=True`` transfer (KVServer/KVClient)."""

from __future__ import annotations

import asyncio

import pytest

from node.transport import KVClient, TransportError
from node.transport import protocol as p
from transport_fakes import HOST, SECRET, FakeReceiver, layer_source, make_seq, random_cache, run

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here


class RelayingReceiver(FakeReceiver):
    """Adopts the sequence and relays tokens the test pushes into ``tokens`` (None ends the relay)."""

    def __init__(self, kv):
        super().__init__(kv)
        self.tokens: asyncio.Queue = asyncio.Queue()
        self.closed_early = asyncio.Event()

    def on_done(self, tid, report):
        super().on_done(tid, report)
        return self.relay(tid)

    async def relay(self, tid):
        ended = False
        try:
            while True:
                t = await self.tokens.get()
                if t is None:
                    ended = True
                    yield p.RelayEnd(transfer_id=tid, finish_reason="length")
                    return
                yield p.TokenRelay(transfer_id=tid, token_ids=t)
        finally:
            if not ended:
                self.closed_early.set()

    def status(self, n):
        return p.StatusReply(n=n, kv_free_blocks=self.num_free, kv_total_blocks=32, max_device_free_blocks=self.num_free,
                             max_device_total_blocks=32, seq_slots_free=3)


def test_status_query_reports_the_receivers_capacity():
    async def main():
        rx = RelayingReceiver(random_cache())
        async with rx.server(status=rx.status) as server, await KVClient.connect(HOST, server.port, SECRET) as c:
            st = await c.query_status()
            assert (st.n, st.kv_free_blocks, st.max_device_total_blocks, st.seq_slots_free) == (1, 32, 32, 3)
            seq, nb = make_seq(num_cached=20, prompt_len=20, block_size=16)
            await c.send_sequence(rx.layout, seq, layer_source(random_cache(seed=1), [0, 1]), nb)
            assert (await c.query_status()).kv_free_blocks == 32 - nb
    run(main())


def test_relay_streams_tokens_in_order_through_keepalives_then_ends():
    async def main():
        rx = RelayingReceiver(random_cache())
        async with rx.server(relay_keepalive_s=0.05) as server, await KVClient.connect(HOST, server.port, SECRET) as c:
            seq, nb = make_seq(num_cached=20, prompt_len=20, block_size=16)
            await c.send_sequence(rx.layout, seq, layer_source(random_cache(seed=1), [0, 1]), nb,
                                  transfer_id="t1", relay=True)
            got = []

            async def feed():
                for batch in ([5], [6, 7]):
                    await asyncio.sleep(0.2)  # silences longer than the keep-alive interval
                    rx.tokens.put_nowait(batch)
                rx.tokens.put_nowait(None)

            feeder = asyncio.create_task(feed())
            async for msg in c.relay("t1", idle_timeout_s=1.0):
                got.append(msg)
            await feeder
            assert [m.token_ids for m in got[:-1]] == [[5], [6, 7]]
            assert isinstance(got[-1], p.RelayEnd) and got[-1].finish_reason == "length"
            assert not rx.closed_early.is_set()
    run(main())


def test_sender_leaving_closes_the_receivers_relay():
    async def main():
        rx = RelayingReceiver(random_cache())
        async with rx.server() as server:
            c = await KVClient.connect(HOST, server.port, SECRET)
            seq, nb = make_seq(num_cached=20, prompt_len=20, block_size=16)
            await c.send_sequence(rx.layout, seq, layer_source(random_cache(seed=1), [0, 1]), nb,
                                  transfer_id="t2", relay=True)
            rx.tokens.put_nowait([9])
            relay = c.relay("t2")
            assert (await relay.__anext__()).token_ids == [9]
            await relay.aclose()  # the client left: hang up
            async with asyncio.timeout(5):
                await rx.closed_early.wait()
            await c.close()
    run(main())


def test_a_silent_relay_times_out_on_the_sender():
    async def main():
        rx = RelayingReceiver(random_cache())
        async with rx.server(relay_keepalive_s=30) as server, await KVClient.connect(HOST, server.port, SECRET) as c:
            seq, nb = make_seq(num_cached=20, prompt_len=20, block_size=16)
            await c.send_sequence(rx.layout, seq, layer_source(random_cache(seed=1), [0, 1]), nb,
                                  transfer_id="t3", relay=True)
            with pytest.raises(TransportError, match="no relayed tokens within"):
                async for _ in c.relay("t3", idle_timeout_s=0.3):
                    pass
            async with asyncio.timeout(5):
                await rx.closed_early.wait()
    run(main())


def test_a_commit_that_cannot_be_sent_closes_the_unstarted_relay(monkeypatch):
    """The receiver adopted the sequence but the sender never hears of the commit: the server closes
    the relay it got (not yet started), which is where the receiver drops its copy (issue 32 item 1)."""
    import node.transport.server as server_mod

    class Relay:
        closed = False

        def __aiter__(self):
            return self

        async def __anext__(self):
            raise StopAsyncIteration

        async def aclose(self):
            Relay.closed = True

    real_send = server_mod.send

    async def send(writer, msg, timeout_s):
        if isinstance(msg, p.TransferCommitted):
            raise TransportError("connection lost (test)")
        return await real_send(writer, msg, timeout_s)

    monkeypatch.setattr(server_mod, "send", send)

    async def main():
        rx = RelayingReceiver(random_cache())
        rx.on_done = lambda tid, report: (FakeReceiver.on_done(rx, tid, report), Relay())[1]
        async with rx.server() as server, await KVClient.connect(HOST, server.port, SECRET) as c:
            seq, nb = make_seq(num_cached=20, prompt_len=20, block_size=16)
            with pytest.raises(TransportError):
                await c.send_sequence(rx.layout, seq, layer_source(random_cache(seed=1), [0, 1]), nb,
                                      transfer_id="t9", relay=True)
        assert Relay.closed
    run(main())
