"""The node process hands freed native heap pages back once a minute (node/runtime/memory.py)."""
import asyncio
import ctypes

import pytest
from aiohttp.test_utils import TestServer

import node.api.app as app_module
from node.config import NodeConfig
from node.runtime.memory import TRIM_INTERVAL_S, malloc_trim, trim_periodically
from virtual_time import run_virtual

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here


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
    """On a virtual clock (tests/virtual_time.py): the trims come exactly once a TRIM_INTERVAL_S, and where
    malloc_trim is unavailable the task tries once and ends."""
    times = []

    async def go(result, n):
        loop = asyncio.get_running_loop()
        enough = asyncio.Event()

        def trim():
            times.append(loop.time())
            if len(times) == n:
                enough.set()
            return result

        task = asyncio.create_task(trim_periodically(trim=trim))  # the default interval
        async with asyncio.timeout(TRIM_INTERVAL_S * (n + 1)):
            await (enough.wait() if result is not None else task)
        done = task.done()
        task.cancel()
        return done

    assert not run_virtual(go(True, 5))  # still running after 5 trims
    assert times == [pytest.approx(TRIM_INTERVAL_S * k, abs=1e-6) for k in range(1, 6)]
    times.clear()
    assert run_virtual(go(None, 1)) and times == [pytest.approx(TRIM_INTERVAL_S)]  # one try, then the task ends


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
