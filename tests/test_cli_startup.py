"""``shiftnode serve`` refuses what it cannot run with at once: one line on stderr, exit status 2,
before the model loads (wrong flag combinations, a missing CUDA device, a port already taken)."""

import socket
import subprocess
import sys
import time

import pytest

from bench.studies.compare import node_args, parser as compare_parser
from support import REPO, STORIES


def serve(*flags: str) -> tuple[int, str, float]:
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "node.cli", "serve", "--model", str(STORIES), *flags],
                       capture_output=True, text=True, cwd=REPO, timeout=120)
    return r.returncode, r.stderr, time.monotonic() - t0


def assert_one_line_refusal(rc: int, err: str, *words: str) -> None:
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shiftnode: cannot start: "), err
    assert "Traceback" not in err
    for w in words:
        assert w in err, err


@pytest.mark.parametrize("flags,words", [
    (["--devices", "cuda:99"], ["cuda:99"]),  # no CUDA here; on a GPU machine, more devices than it has
    (["--device", "cuda:99"], ["cuda:99"]),
    (["--mode", "pooled", "--devices", "cpu:0,cpu:1"], ["--devices", "--prefill-devices", "--decode-devices"]),
    (["--mode", "pooled", "--device", "cpu:0", "--prefill-devices", "cpu:0", "--decode-devices", "cpu:1"], ["--device "]),
    (["--prefill-devices", "cpu:0"], ["--prefill-devices needs --mode pooled"]),
    (["--mode", "colocated", "--prefill-devices", "cpu:0", "--decode-devices", "cpu:1"], ["need --mode pooled", "colocated"]),
    (["--mode", "pooled", "--prefill-devices", "cpu:0", "--decode-devices", "cpu:0,cpu:1"], ["cpu:0 is in both"]),
    (["--devices", "tpu:0"], ["'tpu:0' is not a device"]),
    (["--device", "cpu:0", "--devices", "cpu:0,cpu:1"], ["--device or --devices"]),
    # stories260k has 4 KV heads: refused from its config before any rank process starts
    (["--devices", ",".join(f"cpu:{i}" for i in range(8)), "--mode", "time-shared", "--decode-tp", "8"],
     ["--decode-tp 8", "num_key_value_heads 4"]),
    (["--devices", "cpu:0,cpu:1,cpu:2", "--mode", "time-shared", "--decode-tp", "2"], ["--decode-tp 2 groups --devices"]),
])
def test_flag_combinations_are_refused_in_one_line(flags, words):
    rc, err, _ = serve(*flags)
    assert_one_line_refusal(rc, err, *words)


@pytest.mark.quick
def test_port_in_use_fails_before_the_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        rc, err, elapsed = serve("--port", str(port))
        assert_one_line_refusal(rc, err, f"--port {port}", "Address already in use")
        assert elapsed < 10  # no model load, no torch import: a second or so
        rc, err, _ = serve("--port", str(_free()), "--kv-port", str(port), "--peer-secret", "s")
        assert_one_line_refusal(rc, err, f"--kv-port {port}", "Address already in use")


@pytest.mark.quick
def test_unresolvable_host_is_refused():
    rc, err, _ = serve("--host", "no-such-host.invalid", "--port", str(_free()))
    assert_one_line_refusal(rc, err, "--host", "does not resolve")


def _free() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# bench.studies.compare starts pooled nodes with pools, never with --devices (which a pooled node refuses).
@pytest.mark.quick
def test_compare_gives_pooled_nodes_their_pools():
    a = compare_parser().parse_args([])
    assert a.modes.split(",") == ["time-shared", "colocated", "pooled"]
    pooled = node_args(a, "pooled")
    assert "--devices" not in pooled
    assert pooled[pooled.index("--prefill-devices") + 1] == "cpu:0" and pooled[pooled.index("--decode-devices") + 1] == "cpu:1"
    assert node_args(a, "colocated")[:4] == ["--mode", "colocated", "--devices", "cpu:0,cpu:1"]
    four = node_args(compare_parser().parse_args(["--devices", "cpu:0,cpu:1,cpu:2,cpu:3"]), "pooled")
    assert four[four.index("--prefill-devices") + 1] == "cpu:0,cpu:1"
    mine = compare_parser().parse_args(["--mode-args", "pooled=--prefill-devices cpu:1 --decode-devices cpu:0"])
    explicit = node_args(mine, "pooled")
    assert "--devices" not in explicit and explicit.count("--prefill-devices") == 1
    assert explicit[explicit.index("--prefill-devices") + 1] == "cpu:1"
