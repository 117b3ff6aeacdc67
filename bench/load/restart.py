"""Engine restart: the pause a stream sees when the engine under it is killed, and the time to restart.

    python -m bench.load.restart [--devices 2] [--streams 4] [--model PATH]

Starts a node on ``--devices`` CPU devices (``cpu:0,...``), streams the stories260k greedy reference
prompts (``--streams`` of them, cycling), and once every stream has had two events sends SIGKILL to
the engine process of ``cpu:0``. It prints, per stream, whether it ended with its exact reference
and without an error event, and its longest gap between two events (the pause: with two devices the
sequences resume on the other one; with one they wait for the restart); and for the node, the time
from the kill to ``/health`` leaving ``ok``, and to ``cpu:0`` serving again on a new engine process
(``/v1/node``: ``failure`` null, a new pid). Exit status 0 when every stream was exact and cpu:0
came back.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import tempfile
import time
from pathlib import Path

import aiohttp

from bench.load.node_process import NodeServer

REPO = Path(__file__).resolve().parents[2]
STORIES = REPO.parent / "shared" / "models" / "stories260k"


async def stream(session: aiohttp.ClientSession, url: str, case: dict, started: asyncio.Event,
                 count: list[int], need: int) -> dict:
    """One greedy stream of ``case``; ``started`` is set once ``need`` streams have had two events."""
    body = {"prompt": case["prompt"], "max_tokens": len(case["output_token_ids"]), "temperature": 0.0,
            "stream": True, "return_token_ids": True}
    ids, errors, stamps, n = [], [], [], 0
    async with session.post(url + "/v1/completions", json=body) as r:
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            stamps.append(time.monotonic())
            event = json.loads(line[6:])
            if "error" in event:
                errors.append(event["error"].get("code"))
            for c in event.get("choices", []):
                ids += c.get("token_ids") or []
            n += 1
            if n == 2:
                count[0] += 1
                if count[0] == need:
                    started.set()
    gap = max((b - a for a, b in zip(stamps, stamps[1:])), default=0.0)
    return {"prompt": case["prompt"], "exact": ids == case["output_token_ids"], "tokens": len(ids),
            "errors": errors, "max_gap_s": gap}


async def run(node: NodeServer, cases: list[dict], streams: int) -> tuple[list[dict], float | None, float | None]:
    pid = node.get_json("/v1/node")["devices"][0]["engine"]["pid"]
    started, count = asyncio.Event(), [0]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        tasks = [asyncio.create_task(stream(session, node.url, cases[i % len(cases)], started, count, streams))
                 for i in range(streams)]
        await asyncio.wait_for(started.wait(), 120)
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        seen = back = None
        while back is None and time.monotonic() - t0 < 600:
            if seen is None:
                async with session.get(node.url + "/health") as r:
                    if (await r.json())["status"] != "ok":
                        seen = time.monotonic() - t0
            async with session.get(node.url + "/v1/node") as r:
                d = (await r.json())["devices"][0]
            if d["failure"] is None and d["engine"]["pid"] != pid:
                back = time.monotonic() - t0
            await asyncio.sleep(0.05)
        results = await asyncio.gather(*tasks)
    return results, seen, back


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.load.restart", description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, default=2, help="CPU devices of the node; cpu:0's engine is killed")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--model", default=str(STORIES))
    a = ap.parse_args(argv)
    cases = json.loads((Path(a.model) / "reference_greedy.json").read_text())["cases"]
    devices = ",".join(f"cpu:{i}" for i in range(a.devices))
    log = Path(tempfile.mkdtemp(prefix="restart-")) / "node.log"
    with NodeServer(["--model", a.model, "--devices", devices], log_path=log) as node:
        results, seen, back = asyncio.run(run(node, cases, a.streams))
    for r in results:
        print(f"{r['prompt'][:24]:<26} exact={r['exact']!s:<5} tokens={r['tokens']:<4} "
              f"errors={r['errors'] or '-'} longest gap {r['max_gap_s']:.2f} s")
    print(f"kill -9 of cpu:0's engine: /health not ok after {seen if seen is None else round(seen, 2)} s, "
          f"cpu:0 serving again after {back if back is None else round(back, 2)} s (node log: {log})")
    return 0 if back is not None and all(r["exact"] and not r["errors"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
