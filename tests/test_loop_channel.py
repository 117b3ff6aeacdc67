"""The event loop's end of an engine socket: frames of every size, in order, with partial writes, and
the end of the other side, against ``multiprocessing.Connection`` on the other end (as the engine)."""

import asyncio
import multiprocessing
import os
import threading

import pytest

from node.worker.loop_channel import LoopChannel, frame_header

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here

SIZES = [0, 1, 100, 16384, 16385, 3 << 20, 9 << 20]  # 9 MiB is far above a socket buffer: partial writes


def _echo(conn, count):
    for _ in range(count):
        data = conn.recv_bytes()
        conn.send_bytes(data[::-1])
    conn.close()


def test_frames_of_every_size_round_trip_in_order_and_the_far_end_closing_is_reported():
    ours, theirs = multiprocessing.Pipe(duplex=True)
    frames = [os.urandom(n) for n in SIZES]
    echo = threading.Thread(target=_echo, args=(theirs, len(frames)), daemon=True)
    echo.start()

    async def main():
        loop = asyncio.get_running_loop()
        got, lost = [], loop.create_future()
        ch = LoopChannel(loop, ours.fileno(), got.append, lambda e: lost.set_result(e))
        for f in frames:
            ch.send(f)  # never blocks: the 9 MiB frame waits in the buffer while the echo reads
        assert ch.pending_bytes > 0
        error = await asyncio.wait_for(lost, 60)
        with pytest.raises(ConnectionError):
            ch.send(b"x")
        ch.close()
        return got, error

    got, error = asyncio.run(main())
    echo.join(5)
    assert [len(g) for g in got] == SIZES
    assert all(g == f[::-1] for g, f in zip(got, frames))
    assert isinstance(error, EOFError)
    assert os.get_blocking(ours.fileno())  # close hands a blocking socket back to Connection
    ours.close()


def test_a_frame_split_across_reads_is_delivered_once_whole():
    ours, theirs = multiprocessing.Pipe(duplex=True)
    payload = b"abcdefgh" * 1000

    async def main():
        loop = asyncio.get_running_loop()
        got = []
        ch = LoopChannel(loop, ours.fileno(), got.append, lambda e: None)
        raw = frame_header(len(payload)) + payload
        for i in range(0, len(raw), 777):  # the far end writes the frame in pieces
            os.write(theirs.fileno(), raw[i : i + 777])
            await asyncio.sleep(0.001)
        for _ in range(100):
            if got:
                break
            await asyncio.sleep(0.01)
        ch.close()
        return got

    assert asyncio.run(main()) == [payload]
    assert frame_header(5) == (5).to_bytes(4, "big") and frame_header(1 << 31)[:4] == b"\xff\xff\xff\xff"
    ours.close()
    theirs.close()
