"""Soak: minutes of mixed streaming load with client aborts, an engine killed, a peer restarted.

    python -m bench.load.soak [--duration 1800] [--concurrency 16] [--abort 0.3] [--model PATH]

Two time-shared nodes on the model (default: the shared stories260k): **A** with two devices
(``cpu:0,cpu:1``, engine processes) and **B** with one, B listening for KV (``--kv-port``) and A
sending to it (``--peers``), the imbalance fallback at its default. Clients stream completions to A
(prompts of 8-200 tokens, 8-128 new tokens, greedy or sampled, a quarter non-streamed); a fraction
``--abort`` of the streams is closed by the client after a random number of events. During the run:

* at 30 % of ``--duration``, ``kill -9`` of one of A's engine processes;
* at 60 %, B is stopped (SIGTERM) and started again on the same ports.

At the end, after the load stops and the nodes settle, it prints and checks:

* **leaked blocks**: KV blocks still held (``kv_blocks_used``) on every live device of A and B;
* **hung**: requests whose client saw no end within the deadline (``--request-timeout-s``
  plus 30 s), and requests the nodes still hold (``live_requests``);
* **RSS growth**, per process of node A: private resident memory (``RssAnon``) at the end against
  after the warm-up (10 % of the run), for the node's own process and for each engine process that
  lived through the run (the engine killed at 30 % is replaced by a new process: it is listed, not
  judged); node A's resident share of the shared KV pools (``RssShmem``) is printed beside it, and
  node A's ``RssAnon`` once a minute (``rss_series``), so a slope can be read, not only two points;
* **5xx**: responses with a server error status other than 503 (503 is the honest answer while a
  device or the peer is down), and error events inside streams, by code.

Exit status 0 when there are no leaked blocks, nothing hung, no judged process grew by 5 % or more and no 5xx other
than 503 was sent. :func:`soak` is what ``tests/test_soak.py`` runs for 10 seconds.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures as cf
import contextlib
import json
import os
import random
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from bench.load.node_process import NodeServer, free_port

REPO = Path(__file__).resolve().parents[2]
STORIES = REPO.parent / "shared" / "models" / "stories260k"
WORDS = "once upon a time there was a little girl who liked to play in the park with her dog".split()


@dataclass
class Report:
    """What a soak run saw (counts, and node A's RSS in KiB)."""

    requests: int = 0
    completed: int = 0
    aborted: int = 0
    hung: int = 0
    statuses: collections.Counter = field(default_factory=collections.Counter)
    stream_errors: collections.Counter = field(default_factory=collections.Counter)
    leaked_blocks: int = 0
    live_requests: int = 0
    rss_warm_kib: int = 0  # node A's private resident memory (RssAnon) after the warm-up
    rss_end_kib: int = 0
    engines_rss_kib: dict = field(default_factory=dict)  # "cpu:0 (pid N)" -> [after warm-up, end] RssAnon, KiB
    engines_replaced: list[str] = field(default_factory=list)  # engines that did not live through the run
    rss_series: list[tuple[int, int]] = field(default_factory=list)  # (seconds into the run, node A RssAnon KiB)
    shmem_warm_kib: int = 0  # node A's resident pages of the shared KV pools (RssShmem), for the record
    shmem_end_kib: int = 0
    events: list[str] = field(default_factory=list)

    @property
    def rss_growth(self) -> float:
        """Growth of node A's own process (fraction)."""
        return self.rss_end_kib / self.rss_warm_kib - 1 if self.rss_warm_kib else 0.0

    @property
    def max_rss_growth(self) -> float:
        """The largest growth (fraction) among node A's process and the engines that lived through the run."""
        return max([self.rss_growth, *(end / warm - 1 for warm, end in self.engines_rss_kib.values() if warm)])

    @property
    def server_errors(self) -> int:
        return sum(n for s, n in self.statuses.items() if s >= 500 and s != 503)

    def ok(self) -> bool:
        return not self.leaked_blocks and not self.hung and not self.live_requests and self.max_rss_growth < 0.05 \
            and not self.server_errors and not self.stream_errors.get("internal_error")

    def lines(self) -> list[str]:
        return [*self.events,
                f"requests {self.requests}: completed {self.completed}, aborted by the client {self.aborted}, hung {self.hung}",
                f"HTTP statuses {dict(sorted(self.statuses.items()))}; error events in streams {dict(self.stream_errors)}",
                f"leaked KV blocks {self.leaked_blocks}; requests still held {self.live_requests}",
                f"node A private RSS {self.rss_warm_kib} KiB after warm-up -> {self.rss_end_kib} KiB ({self.rss_growth:+.1%}); "
                f"resident shared KV pool pages {self.shmem_warm_kib} -> {self.shmem_end_kib} KiB",
                *(f"engine {k} private RSS {w} KiB after warm-up -> {e} KiB ({e / w - 1:+.1%})"
                  for k, (w, e) in self.engines_rss_kib.items() if w),
                *(f"engine {k}: replaced during the run, not judged" for k in self.engines_replaced),
                "node A private RSS by minute (KiB): " + " ".join(f"{t // 60}:{kib}" for t, kib in self.rss_series),
                "PASS" if self.ok() else "FAIL"]


def rss_kib(pid: int) -> tuple[int, int]:
    """(private resident memory, resident pages of shared mappings) of ``pid`` in KiB: ``RssAnon`` and
    ``RssShmem`` of ``/proc/PID/status``. The KV pools are shared memory the engines allocate in full at
    start; the node's resident share of them grows as it touches blocks (KV moves and hand-offs) up to
    the pools' size, which is not a leak, so growth is judged on the private part."""
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    return int(fields["RssAnon"].split()[0]), int(fields["RssShmem"].split()[0])


async def client(session: aiohttp.ClientSession, url: str, rng: random.Random, abort: float, deadline_s: float,
                 rep: Report) -> None:
    body = {"prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 200))), "max_tokens": rng.randint(8, 128),
            "temperature": rng.choice([0.0, 0.8]), "top_p": 0.95, "stream": rng.random() >= 0.25}
    cut = rng.randint(1, body["max_tokens"]) if body["stream"] and rng.random() < abort else None
    rep.requests += 1
    try:
        async with asyncio.timeout(deadline_s):
            async with session.post(url + "/v1/completions", json=body) as r:
                rep.statuses[r.status] += 1
                if r.status != 200 or not body["stream"]:
                    await r.read()
                    rep.completed += r.status == 200
                    return
                events = 0
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        event = json.loads(line[6:])
                        if "error" in event:
                            rep.stream_errors[event["error"].get("code")] += 1
                        events += 1
                        if cut is not None and events >= cut:
                            rep.aborted += 1
                            return  # leaving the block closes the connection mid-stream
                    elif line.startswith(b"data: [DONE]"):
                        rep.completed += 1
                        return
    except TimeoutError:
        rep.hung += 1
    except aiohttp.ClientError:
        rep.statuses[-1] += 1  # the connection failed (counted, not an HTTP status)


async def load(url: str, concurrency: int, abort: float, until_s: float, deadline_s: float, seed: int,
               rep: Report) -> None:
    rng = random.Random(seed)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        async def worker(i: int) -> None:
            mine = random.Random(rng.random())
            while time.monotonic() < until_s:
                await client(session, url, mine, abort, deadline_s, rep)

        await asyncio.gather(*(worker(i) for i in range(concurrency)))


def engine_pids(node: NodeServer) -> dict[str, int]:
    """``{"cpu:0 (pid N)": N}`` for the node's live engine processes (from ``/v1/node``)."""
    out = {}
    for d in node.get_json("/v1/node")["devices"]:
        pid = (d.get("engine") or {}).get("pid")
        if pid and d["failure"] is None:
            out[f"{d['device']} (pid {pid})"] = pid
    return out


def live_blocks(node: NodeServer) -> tuple[int, int]:
    st = node.get_json("/v1/node")
    return sum(d["kv_blocks_used"] for d in st["devices"] if d["failure"] is None), st["live_requests"]


def soak(duration_s: float, concurrency: int = 16, abort: float = 0.3, model: str | Path = STORIES,
         request_timeout_s: float = 120.0, seed: int = 0, log_dir: Path | None = None,
         kv_cache_memory: str | None = None) -> Report:
    """Run the soak (see the module docstring) for ``duration_s`` seconds of load; return the report.
    ``kv_cache_memory``: ``--kv-cache-memory`` of both nodes (None: the default, 26,214 blocks per
    device on stories260k, whose prefix-cache index takes most of an hour of this load to fill)."""
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="soak-"))
    kv_port = free_port()
    # time-shared named: the default mode (colocated) takes no --peers
    common = ["--model", str(model), "--mode", "time-shared", "--peer-secret", "soak",
              "--request-timeout-s", str(request_timeout_s),
              *(["--kv-cache-memory", kv_cache_memory] if kv_cache_memory else [])]
    b_args = [*common, "--kv-port", str(kv_port), "--kv-host", "127.0.0.1"]
    rep = Report()
    with contextlib.ExitStack() as stack:
        b = NodeServer(b_args, log_path=log_dir / "b.log")
        a = NodeServer([*common, "--devices", "cpu:0,cpu:1", "--peers", f"127.0.0.1:{kv_port}"], log_path=log_dir / "a.log")
        stack.callback(lambda: b.stop())  # whichever B is current (the chaos starts a second one)
        stack.callback(a.stop)
        with cf.ThreadPoolExecutor(2) as pool:  # side by side (A reconnects to B until B listens)
            list(pool.map(NodeServer.start, (b, a)))
        t0 = time.monotonic()

        async def chaos() -> None:
            nonlocal b
            await asyncio.sleep(0.1 * duration_s)
            rep.rss_warm_kib, rep.shmem_warm_kib = rss_kib(a.proc.pid)
            for name, pid in (await asyncio.to_thread(engine_pids, a)).items():
                rep.engines_rss_kib[name] = [rss_kib(pid)[0], 0]
            await asyncio.sleep(0.2 * duration_s)
            pid = a.get_json("/v1/node")["devices"][1]["engine"]["pid"]
            os.kill(pid, signal.SIGKILL)
            rep.events.append(f"{time.monotonic() - t0:6.1f} s: kill -9 of A's engine on cpu:1 (pid {pid})")
            await asyncio.sleep(0.3 * duration_s)
            await asyncio.to_thread(b.stop)
            rep.events.append(f"{time.monotonic() - t0:6.1f} s: B stopped")
            b = NodeServer(b_args, log_path=log_dir / "b2.log")
            await asyncio.to_thread(b.start)
            rep.events.append(f"{time.monotonic() - t0:6.1f} s: B up again")

        async def sample() -> None:
            while (t := time.monotonic() - t0) < duration_s:
                rep.rss_series.append((round(t), rss_kib(a.proc.pid)[0]))
                await asyncio.sleep(60)

        async def run() -> None:
            await asyncio.gather(load(a.url, concurrency, abort, t0 + duration_s, request_timeout_s + 30, seed, rep),
                                 chaos(), sample())

        asyncio.run(run())
        settle = time.monotonic() + 30  # streams the clients left end at the nodes' next steps
        while True:
            (held_a, live_a), (held_b, live_b) = live_blocks(a), live_blocks(b)
            if held_a + held_b + live_a + live_b == 0 or time.monotonic() > settle:
                break
            time.sleep(0.2)
        rep.leaked_blocks, rep.live_requests = held_a + held_b, live_a + live_b
        rep.rss_end_kib, rep.shmem_end_kib = rss_kib(a.proc.pid)
        rep.rss_series.append((round(time.monotonic() - t0), rep.rss_end_kib))
        alive = engine_pids(a)
        for name in list(rep.engines_rss_kib):
            if name in alive:
                rep.engines_rss_kib[name][1] = rss_kib(alive[name])[0]
            else:
                del rep.engines_rss_kib[name]
                rep.engines_replaced.append(name)
        b.stop()
    return rep


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.load.soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=1800.0, help="seconds of load")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--abort", type=float, default=0.3, help="fraction of streams the client closes early")
    ap.add_argument("--model", default=str(STORIES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-cache-memory", default=None, help="KV cache bytes per device of both nodes, e.g. 64MiB")
    a = ap.parse_args(argv)
    rep = soak(a.duration, a.concurrency, a.abort, a.model, seed=a.seed, kv_cache_memory=a.kv_cache_memory)
    print("\n".join(rep.lines()))
    return 0 if rep.ok() else 1


if __name__ == "__main__":
    raise SystemExit(main())
