"""Calibrate a cost model through a running node's API: step costs as a client sees them.

``python -m bench.cost.calibrate_node --url http://127.0.0.1:8000 --out cost.json``

:mod:`bench.cost.calibrate` times ``ModelRunner.execute`` alone. A live node adds, to every step, its shell
(batch forming, the hop to the worker thread, output processing, the SSE write) and, on a small shared
CPU, contention between the device's thread, the event loop and the client — on the 2-core machine of
``bench/RESULTS.md`` the client saw steps about twice as long as the runner's. This probe measures the
node end to end, at low concurrency, with requests built like the replay's (token-id prompts,
``ignore_eos``):

* prefill: one request at a time with a prompt of ``n`` tokens (``n`` doubling from 16 to
  ``--max-prompt-tokens``) and one output token; its TTFT is a sample ``(n, seconds)``;
* decode: ``b`` concurrent requests (``b`` doubling to ``--max-batch``), ``--decode-prompt-tokens``
  prompts and ``--decode-output-tokens`` outputs; the median of their inter-token gaps is a sample
  ``(b, b x (prompt + output/2), seconds)``.

Each point is the median of ``--reps`` repetitions; the node should be otherwise idle. The samples are
fitted like :mod:`bench.cost.calibrate`'s (:func:`bench.cost.calibrate.fit`), and the JSON has the same form.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

import aiohttp
import msgspec

from bench.cost.calibrate import doubling, fit, fit_errors
from bench.load.replay import RequestProgress, fetch_server_info, prompt_ids, send_request
from bench.traffic.traces import TraceRequest
from node.core.cost import CostModel
from node.core.roofline import cost_model_to_dict

__all__ = ["probe", "main"]


async def _run(session: aiohttp.ClientSession, url: str, info, rng: random.Random, prompt: int, output: int,
               concurrent: int) -> list[RequestProgress]:
    states = [RequestProgress(TraceRequest(0.0, prompt, output)) for _ in range(concurrent)]
    bodies = [{"model": info.model, "prompt": prompt_ids(prompt, info.vocab_size, rng), "max_tokens": output,
               "ignore_eos": True, "temperature": 0.0, "stream": True, "return_token_ids": True} for _ in states]
    await asyncio.gather(*(send_request(session, url, b, s) for b, s in zip(bodies, states)))
    bad = [s.error for s in states if s.error or not s.done]
    if bad:
        raise RuntimeError(f"probe request failed: {bad[0]}")
    return states


async def probe(url: str, *, max_prompt_tokens: int = 256, max_batch: int = 16, decode_prompt_tokens: int = 128,
                decode_output_tokens: int = 32, reps: int = 3, seed: int = 0
                ) -> tuple[list[tuple[int, float]], list[tuple[int, int, float]]]:
    """``(prefill samples, decode samples)`` measured through the node at ``url`` (see the module doc)."""
    rng = random.Random(seed)
    async with aiohttp.ClientSession() as session:
        info = await fetch_server_info(session, url)
        ctx = info.max_model_len or 2048
        await _run(session, url, info, rng, 16, 2, 1)  # warm-up
        prefill = []
        for n in doubling(16, min(max_prompt_tokens, ctx - 1)):
            ttfts = []
            for _ in range(reps):
                s = (await _run(session, url, info, rng, n, 1, 1))[0]
                ttfts.append(s.first_s - s.start_s)
            prefill.append((n, statistics.median(ttfts)))
            print(f"prefill {n:6d} tokens: {prefill[-1][1] * 1e3:8.2f} ms", file=sys.stderr)
        p, o = min(decode_prompt_tokens, ctx // 2), min(decode_output_tokens, ctx // 2)
        decode = []
        for b in doubling(1, max_batch):
            itls = []
            for _ in range(reps):
                states = await _run(session, url, info, rng, p, o, b)
                itls.append(statistics.median([g for s in states for g in s.itls_s]))
            decode.append((b, b * (p + o // 2), statistics.median(itls)))
            print(f"decode  {b:4d} seqs x {p + o // 2} ctx: {decode[-1][2] * 1e3:8.2f} ms", file=sys.stderr)
    return prefill, decode


def calibrate(url: str, out: str | Path, *, quadratic: bool = True, method: str = "relative", **kw) -> CostModel:
    """Probe, fit and write the cost model JSON; returns the model."""
    prefill, decode = asyncio.run(probe(url, **kw))
    cost = fit(prefill, decode, 0.0, method=method, quadratic=quadratic)
    errs = [abs(e) for e in fit_errors(cost, prefill, decode)]
    doc = {**cost_model_to_dict(cost), "calibration": {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "through": f"node API at {url}",
        "fit": method, "quadratic": quadratic, "max_relative_fit_error": round(max(errs), 4),
        "mean_relative_fit_error": round(sum(errs) / len(errs), 4), "prefill_samples": prefill,
        "decode_samples": decode}}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(doc, indent=1) + "\n")
    return cost


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cost.calibrate_node", description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--max-prompt-tokens", type=int, default=256)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--decode-prompt-tokens", type=int, default=128)
    ap.add_argument("--decode-output-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--fit", default="relative", choices=["relative", "ols"])
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    cost = calibrate(a.url, a.out, method=a.fit, max_prompt_tokens=a.max_prompt_tokens, max_batch=a.max_batch,
                     decode_prompt_tokens=a.decode_prompt_tokens, decode_output_tokens=a.decode_output_tokens,
                     reps=a.reps)
    print(json.dumps(msgspec.structs.asdict(cost), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
