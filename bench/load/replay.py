"""Trace replay client: send a workload to a node over its streaming completions API and measure it.

``python -m bench.load.replay --url http://127.0.0.1:8000 --trace azure-conv --rate 4 --duration 20
--max-prompt-tokens 256 --max-output-tokens 64 --out run.json``

Each request of the workload (:mod:`bench.traffic.workload`) is sent at its arrival time (seconds after the
run start) as ``POST /v1/completions`` with ``stream: true``:

* ``prompt`` is a list of exactly ``prompt_tokens`` token ids — BOS (id 1) then seeded random ids in
  ``[3, vocab_size)`` — so the count is exact for any tokenizer (``vocab_size``: ``--vocab-size``, else
  the ``vocab_size`` of ``GET /v1/models`` when the node gives one, else 256, which every model served
  here has);
* with hash ids (a Mooncake trace read with ``--tokens-per-hash``), the prompt is built from them
  instead (:func:`bench.traffic.traces.hash_prompt_ids`): shared hashes give shared tokens, so the node's
  prefix cache sees the trace's reuse;
* ``max_tokens`` is the trace's output length and ``ignore_eos: true``, so every request generates
  exactly that many tokens (``return_token_ids`` counts them per chunk); greedy sampling. With
  ``natural_eos`` (``--natural-eos``) a request is sent as clients send it: ``max_tokens`` is only a cap
  (the trace's output length, e.g. 448 above the model's usual output) and the model's EOS ends it, so the
  node is never told the true length; any count from 1 to the cap is then a success. ``temperature``
  (``--temperature``) above 0 samples, with a per-request ``seed`` from the replay's seed (the same
  request draws the same tokens on every node that samples alike);
  ``stream_options.include_usage`` asks for the final usage chunk, whose
  ``prompt_tokens_details.cached_tokens`` gives the request's prefix-cache hit.

Per request it records (client clock, seconds): send time, TTFT (send to first token chunk), each ITL
(gap between consecutive token chunks), E2E (send to last chunk), output tokens, and an error (HTTP
status and message, a broken stream, fewer tokens than asked, or not finished within the drain
timeout). :func:`bench.traffic.metrics.summarize` turns them into the summary (duration = first send to last
finish). Arrivals stop after ``--duration`` seconds; in-flight requests then get ``--drain-timeout``
seconds to finish, after which they are cancelled and counted as failed, so a run always ends.
The run's JSON holds the configuration, the summary, the node's clock at the start (for aligning its
role timeline) and every request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from tqdm import tqdm

from bench.traffic.metrics import RequestRecord, Summary, format_summary, summarize
from bench.traffic.traces import TraceRequest, hash_prompt_ids
from bench.traffic.workload import add_workload_args, build_workload, spec_from_args

__all__ = ["ServerInfo", "RequestProgress", "ReplayResult", "fetch_server_info", "prompt_ids", "send_request",
           "replay", "result_json", "run", "main"]

BOS_ID = 1
FIRST_ID = 3  # ids 0-2 are <unk>, <s>, </s> in the Llama tokenizers served here
FALLBACK_VOCAB = 256


@dataclass(frozen=True)
class ServerInfo:
    """What the replay needs from the node: model id, context (tokens), vocab size, SLOs (ms)."""

    model: str
    max_model_len: int | None
    vocab_size: int
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None
    node_clock_s: float | None = None  # the node's monotonic clock when asked (s)


@dataclass
class RequestProgress:
    """One request as its stream goes (client clock, s); :meth:`record` gives its metrics record."""

    req: TraceRequest
    start_s: float | None = None
    first_s: float | None = None
    last_s: float | None = None
    itls_s: list[float] = field(default_factory=list)
    tokens: int = 0
    cached_tokens: int | None = None  # from the usage chunk: prompt tokens the node's prefix cache held
    error: str | None = None
    done: bool = False
    exact: bool = True  # the request must produce exactly req.output_tokens (ignore_eos); False: up to it (natural EOS)

    def record(self, t0: float) -> RequestRecord:
        err = self.error
        if err is None and not self.done:
            err = "not finished within the drain timeout" if self.start_s is not None else "never sent"
        if err is None and (self.tokens != self.req.output_tokens if self.exact
                            else not 0 < self.tokens <= self.req.output_tokens):
            err = f"got {self.tokens} of {self.req.output_tokens} tokens"
        ok = err is None and self.first_s is not None
        return RequestRecord(
            ttft_s=self.first_s - self.start_s if ok else None, itls_s=self.itls_s if ok else [],
            e2e_s=self.last_s - self.start_s if ok else None, output_tokens=self.tokens,
            prompt_tokens=self.req.prompt_tokens, error=err,
            start_s=(self.start_s if self.start_s is not None else t0 + self.req.arrival_s) - t0)


@dataclass
class ReplayResult:
    records: list[RequestRecord]
    summary: Summary
    node_clock_start_s: float | None
    node_clock_end_s: float | None
    wall_s: float
    cached_tokens: list[int | None] = field(default_factory=list)  # per request, from its usage chunk

    @property
    def prefix_hit_rate(self) -> float | None:
        """Cached prompt tokens over prompt tokens, over the requests that reported usage."""
        pairs = [(c, r.prompt_tokens) for c, r in zip(self.cached_tokens, self.records) if c is not None]
        total = sum(p for _, p in pairs)
        return sum(c for c, _ in pairs) / total if total else None


async def _get_json(session: aiohttp.ClientSession, url: str) -> dict | None:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as r:
            return await r.json() if r.status == 200 else None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None


async def fetch_server_info(session: aiohttp.ClientSession, url: str, vocab_size: int | None = None) -> ServerInfo:
    """Read ``/v1/models`` (required) and ``/v1/node`` (optional: SLOs and clock)."""
    models = await _get_json(session, url + "/v1/models")
    if not models or not models.get("data"):
        raise RuntimeError(f"no model list at {url}/v1/models")
    m = models["data"][0]
    node = await _get_json(session, url + "/v1/node") or {}
    slo = node.get("slo") or {}
    return ServerInfo(model=m["id"], max_model_len=m.get("max_model_len"),
                      vocab_size=vocab_size or m.get("vocab_size") or FALLBACK_VOCAB,
                      ttft_slo_ms=slo.get("ttft_ms"), tpot_slo_ms=slo.get("tpot_ms"), node_clock_s=node.get("clock_s"))


def prompt_ids(n: int, vocab_size: int, rng: random.Random) -> list[int]:
    """``n`` token ids: BOS, then uniform ids in ``[3, vocab_size)``."""
    if vocab_size <= FIRST_ID:
        raise ValueError(f"vocab_size {vocab_size} leaves no ordinary token ids")
    return [BOS_ID] + [rng.randrange(FIRST_ID, vocab_size) for _ in range(n - 1)]


async def send_request(session: aiohttp.ClientSession, url: str, body: dict, p: RequestProgress) -> None:
    """POST one streaming completion and record its token times into ``p`` (never raises for HTTP)."""
    p.start_s = time.monotonic()
    try:
        async with session.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                text = await r.text()
                try:
                    text = json.loads(text)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    pass
                p.error = f"HTTP {r.status}: {text[:200]}"
                return
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    p.done = True
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    p.cached_tokens = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                if "error" in chunk:
                    p.error = f"stream error: {chunk['error'].get('message', chunk['error'])}"
                    return
                n = sum(len(c.get("token_ids") or ()) for c in chunk.get("choices", ()))
                if n:
                    now = time.monotonic()
                    if p.first_s is None:
                        p.first_s = now
                    else:
                        p.itls_s.append(now - p.last_s)
                    p.last_s = now
                    p.tokens += n
            if not p.done:
                p.error = "stream ended without [DONE]"
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        p.error = f"{type(e).__name__}: {e}"


async def replay(url: str, requests: list[TraceRequest], info: ServerInfo, *, seed: int = 0,
                 ttft_slo_ms: float | None = None, tpot_slo_ms: float | None = None,
                 drain_timeout_s: float = 60.0, progress: bool = True, natural_eos: bool = False,
                 temperature: float = 0.0) -> ReplayResult:
    """Send ``requests`` at their arrival times, wait for them (at most ``drain_timeout_s`` after the
    last arrival) and summarize. ``natural_eos``: ``max_tokens`` is a cap and EOS ends a request (no
    ``ignore_eos``); ``temperature`` > 0: sampled, request ``i`` with seed ``seed * 100003 + i``."""
    rng = random.Random(seed)
    bodies = [{"model": info.model, "max_tokens": r.output_tokens, "temperature": temperature,
               **({} if natural_eos else {"ignore_eos": True}),
               **({"seed": (seed * 100003 + i) % (1 << 63)} if temperature > 0 else {}),
               "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True,
               "prompt": (hash_prompt_ids(r, info.vocab_size, first_id=FIRST_ID, bos_id=BOS_ID, seed=seed)
                          if r.hash_ids else prompt_ids(r.prompt_tokens, info.vocab_size, rng))}
              for i, r in enumerate(requests)]
    states = [RequestProgress(r, exact=not natural_eos) for r in requests]
    bar = tqdm(total=len(requests), unit="req", disable=not progress, file=sys.stderr, dynamic_ncols=True)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as session:
        clock0 = await _get_json(session, url + "/v1/node")  # the node's clock just before t0
        t0 = time.monotonic()
        tasks = []
        for body, st in sorted(zip(bodies, states), key=lambda x: x[1].req.arrival_s):
            delay = t0 + st.req.arrival_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(send_request(session, url, body, st))
            task.add_done_callback(lambda _t: bar.update(1))
            tasks.append(task)
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=drain_timeout_s)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        wall = time.monotonic() - t0
        clock1 = await _get_json(session, url + "/v1/node")
    bar.close()
    records = [s.record(t0) for s in states]
    summary = summarize(records, ttft_slo_ms=ttft_slo_ms, tpot_slo_ms=tpot_slo_ms)
    start_clock = clock0["clock_s"] if clock0 and "clock_s" in clock0 else None
    end_clock = clock1["clock_s"] if clock1 and "clock_s" in clock1 else None
    return ReplayResult(records, summary, start_clock, end_clock, wall, [s.cached_tokens for s in states])


def result_json(res: ReplayResult, config: dict, requests: list[TraceRequest]) -> dict:
    """The run's JSON document (see the module doc)."""
    return {
        "config": config,
        "summary": res.summary.as_dict(),
        "prefix_hit_rate": res.prefix_hit_rate,
        "wall_s": res.wall_s,
        "node_clock_start_s": res.node_clock_start_s,
        "node_clock_end_s": res.node_clock_end_s,
        "requests": [{"arrival_s": q.arrival_s, "start_s": r.start_s, "prompt_tokens": q.prompt_tokens,
                      "max_tokens": q.output_tokens, "output_tokens": r.output_tokens, "ttft_s": r.ttft_s,
                      "e2e_s": r.e2e_s, "itls_s": list(r.itls_s), "error": r.error, "cached_tokens": c}
                     for q, r, c in zip(requests, res.records, res.cached_tokens or [None] * len(requests))],
    }


