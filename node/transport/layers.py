"""A transfer's layer payloads on the sending side: flat byte views of them (host bytes or a tensor),
the blocks a receiver already holds cut out, and in-order access that prefetches the next layer while
the previous one is sent (so a device-to-host copy overlaps the socket write)."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any, AsyncIterator, Callable, Iterable

# A layer's payload: bytes-like or a tensor [2, n, block_size, Hkv, D] (any device), or an awaitable of one.
LayerSource = Callable[[int], Any] | AsyncIterator[Any] | Iterable[Any]


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
