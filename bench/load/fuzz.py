"""The long run of the API fuzzer: ``tests/test_fuzz_api.py`` with many examples per operation.

    python -m bench.load.fuzz [--examples 2000] [--seed-random]

The suite runs 30 generated requests per operation (derandomized, so a failure reproduces); this
runs ``--examples`` per operation against a fresh stories260k node, and with ``--seed-random`` lets
Hypothesis pick new inputs each run instead of the fixed sequence. It passes only if no request got
a 5xx, none hung (60 s each), and the node is alive and holds no KV at the end. pytest's exit status.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.load.fuzz", description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", type=int, default=2000, help="generated requests per operation")
    ap.add_argument("--seed-random", action="store_true", help="new inputs each run (not derandomized)")
    a = ap.parse_args(argv)
    env = {**os.environ, "SHIFTNODE_FUZZ_EXAMPLES": str(a.examples)}
    if a.seed_random:
        env["SHIFTNODE_FUZZ_RANDOM"] = "1"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_fuzz_api.py"]
    return subprocess.call(cmd, cwd=REPO, env=env)


if __name__ == "__main__":
    raise SystemExit(main())
