"""The delta stream between a step and its HTTP handler: batches, order, wake-ups, keep-alives."""

import asyncio
import time

import pytest

from node.runtime.delta_stream import DeltaStream
from node.runtime.output import SeqDelta

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here


def test_take_returns_every_delta_pushed_since_the_last_take_in_order():
    async def main():
        s = DeltaStream()
        for i in range(5):
            s.push(SeqDelta(index=i % 2, token_ids=[i]))
        first = await s.take()
        s.push(SeqDelta(index=0, token_ids=[9]))
        second = await s.take()
        return first, second, len(s)

    first, second, left = asyncio.run(main())
    assert [d.token_ids[0] for d in first] == [0, 1, 2, 3, 4]
    assert [d.token_ids[0] for d in second] == [9]
    assert left == 0


def test_a_waiting_consumer_wakes_once_for_a_whole_step():
    """Pushes made in one callback (one step's post-processing) reach the consumer as one batch."""
    async def main():
        s = DeltaStream()
        loop = asyncio.get_running_loop()

        def step():
            for i in range(256):
                s.push(SeqDelta(index=0, token_ids=[i]))

        loop.call_soon(step)
        batches = [await s.take()]
        return batches

    batches = asyncio.run(main())
    assert len(batches) == 1 and len(batches[0]) == 256


def test_silence_gives_empty_batches_at_the_keepalive_interval_and_tokens_reset_it():
    async def main():
        s = DeltaStream(keepalive_s=0.1)
        t0 = time.monotonic()
        assert await s.take() == []  # nothing pushed: a keep-alive after about 0.1 s
        t1 = time.monotonic()

        async def trickle():
            for i in range(6):  # a token every 50 ms keeps the stream busy for 0.3 s
                await asyncio.sleep(0.05)
                s.push(SeqDelta(index=0, token_ids=[i]))

        task = asyncio.create_task(trickle())
        got = []
        while len(got) < 6:
            batch = await s.take()
            assert batch, "a keep-alive while tokens flowed every 50 ms"
            got += batch
        await task
        s.close()
        return t1 - t0, got

    waited, got = asyncio.run(main())
    assert 0.09 <= waited < 0.5
    assert [d.token_ids[0] for d in got] == list(range(6))


def test_without_keepalive_take_waits_until_a_push_and_a_cancelled_take_loses_nothing():
    async def main():
        s = DeltaStream()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await s.take()
        s.push(SeqDelta(index=0, token_ids=[1]))
        return await s.take()

    assert [d.token_ids for d in asyncio.run(main())] == [[1]]


def test_a_consumer_callback_gets_a_whole_step_in_one_call_and_what_came_before_first():
    """consume(): one call per loop wake with every delta pushed meanwhile, none after close()."""
    async def main():
        s = DeltaStream()
        s.push(SeqDelta(index=0, token_ids=[-1]))  # before the consumer: goes in its first call
        calls = []
        s.consume(lambda batch: calls.append([d.token_ids[0] for d in batch]))
        loop = asyncio.get_running_loop()

        def step(base):
            for i in range(3):
                s.push(SeqDelta(index=0, token_ids=[base + i]))

        loop.call_soon(step, 0)
        await asyncio.sleep(0.01)
        loop.call_soon(step, 10)
        await asyncio.sleep(0.01)
        s.close()
        s.push(SeqDelta(index=0, token_ids=[99]))
        await asyncio.sleep(0.01)
        return calls

    assert asyncio.run(main()) == [[-1], [0, 1, 2], [10, 11, 12]]


def test_a_consumer_callback_gets_empty_batches_at_the_keepalive_interval():
    async def main():
        s = DeltaStream(keepalive_s=0.05)
        calls = []
        s.consume(lambda batch: calls.append((time.monotonic(), len(batch))))
        t0 = time.monotonic()
        await asyncio.sleep(0.18)
        idle = [c for c in calls if c[1] == 0]
        for i in range(4):  # a token every 20 ms: no keep-alive in between
            s.push(SeqDelta(index=0, token_ids=[i]))
            await asyncio.sleep(0.02)
        busy = calls[len(idle):]
        s.close()
        return t0, idle, busy

    t0, idle, busy = asyncio.run(main())
    assert 2 <= len(idle) <= 4 and idle[0][0] - t0 >= 0.045
    assert [n for _, n in busy] == [1, 1, 1, 1]
