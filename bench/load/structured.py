"""Structured output's cost (issue 44): throughput and ITL with a JSON schema against none, the mask's
cost per token, compile times, and the grammar cache's bound.

    python -m bench.load.structured [--duration S] [--rounds R] [--clients 64,1] [--json PATH]
                                    [--skip-node] [--skip-in-process]

Against one ``shiftnode serve --model stories260k`` node (one CPU device), closed-loop streaming load
(each client sends ``POST /v1/completions`` again as soon as its stream ends, the same prompt in every
arm): for each client count, three arms, interleaved, ``--rounds`` times each, each ``--duration`` seconds
after a 2 s warm-up (:func:`bench.load.stream_cells.stream_cell`):

* ``schema``: a ``json_schema`` response format, ``max_tokens`` 128. Its outputs end where the grammar
  lets the model stop (EOS once the JSON is complete), so they are shorter than 128 and vary;
* ``free`` (the literal comparison): no constraint, ``ignore_eos``, every output 128 tokens;
* ``matched`` (the fair comparison): no constraint, ``ignore_eos``, each request's ``max_tokens`` drawn
  from the output lengths the ``schema`` arm of the same round just produced (the clients cycle through
  them), so both arms stream outputs of the same length distribution.

The target (64 streams at >= 0.8x the unconstrained tokens/s) is about what constraining costs. Against
``free`` the constrained arm also pays for its shorter outputs: a request's fixed costs (its prefill,
parsing, admission, the stream's set-up and end) are spread over fewer tokens, which a user who asks for
the same outputs without a schema would pay too. ``matched`` keeps the prompt, the client count and the
output lengths and removes only the grammar, so ``ratio_matched`` is the cost of the constraint itself;
``ratio_free`` is kept as the literal figure. Both are reported, with each round's ratio (the arms of a
round ran back to back, so they share the machine's phase) and their spread.

``tok/s``: streamed tokens / wall; ``ITL p50``: median gap between a stream's token chunks (ms);
``node_us_per_token``: the node's processes' CPU (user + system: the control process, its API front ends,
its engine) in the window over its tokens, in µs, which hardly depends on how much of the shared machine
the node got; ``client_us_per_token`` the same of this process (the load, which shares the two cores
with the node: a request's set-up costs the client too, so shorter outputs cost it more per token). Then, in this process: the mask's CPU per token (thread CPU time: fill for a 64-row batch on
the engine's code path, one call into a reused bitmask; apply, and xgrammar's CPU kernel on the same
mask for comparison; accept; over 10 walks of 64 sequences through the grammar), the
compile time of a 50-field schema cold (a new cache) and cached, and the cache's entries and bytes over
10,000 distinct schemas against its bounds.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from bench.load.node_process import NodeServer
from bench.load.stream_cells import stream_cell

STORIES = Path(__file__).resolve().parents[2].parent / "shared" / "models" / "stories260k"
SCHEMA = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                           "story": {"type": "string"}, "mood": {"enum": ["happy", "sad"]}},
          "required": ["title", "story", "mood"]}
MAX_TOKENS = 128
WALKS = 10  # walks of 64 sequences through the schema, for the mask's cost per token


def fifty_fields(salt: int = 0) -> dict:
    kinds = [{"type": "integer", "minimum": 0, "maximum": 1000}, {"type": "string", "maxLength": 20},
             {"type": "boolean"}, {"enum": ["a", "b", "c"]}, {"type": "array", "items": {"type": "number"}, "maxItems": 4}]
    props = {f"field_{salt}_{i}": kinds[i % len(kinds)] for i in range(50)}
    return {"type": "object", "properties": props, "required": list(props)}


def _body(constrained: bool, max_tokens: int = MAX_TOKENS) -> dict:
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0.8, "stream": True,
            "return_token_ids": True}
    return body | ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}}
                   if constrained else {"ignore_eos": True})


def matched_bodies(lengths: list[int]) -> list[dict]:
    """Unconstrained bodies (``ignore_eos``) whose ``max_tokens`` follow ``lengths``, the output lengths
    of the constrained arm, in a fixed shuffled order (a client ``i`` starts at the ``i``-th and cycles
    through them: in the order they ended, the first ones, which every client starts with, are the
    shortest)."""
    order = [n for n in lengths if n > 0]
    random.Random(0).shuffle(order)
    return [_body(False, n) for n in order] or [_body(False)]


def node_cells(duration: float, rounds: int, client_counts: list[int]) -> dict:
    out: dict = {}
    with NodeServer(["--model", str(STORIES), "--devices", "cpu:0"], log_path="/tmp/bench_structured_node.log") as node:
        pid = node.proc.pid
        for _ in range(rounds):
            for clients in client_counts:
                schema = stream_cell(node.url, [_body(True)], clients, duration, pid)
                matched = stream_cell(node.url, matched_bodies(schema["lengths"]), clients, duration, pid)
                free = stream_cell(node.url, [_body(False)], clients, duration, pid)
                for arm, r in (("schema", schema), ("matched", matched), ("free", free)):
                    lengths = r.pop("lengths")
                    r["mean_output_tokens"] = statistics.mean(lengths) if lengths else None
                    out.setdefault(f"c{clients}_{arm}", []).append(r)
        out["grammar_cache"] = node.get_json("/v1/node")["grammar_cache"]
    return out


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "rounds": [round(v, 3) for v in values]}


def summary(cells: dict, clients: int) -> dict:
    """Per client count: each arm's mean tok/s, median ITL p50 and median CPU per token (the node's, the
    load's), and the schema
    arm's ratios to ``matched`` (fair) and ``free`` (literal), round by round (tok/s: schema / other;
    CPU per token: schema / other) with their median and range."""
    arms = {a: cells[f"c{clients}_{a}"] for a in ("schema", "matched", "free")}
    res: dict = {}
    for a, rs in arms.items():
        cpu = [r["node_us_per_token"] for r in rs if r.get("node_us_per_token")]
        client = [r["client_us_per_token"] for r in rs if r.get("client_us_per_token")]
        res[a] = {"tok_s": statistics.mean(r["tok_s"] for r in rs),
                  "itl_p50_ms": statistics.median(r["itl_p50_ms"] for r in rs if r["itl_p50_ms"] is not None),
                  "mean_output_tokens": statistics.mean(r["mean_output_tokens"] for r in rs if r["mean_output_tokens"]),
                  "node_us_per_token": statistics.median(cpu) if cpu else None,
                  "client_us_per_token": statistics.median(client) if client else None}
    for other in ("matched", "free"):
        pairs = list(zip(arms["schema"], arms[other]))
        res[f"ratio_{other}"] = _spread([s["tok_s"] / o["tok_s"] for s, o in pairs])
        res[f"itl_ratio_{other}"] = _spread([s["itl_p50_ms"] / o["itl_p50_ms"] for s, o in pairs])
        cpu = [s["node_us_per_token"] / o["node_us_per_token"] for s, o in pairs
               if s.get("node_us_per_token") and o.get("node_us_per_token")]
        if cpu:
            res[f"cpu_per_token_ratio_{other}"] = _spread(cpu)
    return res


def in_process() -> dict:
    from node.core.grammar_spec import GrammarSpec
    from node.worker.grammar import BitmaskFiller, GrammarCache, SeqGrammar, apply_mask, tokenizer_info, xgrammar
    from node.worker.tokenizer import TextTokenizer
    from shiftnode_kernels import cpu_bitmask_numba

    tok = TextTokenizer.from_folder(STORIES)
    vocab = 512
    info = tokenizer_info(tok, vocab, tok.eos_token_ids)
    out: dict = {}
    t = time.perf_counter()
    cache = GrammarCache(info)
    spec = GrammarSpec("json_schema", json.dumps(fifty_fields()))
    cache.get(spec)
    out["compile_50_fields_cold_ms"] = 1000 * (time.perf_counter() - t)
    t = time.perf_counter()
    for _ in range(100):
        cache.get(spec)
    out["compile_50_fields_cached_ms"] = 1000 * (time.perf_counter() - t) / 100
    # mask cost per token: 64 sequences walked through the grammar by seeded draws under the mask, WALKS times;
    # thread CPU time (a loaded machine stretches wall time, not this)
    grammar = cache.get(GrammarSpec("json_schema", json.dumps(SCHEMA)))
    cpu_bitmask_numba.available()  # compiled or loaded now, as a process's first grammar cache does (not timed)
    filler = BitmaskFiller(vocab)
    gen = torch.Generator().manual_seed(0)
    fill_s = apply_s = xgr_apply_s = accept_s = 0.0
    tokens = 0
    clock = time.thread_time
    for _ in range(WALKS):
        seqs = [SeqGrammar(grammar, []) for _ in range(64)]
        for _ in range(MAX_TOKENS):
            live = [(i, g) for i, g in enumerate(seqs) if g.active]
            if not live:
                break
            rows = [i for i, _ in live]
            t = clock()
            mask = filler.fill([g for _, g in live], rows)
            t1 = clock()
            logits = torch.randn(len(seqs), vocab, generator=gen)
            spare = logits.clone()
            t2 = clock()
            apply_mask(logits, mask, rows)
            t3 = clock()
            xgrammar().apply_token_bitmask_inplace(spare, mask, vocab_size=vocab, indices=rows)  # the kernel replaced
            t3x = clock()
            picks = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen).flatten().tolist()
            t4 = clock()
            for i, g in live:
                g.accept(picks[i])
            t5 = clock()
            fill_s += t1 - t
            apply_s += t3 - t2
            xgr_apply_s += t3x - t3
            accept_s += t5 - t4
            tokens += len(live)
    out["mask_us_per_token"] = {"fill": 1e6 * fill_s / tokens, "apply": 1e6 * apply_s / tokens,
                                "apply_xgrammar_kernel": 1e6 * xgr_apply_s / tokens,
                                "accept": 1e6 * accept_s / tokens, "tokens": tokens}
    # the cache's bound over 10,000 distinct schemas
    bounded = GrammarCache(info)
    peak_entries = peak_bytes = 0
    t = time.perf_counter()
    for i in range(10_000):
        schema = {"type": "object", "properties": {f"k{i}": {"type": "integer"}, "v": {"enum": [str(i)]}}, "required": ["v"]}
        bounded.get(GrammarSpec("json_schema", json.dumps(schema)))
        peak_entries, peak_bytes = max(peak_entries, bounded.num_entries), max(peak_bytes, bounded.num_bytes)
    out["cache_10k"] = {"peak_entries": peak_entries, "max_entries": bounded.max_entries, "peak_bytes": peak_bytes,
                        "max_bytes": bounded.max_bytes, "seconds": time.perf_counter() - t}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--skip-node", action="store_true")
    ap.add_argument("--skip-in-process", action="store_true")
    ap.add_argument("--clients", default="64,1", help="client counts of the node cells (default: 64,1)")
    a = ap.parse_args()
    counts = [int(x) for x in a.clients.split(",")]
    res = {} if a.skip_in_process else {"in_process": in_process()}
    if not a.skip_node:
        res["node"] = node_cells(a.duration, a.rounds, counts)
        for c in counts:
            res[f"c{c}_summary"] = summary(res["node"], c)
    text = json.dumps(res, indent=1)
    print(text)
    if a.json:
        Path(a.json).write_text(text)


if __name__ == "__main__":
    main()
