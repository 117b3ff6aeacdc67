"""The chaos run's clients (``bench/load/chaos.py``): the greedy prompts and their references, and one request
sent the way a client does (streamed or not, maybe closed early), reduced to its outcome key
(:func:`bench.load.chaos_report.classify_error`) and the token ids it received."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from bench.load.chaos_report import classify_error
from bench.load.soak import WORDS


@dataclass
class Prompt:
    """A greedy prompt of the run and its reference token ids (from the unkilled run, or the shared file)."""

    text: str
    max_tokens: int
    reference: list[int] | None = None
    shared: bool = False  # one of the model's reference cases (its reference is the file's)


def greedy_pool(model: str, n_random: int, rng: random.Random) -> list[Prompt]:
    """The shared reference cases (when the model has them) and ``n_random`` seeded prompts of 8-120 words
    that may end at their natural EOS within 200 tokens."""
    ref = Path(model) / "reference_greedy.json"
    cases = json.loads(ref.read_text())["cases"] if ref.is_file() else []
    pool = [Prompt(c["prompt"], c["max_new_tokens"], c["output_token_ids"], shared=True) for c in cases]
    return pool + [Prompt(" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 120))), 200)
                   for _ in range(n_random)]


async def get(session: aiohttp.ClientSession, url: str, text: bool = False):
    """``GET url``: its JSON (its text with ``text``); 30 s at most."""
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=30)) as r:
        return await (r.text() if text else r.json())


async def complete(session: aiohttp.ClientSession, url: str, p: Prompt) -> list[int] | None:
    """One non-streamed greedy answer's token ids (None: not a 200)."""
    body = {"prompt": p.text, "max_tokens": p.max_tokens, "temperature": 0.0, "return_token_ids": True}
    async with session.post(url + "/v1/completions", json=body) as r:
        return (await r.json())["choices"][0]["token_ids"] if r.status == 200 else None


async def request(session: aiohttp.ClientSession, url: str, body: dict, cut: int | None,
                  deadline_s: float) -> tuple[str, list[int]]:
    """Send one completion; (its outcome key, the token ids it received). ``cut``: close the stream after
    that many events (a client that goes away)."""
    ids: list[int] = []
    try:
        async with asyncio.timeout(deadline_s):
            async with session.post(url + "/v1/completions", json=body) as r:
                if r.status != 200:
                    with contextlib.suppress(ValueError, aiohttp.ContentTypeError):
                        return classify_error(r.status, (await r.json()).get("error"), r.headers.get("Retry-After")), ids
                    return classify_error(r.status, None), ids
                if not body["stream"]:
                    return "ok", (await r.json())["choices"][0].get("token_ids") or []
                events, outcome = 0, None
                async for line in r.content:
                    if line.startswith(b"data: [DONE]"):
                        return outcome or "ok", ids
                    if not line.startswith(b"data: {"):
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        outcome = outcome or classify_error(200, event["error"])
                        continue
                    for c in event.get("choices", []):
                        ids += c.get("token_ids") or []
                    events += 1
                    if cut is not None and events >= cut:
                        return "aborted", ids  # leaving the block closes the connection mid-stream
                return "unclear:stream ended without [DONE]", ids
    except TimeoutError:
        return "hung", ids
    except aiohttp.ClientError as e:
        return f"unclear:connection {type(e).__name__}", ids
