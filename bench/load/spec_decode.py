"""Speculative decoding's gain (issue 46, item 3): one node with ``--speculative-config`` against one without,
on a workload whose outputs repeat spans of their prompts.

    python -m bench.load.spec_decode [--duration S] [--rounds R] [--clients 1,64] [--spec JSON | --draft-model PATH [-k K]]
        [--json PATH]

Two ``shiftnode serve --model stories260k --cpu-threads 1`` nodes (one CPU device each; only one is loaded
at a time),
closed-loop streaming load (each client sends ``POST /v1/completions`` again as soon as its stream ends),
greedy, ``max_tokens`` 128 with ``ignore_eos`` (every request streams 128 tokens). The prompts are the
reference stories' prompts followed by their greedy continuation and the prompt again, as token ids, so
the continuation copies the prompt (the summaries-and-code-edits case). ``--draft-model PATH`` speculates with
that draft model instead of n-gram lookups (``{"model": PATH, "num_speculative_tokens": K}``; the speculating
node's cells are then named ``draft`` rather than ``ngram``; ``PATH`` stories260k itself drafts for itself,
every draft kept, so it measures the draft's cost). Cells are interleaved (per round:
per client count, the plain node then the speculating one), each ``--duration`` seconds after a 2 s
warm-up. ``tok_s``: streamed tokens / wall; ``itl_p50_ms``: median over chunks of the gap to the
stream's previous chunk divided by the chunk's tokens (a verify step sends several tokens in one chunk);
``tpot_ms``: mean per request of (last chunk - first chunk) / (tokens - 1); ``node_us_per_token``: the CPU
time of the node's processes (its own, its engine's) over the cell's window per token streamed in it
(:mod:`bench.load.stream_cells`), which a loaded machine changes less than latency. The speculating node's
acceptance counts come from ``GET /v1/node``. Ratios are the speculating node's over the plain node's, per
round; the summary gives their median and range.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from bench.load.node_process import NodeServer
from bench.load.stream_cells import stream_cell

SHARED = Path(__file__).resolve().parents[2].parent / "shared"
STORIES = SHARED / "models" / "stories260k"
MAX_TOKENS = 128
SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'


def repeating_prompts() -> list[list[int]]:
    """Each reference story's prompt, its greedy continuation (60 tokens) and the prompt again, as token ids."""
    cases = json.loads((STORIES / "reference_greedy.json").read_text())["cases"]
    return [c["prompt_token_ids"] + c["output_token_ids"][:60] + c["prompt_token_ids"] for c in cases]


def _bodies() -> list[dict]:
    return [{"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True, "stream": True,
             "return_token_ids": True} for p in repeating_prompts()]


def _ratios(p: list[dict], s: list[dict], key: str) -> list[float]:
    return [b[key] / a[key] for a, b in zip(p, s) if a.get(key) and b.get(key)]


def run(duration: float, rounds: int, counts: list[int], spec: str, label: str = "ngram") -> dict:
    """The interleaved cells of a plain node and one with ``--speculative-config spec`` (its cells and summary
    keys named ``label``), and per client count a summary of tokens/s, ITL p50 and TPOT, with their ratios."""
    res: dict = {"cells": {}, "speculative_config": json.loads(spec)}
    # one intra-op thread each: the start-up probe of --cpu-threads, timed on a loaded machine, could give the
    # two nodes different counts (2 threads on 2 busy cores was measured 6x slower than 1), not speculation
    base = ["--model", str(STORIES), "--devices", "cpu:0", "--cpu-threads", "1"]
    with NodeServer(base, log_path="/tmp/bench_spec_plain.log") as plain, \
            NodeServer(base + ["--speculative-config", spec], log_path=f"/tmp/bench_spec_{label}.log") as ngram:
        for _ in range(rounds):
            for clients in counts:
                for name, node in (("plain", plain), (label, ngram)):
                    r = stream_cell(node.url, _bodies(), clients, duration, node.proc.pid)
                    r.pop("lengths", None)
                    res["cells"].setdefault(f"c{clients}_{name}", []).append(r)
        res["speculative"] = ngram.get_json("/v1/node")["devices"][0].get("speculative")
    for c in counts:
        p, s = res["cells"][f"c{c}_plain"], res["cells"][f"c{c}_{label}"]
        summary = {"plain_tok_s": statistics.mean(r["tok_s"] for r in p), f"{label}_tok_s": statistics.mean(r["tok_s"] for r in s)}
        summary["tok_s_ratio"] = summary[f"{label}_tok_s"] / summary["plain_tok_s"]
        for key in ("itl_p50_ms", "tpot_ms"):  # medians of the cells that have one (a TPOT needs a request ended in the cell)
            a, b = [r[key] for r in p if r[key] is not None], [r[key] for r in s if r[key] is not None]
            if a and b:
                summary |= {f"plain_{key}": statistics.median(a), f"{label}_{key}": statistics.median(b),
                            f"{key.rsplit('_', 1)[0]}_ratio": statistics.median(b) / statistics.median(a)}
        for key, name in (("tok_s", "tok_s"), ("itl_p50_ms", "itl_p50"), ("tpot_ms", "tpot"),
                          ("node_us_per_token", "cpu_per_token")):
            ratios = _ratios(p, s, key)  # per round: the two cells ran back to back, on the same phase of a shared machine
            if ratios:
                summary[f"{name}_ratio_rounds"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
        res[f"c{c}_summary"] = summary
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--clients", default="1,64", help="client counts (default: 1,64)")
    ap.add_argument("--spec", default=SPEC, help=f"the speculating node's --speculative-config (default: {SPEC})")
    ap.add_argument("--draft-model", default=None, metavar="PATH",
                    help="speculate with this draft model (same vocabulary as stories260k) instead of --spec")
    ap.add_argument("-k", type=int, default=3, help="--draft-model's num_speculative_tokens (default: 3)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    spec, label = a.spec, "ngram"
    if a.draft_model:
        spec, label = json.dumps({"model": str(Path(a.draft_model).resolve()), "num_speculative_tokens": a.k}), "draft"
    res = run(a.duration, a.rounds, [int(x) for x in a.clients.split(",")], spec, label)
    text = json.dumps(res, indent=1)
    print(text)
    if a.json:
        Path(a.json).write_text(text)


if __name__ == "__main__":
    main()
