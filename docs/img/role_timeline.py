"""Draw docs/img/role-timeline.png: a live time-shared node's role timeline, from its own switch records.

Sends 16 streaming requests in three bursts (0 s, 0.6-1.1 s, 1.5-2.1 s) to a running node, then reads
``GET /v1/node`` and plots each device's roles with :func:`bench.studies.plots.role_timeline`. Run from the
repository root, with the node of the README's tour on port 8000:

    .venv/bin/shiftnode serve --model ../shared/models/stories260k --devices cpu:0,cpu:1 --mode time-shared \\
        --reconfig-pause-ms 20 --ttft-slo-ms 1000 --tpot-slo-ms 100 &
    .venv/bin/python docs/img/role_timeline.py http://127.0.0.1:8000 docs/img/role-timeline.png
"""

import asyncio
import json
import sys
import urllib.request
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the checkout's bench/ package
from bench.studies import plots  # noqa: E402

ANIMALS = ["cat", "dog", "bird", "girl", "boy", "tree"]


def get(url: str, path: str) -> dict:
    return json.load(urllib.request.urlopen(url + path))


async def one(session: aiohttp.ClientSession, url: str, i: int, delay_s: float, max_tokens: int) -> None:
    """One sampled streaming completion sent after ``delay_s``; its events are read and dropped."""
    await asyncio.sleep(delay_s)
    body = {"prompt": f"Once upon a time there was a little {ANIMALS[i % 6]} who", "max_tokens": max_tokens,
            "temperature": 0.8, "seed": i, "ignore_eos": True, "stream": True}
    async with session.post(url + "/v1/completions", json=body) as r:
        async for _ in r.content:
            pass


async def main(url: str, out: Path) -> None:
    t0 = get(url, "/v1/node")["clock_s"]  # the node's own clock, which its switch records use
    async with aiohttp.ClientSession() as s:
        await asyncio.gather(*[one(s, url, i, 0.0, 96) for i in range(6)],
                             *[one(s, url, 10 + i, 0.6 + 0.1 * i, 64) for i in range(6)],
                             *[one(s, url, 20 + i, 1.5 + 0.2 * i, 48) for i in range(4)])
    status = get(url, "/v1/node")
    plots.role_timeline(status, t0, status["clock_s"], out,
                        title="time-shared, 2 CPU devices, stories260k, 16 requests: device roles (live node)")
    print("switches", sum(len(d.get("switches", [])) for d in status["devices"]), "span_s",
          round(status["clock_s"] - t0, 2))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], Path(sys.argv[2])))
