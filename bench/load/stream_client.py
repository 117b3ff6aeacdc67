"""Closed-loop streaming load for :mod:`bench.load.host_overhead`, split over client processes.

``c`` client tasks each send ``POST /v1/completions`` (``stream``, ``ignore_eos``, ``max_tokens`` fixed,
``return_token_ids`` so tokens are counted per chunk) back to back, each with a fresh random 8-token
prompt. :func:`run_load` spreads the ``c`` streams over ``processes`` client processes (``spawn``, each
its own event loop, uvloop where installed, and aiohttp session; the same per-request code), so that a
machine with many cores is not limited by one client process; with ``processes=1`` the streams run in
this process's loop as before.

The measured window is fixed before any load starts: the load begins at ``start`` (about now), the
window is ``[start + warmup_s, start + warmup_s + duration_s]`` on the system-wide monotonic clock
(``time.monotonic``, ``CLOCK_MONOTONIC`` on Linux: the same clock in every process), and every client
counts what arrives inside it:

* ``tokens``: tokens of the chunks whose arrival falls in the window;
* ``gap_s`` / ``gap_tokens``: the sum of in-request gaps between two chunks both in the window, and
  the tokens of the chunks they end at (mean ITL per token = ``gap_s / gap_tokens``); ``gaps``: each
  such gap divided by its chunk's tokens (seconds), at most :data:`GAPS_KEPT` in all;
* ``requests``: requests that ended in the window; ``errors``: failed requests (first message kept);
* ``cpu_s``: the client processes' CPU time (user + system) in the window, summed; ``cpu_max_s``: the
  busiest one's (near the window's length, that client limited).

This process reads the node's CPU time by role (:func:`bench.load.host_compare.cpu_by_role`, ``/proc``)
at both ends of the window, then each device's ``steps`` (``GET /v1/node``: a node whose loop is
saturated answers late, so the steps' interval is taken between the two reads' midpoints, and the slower
read's duration is kept), and merges the clients' counts (:meth:`Counts.merge`) once the window has
closed. A client process parses what each socket read brought as a whole (not line by line: about
half the CPU per token); events that came in one read are ``now - last`` apart for the first and 0 for
the others, as a line-by-line reader would see them.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import random
import re
import time
from dataclasses import dataclass, field

import aiohttp

from bench.load.host_compare import cpu_by_role
from node.config import usable_cores

__all__ = ["Counts", "LoadResult", "StreamLoad", "Window", "auto_processes", "run_load", "split"]

GAPS_KEPT = 100_000
_IDS = re.compile(rb'"token_ids":\s*\[([^\]]*)\]')


@dataclass
class Counts:
    """What clients saw in the window (see the module docstring); seconds."""

    tokens: int = 0
    gap_s: float = 0.0
    gap_tokens: int = 0
    gaps: list[float] = field(default_factory=list, repr=False)
    requests: int = 0
    errors: int = 0
    error: str | None = None
    cpu_s: float = 0.0
    cpu_max_s: float = 0.0
    processes: int = 1

    def merge(self, other: "Counts") -> None:
        """Add ``other`` (another client process's counts) into these: sums, the busiest CPU, the first
        error message, the gaps kept up to :data:`GAPS_KEPT`."""
        self.tokens += other.tokens
        self.gap_s += other.gap_s
        self.gap_tokens += other.gap_tokens
        self.gaps.extend(other.gaps[:max(0, GAPS_KEPT - len(self.gaps))])
        self.requests += other.requests
        self.errors += other.errors
        self.error = self.error or other.error
        self.cpu_s += other.cpu_s
        self.cpu_max_s = max(self.cpu_max_s, other.cpu_max_s)


@dataclass(frozen=True)
class Window:
    """The measured interval, ``time.monotonic()`` seconds (one clock for every process on Linux)."""

    t_a: float
    t_b: float

    def __contains__(self, t: float) -> bool:
        return self.t_a <= t <= self.t_b


@dataclass
class LoadResult:
    """One measured run: the clients' merged counts, each device's steps between the two ``/v1/node``
    reads (``steps_wall_s`` apart, their midpoints; the slower read took ``read_s``), the node's CPU
    seconds in the window by role (control process, API front ends, engines), the window and its length
    (s)."""

    counts: Counts
    steps: list[int]
    cpu: tuple[float, float, float]
    wall_s: float
    window: Window
    steps_wall_s: float = 0.0
    read_s: float = 0.0


def split(concurrency: int, processes: int) -> list[int]:
    """``concurrency`` streams over at most ``processes`` clients, as evenly as possible, none empty:
    ``split(10, 4) == [3, 3, 2, 2]``; ``split(2, 4) == [1, 1]``."""
    k = max(1, min(processes, concurrency))
    return [concurrency // k + (i < concurrency % k) for i in range(k)]


def auto_processes(cores: int | None = None) -> int:
    """``--client-processes auto``: a quarter of ``cores`` (default: the CPUs this process may run on), 1 to
    8 (16 cores: 4, beside a node with 8 front ends, its control loop and its engine; one client process
    streams about 100k tokens/s per core at ~9 us CPU per token, measured on the 2-core VM)."""
    cores = cores or usable_cores()
    return max(1, min(8, cores // 4))


class StreamLoad:
    """``c`` closed-loop streaming clients in this process's event loop, counting into :attr:`counts`
    what arrives inside ``window``. ``body``: the request JSON without the prompt; ``vocab``: prompt
    token ids are drawn from ``[3, vocab)``."""

    def __init__(self, url: str, body: dict, concurrency: int, window: Window, vocab: int = 512, seed: int = 0,
                 gaps_kept: int = GAPS_KEPT):
        self.url, self.body, self.c, self.window, self.vocab = url, body, concurrency, window, vocab
        self.rng = random.Random(seed)
        self.gaps_kept = gaps_kept
        self.counts = Counts()
        self.stopping = asyncio.Event()

    async def _one(self, session: aiohttp.ClientSession) -> None:
        body = {**self.body, "prompt": [1] + [self.rng.randrange(3, self.vocab) for _ in range(7)]}
        cell, win, last = self.counts, self.window, None
        async with session.post(self.url + "/v1/completions", json=body) as r:
            if r.status != 200:
                cell.errors += 1
                cell.error = cell.error or f"HTTP {r.status}: {(await r.text())[:160]}"
                await asyncio.sleep(0.05)
                return
            tail = b""
            async for data in r.content.iter_any():  # what one read brought: parsed whole, not line by line
                now = time.monotonic()
                buf = tail + data if tail else data
                cut = buf.rfind(b"\n") + 1  # an event's data line is whole once its newline has come
                tail = buf[cut:]
                for m in _IDS.finditer(buf, 0, cut):  # events that came together: gaps of 0 after the first
                    n = m.group(1).count(b",") + 1 if m.group(1).strip() else 0
                    if not n:
                        continue
                    if now in win:
                        cell.tokens += n
                        if last is not None and last in win:
                            cell.gap_s += now - last
                            cell.gap_tokens += n
                            if len(cell.gaps) < self.gaps_kept:
                                cell.gaps.append((now - last) / n)
                    last = now
        if time.monotonic() in win:
            cell.requests += 1

    async def _worker(self, session: aiohttp.ClientSession) -> None:
        while not self.stopping.is_set():
            try:
                await self._one(session)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, OSError) as e:
                self.counts.errors += 1
                self.counts.error = self.counts.error or f"{type(e).__name__}: {e}"
                await asyncio.sleep(0.05)

    async def _cpu(self) -> None:
        """This process's CPU time in the window (read at its two ends)."""
        await asyncio.sleep(max(0.0, self.window.t_a - time.monotonic()))
        cpu0 = time.process_time()
        await asyncio.sleep(max(0.0, self.window.t_b - time.monotonic()))
        self.counts.cpu_s = self.counts.cpu_max_s = time.process_time() - cpu0

    async def run(self) -> Counts:
        """Stream until :attr:`stopping` is set (by the caller, after the window), then the counts."""
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as s:
            tasks = [asyncio.create_task(self._worker(s)) for _ in range(self.c)] + [asyncio.create_task(self._cpu())]
            await self.stopping.wait()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return self.counts


# --- a client process --------------------------------------------------------------------------------
async def _child(conn, url: str, body: dict, c: int, window: Window, vocab: int, seed: int, gaps_kept: int) -> Counts:
    load = StreamLoad(url, body, c, window, vocab, seed, gaps_kept)
    loop = asyncio.get_running_loop()
    fd = conn.fileno()

    def stop() -> None:
        loop.remove_reader(fd)
        load.stopping.set()

    loop.add_reader(fd, stop)  # the parent's "stop" (or its exit: EOF)
    loop.call_later(max(0.0, window.t_b - time.monotonic()) + 60, load.stopping.set)  # never outlive a lost parent
    try:
        return await load.run()
    finally:
        loop.remove_reader(fd)


def _client_main(conn, url: str, body: dict, c: int, vocab: int, seed: int, gaps_kept: int) -> None:
    """A client process: says ``ready``, takes the :class:`Window`, streams until told to stop, sends its
    :class:`Counts` (or a :class:`Counts` with the error)."""
    try:
        import uvloop

        run = uvloop.run
    except ImportError:
        run = asyncio.run
    conn.send("ready")
    window = conn.recv()
    try:
        counts = run(_child(conn, url, body, c, window, vocab, seed, gaps_kept))
    except Exception as e:  # noqa: BLE001 - the parent reports it as the cell's error
        counts = Counts(errors=1, error=f"client process: {type(e).__name__}: {e}")
    os.set_blocking(conn.fileno(), True)  # the loop's reader left it non-blocking: a large send would fail (EAGAIN)
    conn.send(counts)
    conn.close()


# --- this process: the window's two reads and the merge -----------------------------------------------
async def _steps(session: aiohttp.ClientSession, url: str) -> tuple[list[int], float, float]:
    """Each device's ``steps`` from ``GET /v1/node``, the read's midpoint and its duration (monotonic s)."""
    t0 = time.monotonic()
    async with session.get(url + "/v1/node") as r:
        st = await r.json()
    t1 = time.monotonic()
    return [d["steps"] for d in st["devices"]], (t0 + t1) / 2, t1 - t0


async def _measure(url: str, window: Window, node_pid: int | None, local: StreamLoad | None):
    """At each end of the window: the node's CPU by role (``/proc``, at once), then its steps (an HTTP read
    a busy node may answer late: the steps' own interval is between the two reads' midpoints)."""
    runs = asyncio.create_task(local.run()) if local else None
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        await asyncio.sleep(max(0.0, window.t_a - time.monotonic()))
        cpu0 = cpu_by_role(node_pid)
        before, mid0, read0 = await _steps(s, url)
        await asyncio.sleep(max(0.0, window.t_b - time.monotonic()))
        cpu1 = cpu_by_role(node_pid)
        after, mid1, read1 = await _steps(s, url)
    if local:
        local.stopping.set()
        await runs
    return ([b - a for a, b in zip(before, after)], tuple(b - a for a, b in zip(cpu0, cpu1)), mid1 - mid0,
            max(read0, read1))


def run_load(url: str, body: dict, concurrency: int, *, processes: int = 1, warmup_s: float = 2.0,
             duration_s: float = 6.0, node_pid: int | None = None, vocab: int = 512, seed: int = 0,
             ready_timeout_s: float = 60.0) -> LoadResult:
    """Drive ``concurrency`` streams (split over ``processes`` client processes; 1: in this process) for
    ``warmup_s`` then the measured ``duration_s``, and return the merged :class:`LoadResult`. A client
    process that does not start in ``ready_timeout_s`` raises ``RuntimeError``; one that dies counts as an
    error in the result. Client processes are always ended before this returns."""
    shares = split(concurrency, processes)
    ctx, procs = mp.get_context("spawn"), []
    try:
        if len(shares) > 1:
            for i, share in enumerate(shares):
                here, there = ctx.Pipe()
                p = ctx.Process(target=_client_main, args=(there, url, body, share, vocab, seed + i,
                                                           GAPS_KEPT // len(shares)), name=f"stream-client-{i}", daemon=True)
                p.start()
                there.close()
                procs.append((p, here))
            for i, (p, here) in enumerate(procs):
                if not here.poll(ready_timeout_s) or here.recv() != "ready":
                    raise RuntimeError(f"client process {i} did not start in {ready_timeout_s:.0f} s")
        start = time.monotonic() + 0.05
        window = Window(start + warmup_s, start + warmup_s + duration_s)
        for _, here in procs:
            here.send(window)
        local = StreamLoad(url, body, concurrency, window, vocab, seed) if not procs else None
        steps, cpu, steps_wall_s, read_s = asyncio.run(_measure(url, window, node_pid, local))
        counts = local.counts if local else Counts(processes=len(procs))
        for i, (p, here) in enumerate(procs):
            try:
                here.send("stop")
            except OSError:
                pass  # a client that died: its missing counts are the error below
        for i, (p, here) in enumerate(procs):
            try:
                if not here.poll(30):
                    raise EOFError("no counts in 30 s")
                counts.merge(here.recv())
            except (EOFError, OSError) as e:
                counts.errors += 1
                counts.error = counts.error or f"client process {i}: {type(e).__name__}: {e}"
        return LoadResult(counts, steps, cpu, window.t_b - window.t_a, window, steps_wall_s, read_s)
    finally:
        for p, here in procs:
            here.close()
            p.join(5)
            if p.is_alive():
                p.terminate()
                p.join(5)
