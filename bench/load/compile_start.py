"""Compiled steps without a slow start (issue 46 item 2): first response, ITL while compiling, cold and warm.

    python -m bench.load.compile_start [--rounds N] [--duration S] [--compile-sizes 1,2,...] [--json PATH]

Each round starts, one after another on the same machine (so their ratios share its load):

* ``eager``: ``shiftnode serve --compile none`` on stories260k;
* ``cold``: ``--compile inductor`` (in the background) with an empty ``--compile-cache-dir``;
* ``warm``: the same again, with the cache the cold node filled.

Per node: ``first s``, launch to the first completion's answer (a request sent as soon as the port
answers: what a user starting a node and asking at once waits); ``all s``, launch to every bucket
compiled (``GET /v1/node``'s ``compile.state``); ``ITL p50`` of one closed-loop stream
(:func:`bench.load.stream_client.run_load`, greedy, ``ignore_eos``, 128 tokens) over ``--duration``
seconds, ``--windows`` times right after the first answer (``while``: the compile thread working, the
buckets compiled by the windows' end in ``compiled_at_windows_end``) and again once every bucket is
compiled (``after``; the eager node's is one more window). The load average is printed with each row.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from bench.load.node_process import NodeServer
from bench.load.stream_client import run_load
from node.config import EMBEDDED_MODEL

BODY = {"max_tokens": 128, "ignore_eos": True, "stream": True, "return_token_ids": True, "temperature": 0}


def _first_answer(node: NodeServer, t0: float, timeout_s: float = 120.0) -> float:
    """Seconds from ``t0`` (the launch) to the first completion's answer, asking as soon as the port is open."""
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}).encode()
    deadline = t0 + timeout_s
    while time.monotonic() < deadline:
        req = urllib.request.Request(node.url + "/v1/completions", body, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except (OSError, urllib.error.URLError):
            time.sleep(0.05)
    raise RuntimeError(f"no answer in {timeout_s} s: {node.log_tail()}")


def _compile(node: NodeServer) -> dict:
    return node.get_json("/v1/node")["devices"][0]["compile"] or {"state": "off", "compiled": []}


def _itl_p50_ms(node: NodeServer, duration_s: float) -> float:
    r = run_load(node.url, BODY, 1, warmup_s=0.5, duration_s=duration_s, node_pid=node.proc.pid)
    return statistics.median(r.counts.gaps) * 1e3 if r.counts.gaps else float("nan")


def measure(kind: str, cache: Path, args: argparse.Namespace, log_dir: Path) -> dict:
    """One node of ``kind`` (eager, cold, warm): its row (module doc)."""
    flags = ["--model", args.model, "--compile", "none" if kind == "eager" else "inductor",
             "--compile-cache-dir", str(cache)]
    if args.compile_sizes:
        flags += ["--compile-sizes", args.compile_sizes]
    node = NodeServer(flags, log_path=log_dir / f"{kind}.log", startup_timeout_s=300)
    t0 = time.monotonic()
    with node:
        first = _first_answer(node, t0)
        while_ms = [round(_itl_p50_ms(node, args.duration), 3) for _ in range(args.windows)]
        during = state = _compile(node)  # the buckets compiled by the end of the first windows
        all_s = None
        while state["state"] == "compiling" and time.monotonic() - t0 < args.compile_timeout:
            time.sleep(0.5)
            state = _compile(node)
        if state["state"] != "compiling" and kind != "eager":
            all_s = round(time.monotonic() - t0, 1)
        after_ms = _itl_p50_ms(node, args.duration)
        final = _compile(node)
    return {"node": kind, "first_s": round(first, 2), "all_compiled_s": all_s, "itl_p50_while_ms": while_ms,
            "compiled_at_windows_end": during.get("compiled", []), "itl_p50_after_ms": round(after_ms, 3),
            "state": final["state"], "buckets": final.get("compiled", []), "bucket_ms": final.get("bucket_ms"),
            "load_avg": [round(x, 2) for x in os.getloadavg()]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(EMBEDDED_MODEL), help="model folder [the embedded stories260k]")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--duration", type=float, default=6.0, help="seconds of each ITL window")
    p.add_argument("--compile-sizes", default=None, help="--compile-sizes of the compiled nodes [the default buckets]")
    p.add_argument("--compile-timeout", type=float, default=900.0,
                   help="seconds after its launch a node may take to compile; then its 'after' window runs anyway "
                        "(all_compiled_s null)")
    p.add_argument("--windows", type=int, default=2, help="ITL windows right after the first answer")
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="shiftnode-compile-start-") as tmp:
        for r in range(args.rounds):
            cache = Path(tmp) / f"cache-{r}"  # empty: the cold node compiles, the warm one loads
            for kind in ("eager", "cold", "warm"):
                row = measure(kind, cache, args, Path(tmp) / f"logs-{r}") | {"round": r}
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