async def run(args: argparse.Namespace) -> tuple[dict, ReplayResult]:
    """The whole CLI run: server info → workload → replay → JSON document (also written to ``--out``)."""
    url = args.url.rstrip("/")
    async with aiohttp.ClientSession() as s:
        info = await fetch_server_info(s, url, args.vocab_size)
    spec = spec_from_args(args, max_model_len=info.max_model_len)
    wl = build_workload(spec)
    ttft = args.ttft_slo_ms if args.ttft_slo_ms is not None else (info.ttft_slo_ms or 1000.0)
    tpot = args.tpot_slo_ms if args.tpot_slo_ms is not None else (info.tpot_slo_ms or 100.0)
    res = await replay(url, wl.requests, info, seed=args.seed, ttft_slo_ms=ttft, tpot_slo_ms=tpot,
                       drain_timeout_s=args.drain_timeout, progress=not args.no_progress,
                       natural_eos=args.natural_eos, temperature=args.temperature)
    config = {"url": url, "model": info.model, "max_model_len": info.max_model_len, "vocab_size": info.vocab_size,
              "workload": wl.describe(), "ttft_slo_ms": ttft, "tpot_slo_ms": tpot, "drain_timeout_s": args.drain_timeout}
    doc = result_json(res, config, wl.requests)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc))
    return doc, res


