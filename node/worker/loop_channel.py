"""The event loop's end of an engine socket: non-blocking frame writes, frames read by a reader callback.

Frames are those of ``multiprocessing.Connection`` (a 4-byte big-endian signed length, or -1 and an
8-byte length for frames of 2 GiB and more), so the engine's end keeps its plain blocking
``recv_bytes``/``send_bytes``. Nothing here blocks or starts a thread: what the socket does not take at
once waits in a buffer and goes out when the loop sees it writable, in order.
"""

from __future__ import annotations

import asyncio
import os
import struct
from collections import deque
from typing import Callable

_SMALL = 16384  # a frame up to this size goes out with its header in one write (as Connection does)


def frame_header(n: int) -> bytes:
    """The length header of an ``n``-byte frame (``multiprocessing.Connection``'s format)."""
    return struct.pack("!i", n) if n <= 0x7FFFFFFF else struct.pack("!iQ", -1, n)


class LoopChannel:
    """Frames over a connected socket ``fd``, driven by ``loop`` (use from the loop's thread only).

    Args:
        fd: the socket; made non-blocking here (and blocking again by :meth:`close`).
        on_frame: called with each whole frame read, in order.
        on_lost: called once with the error when the socket closes (``EOFError``) or fails; the
            channel has stopped reading and writing by then.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, fd: int, on_frame: Callable[[bytes], None],
                 on_lost: Callable[[BaseException], None]):
        self._loop = loop
        self._fd = fd
        self._on_frame = on_frame
        self._on_lost = on_lost
        self._rbuf = bytearray()
        self._wbuf: deque[memoryview] = deque()
        self.open = True
        os.set_blocking(fd, False)
        loop.add_reader(fd, self._readable)

    @property
    def pending_bytes(self) -> int:
        """Bytes written but not yet taken by the socket."""
        return sum(len(b) for b in self._wbuf)

    def send(self, data: bytes) -> None:
        """Queue one frame; it is written now as far as the socket takes it, the rest later.

        Raises:
            ConnectionError: the channel is closed.
        """
        if not self.open:
            raise ConnectionError("the channel is closed")
        header = frame_header(len(data))
        if len(data) <= _SMALL:
            self._write(header + data)
        else:
            self._write(header)
            self._write(data)

    def _write(self, data: bytes) -> None:
        if not self._wbuf:
            try:
                sent = os.write(self._fd, data)
            except BlockingIOError:
                sent = 0
            except OSError as e:
                self._lost(e)
                return
            if sent == len(data):
                return
            self._loop.add_writer(self._fd, self._writable)
            self._wbuf.append(memoryview(data)[sent:])
            return
        self._wbuf.append(memoryview(data))

    def _writable(self) -> None:
        while self._wbuf:
            chunk = self._wbuf[0]
            try:
                sent = os.write(self._fd, chunk)
            except BlockingIOError:
                return
            except OSError as e:
                self._lost(e)
                return
            if sent < len(chunk):
                self._wbuf[0] = chunk[sent:]
                return
            self._wbuf.popleft()
        self._loop.remove_writer(self._fd)

    def _readable(self) -> None:
        try:
            data = os.read(self._fd, 1 << 20)
        except BlockingIOError:
            return
        except OSError as e:
            self._lost(e)
            return
        if not data:
            self._lost(EOFError("end of file"))
            return
        buf = self._rbuf
        buf += data
        while self.open and len(buf) >= 4:
            (n,) = struct.unpack_from("!i", buf)
            start = 4
            if n == -1:
                if len(buf) < 12:
                    return
                (n,) = struct.unpack_from("!Q", buf, 4)
                start = 12
            if len(buf) < start + n:
                return
            frame = bytes(buf[start : start + n])
            del buf[: start + n]
            self._on_frame(frame)

    def _lost(self, error: BaseException) -> None:
        if self.open:
            self._stop()
            self._on_lost(error)

    def _stop(self) -> None:
        self.open = False
        self._loop.remove_reader(self._fd)
        self._loop.remove_writer(self._fd)
        self._wbuf.clear()

    def close(self) -> None:
        """Stop reading and writing (unsent bytes are dropped) and make the socket blocking again, so
        ``multiprocessing.Connection`` can use it; the socket itself stays open."""
        if self.open:
            self._stop()
        os.set_blocking(self._fd, True)
