"""The node process hands freed native heap pages back once a minute (node/runtime/memory.py)."""
import asyncio
import ctypes

from aiohttp.test_utils import TestServer

import node.api.app as app_module
from node.config import NodeConfig
from node.runtime.memory import malloc_trim, trim_periodically


def _rss_anon_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))


def test_malloc_trim_returns_pages_freed_inside_the_heap():
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    chunks = [libc.malloc(16 * 1024) for _ in range(4096)]  # 64 MiB below the mmap threshold: on the heap
    for c in chunks:
        ctypes.memset(c, 1, 16 * 1024)  # resident
    for c in chunks[:-1]:  # free all but the last: the top stays in use, so free() cannot shrink the heap
        libc.free(c)
    before = _rss_anon_kib()
    assert malloc_trim() is not None  # glibc: the call exists
    after = _rss_anon_kib()
    libc.free(chunks[-1])
    assert before - after > 32 * 1024, (before, after)  # most of the 64 MiB back to the OS


def test_trim_runs_every_interval_and_stops_where_unavailable():
    calls = []

    async def go(result):
        task = asyncio.create_task(trim_periodically(0.01, trim=lambda: calls.append(1) or result))
        await asyncio.sleep(0.2)
        done = task.done()
        task.cancel()
        return done

    assert not asyncio.run(go(True)) and len(calls) >= 5
    calls.clear()
    assert asyncio.run(go(None)) and len(calls) == 1  # no malloc_trim here: one try, then the task ends


def test_the_node_app_starts_the_trim_task(monkeypatch):
    started = []

    async def fake(*a, **k):
        started.append(1)
        await asyncio.Event().wait()

    monkeypatch.setattr(app_module, "trim_periodically", fake)

    class Stand_in:  # what the app's start-up and cleanup call on a node; no model is loaded
        def start(self):
            pass

        async def start_network(self):
            pass

        async def close(self):
            pass

    async def go():
        server = TestServer(app_module.create_app(NodeConfig(), node=Stand_in()))
        await server.start_server()
        await asyncio.sleep(0)
        await server.close()

    asyncio.run(go())
    assert started == [1]