def add_replay_args(p: argparse.ArgumentParser, *, slo: bool = True) -> None:
    """Client flags shared with :mod:`bench.studies.compare` (everything but ``--url`` and ``--out``; the SLO
    flags only with ``slo``, as the comparison sets the node's SLOs and scores with the same)."""
    p.add_argument("--vocab-size", type=int, default=None, help="prompt ids stay below this (default: the node's, else 256)")
    if slo:
        p.add_argument("--ttft-slo-ms", type=float, default=None, help="TTFT target (default: the node's, else 1000)")
        p.add_argument("--tpot-slo-ms", type=float, default=None, help="TPOT target (default: the node's, else 100)")
    p.add_argument("--drain-timeout", type=float, default=60.0, help="seconds to wait for requests after the last arrival")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--natural-eos", action="store_true",
                   help="send requests as clients do: max_tokens (the trace's output length) is a cap, EOS ends them")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy; >0: seeded per request)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.load.replay", description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--out", default=None, help="write the run's JSON here")
    add_replay_args(ap)
    add_workload_args(ap)
    args = ap.parse_args(argv)
    try:
        _, res = asyncio.run(run(args))
    except (RuntimeError, ValueError, FileNotFoundError, aiohttp.ClientError) as e:
        print(f"bench.load.replay: {e}", file=sys.stderr)
        return 1
    print(format_summary(res.summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
