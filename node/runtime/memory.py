"""Give the node process's freed native heap pages back to the OS once a minute (glibc ``malloc_trim``).

glibc's ``free()`` keeps freed memory in its arenas. Only the top of the main heap goes back to the
OS on its own. Pages freed inside a heap, or in the per-thread arenas of the executor threads
(tokenization, KV copies), stay resident until ``malloc_trim(0)``. That call hands back every
wholly free page of every arena (``madvise(MADV_DONTNEED)``).

Measured on the soak's node A (bench/RESULTS.md, issue 32 item 8; 2-core shared CPU machine): one
``malloc_trim(0)`` after a few minutes of load took node A's ``RssAnon`` from 189.7 to 186.8 MB (an
engine process: 249.5 to 243.4 MB). Every 30 s during a 10-minute soak, node A grew by 5.9 MB after the
warm-up, against 8.3 MB without it (same build, run side by side). A call took 0.1-0.5 ms on the event
loop. This trims what is free. It does not stop a growth of memory in use, such as the tokenizer's word
cache (node/worker/tokenizer_cache.py). ``MALLOC_ARENA_MAX=2`` was measured too and changed nothing
(+2.6 % against +3.5 % in 8 minutes, within the noise): the per-thread arenas held 1-4 MB in all.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import time
from typing import Callable

import structlog

log = structlog.get_logger("shiftnode.memory")

TRIM_INTERVAL_S = 60.0
"""Seconds between two ``malloc_trim(0)`` calls in the node's process."""


def _load_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


_TRIM = _load_trim()


def malloc_trim() -> bool | None:
    """Call ``malloc_trim(0)``. Returns whether memory was released, or None where it is unavailable."""
    return None if _TRIM is None else bool(_TRIM(0))


async def trim_periodically(interval_s: float = TRIM_INTERVAL_S, trim: Callable[[], bool | None] = malloc_trim,
                            clock: Callable[[], float] = time.perf_counter) -> None:
    """Run ``trim`` every ``interval_s`` seconds until cancelled (on the event loop: it takes well under a
    millisecond). Stops at once where trimming is unavailable (``trim`` returns None)."""
    while True:
        await asyncio.sleep(interval_s)
        t0 = clock()
        if trim() is None:
            log.info("malloc_trim_unavailable")
            return
        took_ms = (clock() - t0) * 1e3
        if took_ms > 5.0:  # worth knowing: it held the loop
            log.info("malloc_trim_slow", took_ms=round(took_ms, 2))
