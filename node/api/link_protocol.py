"""The frames between the control process and its API front ends (``--api-processes`` > 1).

One unix stream socket per front end; each frame is a 4-byte big-endian length and a msgpack body
(msgspec), a tagged union of the messages below. The control loop sends a front end one
:class:`Step` per engine step that produced tokens for it (every request's deltas of that step
together), never a frame per token; the front end sends one frame per request event (open, close)
and its latency metrics in batches.

Front end → control: :class:`Open`, :class:`Close`, :class:`MetricsDelta`, :class:`Ready`, :class:`Pong`.
Control → front end: :class:`Admitted`, :class:`Step`, :class:`Ping`.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Union

import msgspec

from node.core.sequence import SamplingParams
from node.runtime.token_output import TokenDelta

HEADER = struct.Struct(">I")


class Job(msgspec.Struct, array_like=True):
    """One prompt of an API request: engine request ``key`` (the front end's number for it)."""

    key: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    n: int
    index0: int


class Open(msgspec.Struct, tag=True, array_like=True):
    """Admit all ``jobs`` or none (one API request); answered by :class:`Admitted` with ``ticket``."""

    ticket: int
    jobs: list[Job]


class Admitted(msgspec.Struct, tag=True, array_like=True):
    """The answer to :class:`Open`: ``refusal`` None (admitted), else ``draining``, ``engine_down`` or
    ``overloaded`` with ``message`` (the API's 503), or ``kv_capacity`` (it can never fit: the API's 400)."""

    ticket: int
    refusal: str | None = None
    message: str = ""


class Close(msgspec.Struct, tag=True, array_like=True):
    """The front end is done with engine request ``key`` (all choices ended, or the client left):
    per choice its end as the client saw it (None: unfinished, counted as an abort), tokens sent, and
    the time to its first token (s) for the request's log line."""

    key: int
    reasons: list[str | None]
    tokens: list[int]
    ttft_s: float | None = None


class Step(msgspec.Struct, tag=True, array_like=True):
    """Every token one step produced for the requests of one front end, in production order: a
    :class:`TokenDelta`, or a run of plain tokens (not a choice's first, no logprobs, ending nothing)
    as flat ``[key, index, token id, key, index, token id, ...]`` (no object per token on either side)."""

    deltas: list[TokenDelta | list[int]]


class HistogramDelta(msgspec.Struct, array_like=True):
    """Observations since the last report: per bucket (non-cumulative, the last is +Inf) and their sum."""

    counts: list[int]
    sum: float


class MetricsDelta(msgspec.Struct, tag=True, array_like=True):
    """A front end's consumer-side metrics since its last report (:mod:`node.api.frontend_metrics`)."""

    ttft: HistogramDelta
    itl: HistogramDelta
    tpot: HistogramDelta
    generation_tokens: int
    stalled_clients: int = 0  # streams aborted for a client that stopped reading (node/api/sse.py)


class Ready(msgspec.Struct, tag=True, array_like=True):
    """The front end listens on the HTTP port."""

    pid: int


class Ping(msgspec.Struct, tag=True, array_like=True):
    """The control process's heartbeat: the front end answers :class:`Pong` from its event loop, so a
    front end whose loop is stuck (or whose process is stopped) stops answering and is replaced."""

    seq: int


class Pong(msgspec.Struct, tag=True, array_like=True):
    """The answer to :class:`Ping` ``seq``."""

    seq: int


Message = Union[Open, Admitted, Close, Step, MetricsDelta, Ready, Ping, Pong]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def frame(message: Message) -> bytes:
    """``message`` as one frame: length, then its msgpack body."""
    body = _encoder.encode(message)
    return HEADER.pack(len(body)) + body


class FrameReader:
    """Splits a byte stream into messages (feed it what ``data_received`` gets)."""

    __slots__ = ("_buf",)

    def __init__(self):
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Message]:
        """Messages completed by ``data``, in order. Raises ``msgspec.DecodeError`` on a malformed body."""
        buf = self._buf
        buf += data
        out = []
        pos = 0
        with memoryview(buf) as view:  # decoded without copying each body out first
            while len(buf) - pos >= 4:
                (size,) = HEADER.unpack_from(buf, pos)
                if len(buf) - pos - 4 < size:
                    break
                out.append(_decoder.decode(view[pos + 4 : pos + 4 + size]))
                pos += 4 + size
        if pos:
            del buf[:pos]
        return out


class FrameWriter:
    """Frames written together once per event-loop iteration: one system call, and one wake-up of the
    process at the other end, for everything a step or a burst of requests produced. Subclasses add
    their own last frame (:meth:`last_frame`) at the flush."""

    def __init__(self):
        self.transport: asyncio.Transport | None = None
        self._frames: list[bytes] = []
        self._scheduled = False
        self._loop = asyncio.get_running_loop()

    def send(self, data: bytes) -> None:
        """Queue one frame (see :func:`frame`) for this iteration's write."""
        self._frames.append(data)
        self.schedule()

    def schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self.flush)

    def last_frame(self) -> bytes | None:
        """A frame to append at the flush (after the queued ones), or None."""
        return None

    def flush(self) -> None:
        """Write what was queued, in order, in one write (nothing once the connection is closing)."""
        self._scheduled = False
        last = self.last_frame()
        if last is not None:
            self._frames.append(last)
        if not self._frames:
            return
        data = b"".join(self._frames) if len(self._frames) > 1 else self._frames[0]
        self._frames.clear()
        t = self.transport
        if t is not None and not t.is_closing():
            t.write(data)
