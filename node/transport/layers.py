"""A transfer's layer payloads on the sending side: flat byte views of them (host bytes or a tensor),
the blocks a receiver already holds cut out, in-order access that prefetches the next layer while
the previous one is sent (so a device-to-host copy overlaps the socket write), and the writing of one
layer on the connection (:func:`write_layer`: its header with the payload's CRC-32, then the payload in
chunks at the link's rate)."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any, AsyncIterator, Callable, Iterable

from node.transport.protocol import LayerHeader, checksum
from node.transport.throttle import LinkThrottle
from node.transport.wire import drain, encode

# A layer's payload: bytes-like or a tensor [2, n, block_size, Hkv, D] (any device), or an awaitable of one.
LayerSource = Callable[[int], Any] | AsyncIterator[Any] | Iterable[Any]
BytesLike = bytes | bytearray | memoryview
FaultHook = Callable[[int, memoryview], BytesLike]  # (layer, payload) → what is sent instead (tests only)

CRC_THREAD_BYTES = 4 << 20  # above this, the CRC runs in a thread (zlib releases the GIL)


def payload_view(obj: Any) -> memoryview:
    """A flat byte view of a layer payload (bytes-like, or a torch tensor copied to host if needed)."""
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return memoryview(obj).cast("B")
    if type(obj).__module__.startswith("torch"):
        from node.transport.tensors import tensor_bytes
        return tensor_bytes(obj)
    return memoryview(obj).cast("B")


def skip_blocks(view: memoryview, skip: int, num_blocks: int) -> bytes:
    """The ``[2, num_blocks - skip, ...]`` payload of a ``[2, num_blocks, ...]`` layer payload: its
    K and V halves, each without its first ``skip`` blocks (the receiver holds them cached)."""
    half = view.nbytes // 2
    per = half // num_blocks
    return bytes(view[skip * per : half]) + bytes(view[half + skip * per :])


class Layers:
    """Uniform access to layer payloads in order, prefetching the next one when the source is a
    callable that returns awaitables (so a device-to-host copy overlaps the send of the previous layer)."""

    def __init__(self, source: LayerSource, num_layers: int):
        self._n = num_layers
        self._fn = source if callable(source) else None
        self._aiter = source.__aiter__() if hasattr(source, "__aiter__") else None
        self._iter = iter(source) if self._fn is None and self._aiter is None else None
        self._pending: asyncio.Future | None = None
        self._prefetch = False  # set once the callable turns out to return awaitables

    async def get(self, layer: int) -> Any:
        if self._fn is not None:
            if self._pending is not None:
                fut, self._pending = self._pending, None
                value = await fut
            else:
                value = self._fn(layer)
                if inspect.isawaitable(value):
                    value = await value
                    self._prefetch = True
            if self._prefetch and layer + 1 < self._n:
                self._pending = asyncio.ensure_future(self._fn(layer + 1))
            return value
        if self._aiter is not None:
            return await self._aiter.__anext__()
        return next(self._iter)

    def cancel(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None


async def write_layer(writer: asyncio.StreamWriter, transfer_id: str, layer: int, payload: Any, nbytes: int, *,
                      chunk_bytes: int, stall_timeout_s: float | None, link: LinkThrottle | None = None,
                      fault_hook: FaultHook | None = None, before_write: Callable[[], None] | None = None) -> None:
    """Write layer ``layer`` of a transfer: a :class:`LayerHeader` carrying the payload's CRC-32, then
    the payload's ``nbytes`` bytes in pieces of ``chunk_bytes``, each after the ``link`` throttle lets
    it go (None: unthrottled) and drained within ``stall_timeout_s`` (s). ``fault_hook`` (tests) alters
    the payload after its checksum was computed; ``before_write`` runs just before the header is
    written (it raises to stop the send, e.g. the receiver aborted).

    Raises:
        ValueError: the payload does not have ``nbytes`` bytes.
        TransportTimeout: a piece was not drained in time (:func:`~node.transport.wire.drain`).
    """
    view = payload_view(payload)
    if view.nbytes != nbytes:
        raise ValueError(f"layer {layer} payload has {view.nbytes} bytes, the layout needs {nbytes}")
    crc = await asyncio.to_thread(checksum, view) if nbytes > CRC_THREAD_BYTES else checksum(view)
    if fault_hook is not None:
        view = memoryview(fault_hook(layer, view)).cast("B")
    if before_write is not None:
        before_write()
    writer.write(encode(LayerHeader(transfer_id=transfer_id, layer=layer, nbytes=nbytes, checksum=crc)))
    for off in range(0, nbytes, chunk_bytes):
        piece = view[off : off + chunk_bytes]
        if link is not None:
            await link.wait(len(piece))
        writer.write(piece)
        await drain(writer, stall_timeout_s)
