"""Shared test helpers: locating ../shared, starting node processes on free loopback ports, SSE parsing."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("SHIFTNODE_SHARED", REPO.parent / "shared"))
STORIES = SHARED / "models" / "stories260k"


# A small random-weight Llama geometry over TextTokenizer.byte_level() (3 special tokens + 256 bytes):
# for tests that build a model in code (dummy weights) and need no files. Not a served model.
BYTE_LEVEL_MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 4,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 16, "vocab_size": 259,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True,
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
}


def require_shared() -> Path:
    """The shared data folder; a missing one fails the test (it is never skipped)."""
    assert (STORIES / "model.safetensors").is_file(), f"shared model missing at {STORIES} (set SHIFTNODE_SHARED)"
    return SHARED


def reference_cases() -> list[dict]:
    return json.loads((require_shared() / "models" / "stories260k" / "reference_greedy.json").read_text())["cases"]


_GIVEN_PORTS: set[int] = set()


def free_port() -> int:
    """A free loopback port, never one this process handed out before (nodes started in parallel
    bind theirs only seconds later, so the OS could otherwise offer the same port twice)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _GIVEN_PORTS:
            _GIVEN_PORTS.add(port)
            return port


def checkout_env() -> dict[str, str]:
    """This process's environment with this checkout's packages first on ``PYTHONPATH`` (``node`` and
    ``kernels/shiftnode_kernels``), as pytest's ``pythonpath`` puts them first here: a node started from
    a worktree then runs that worktree's kernels, not those of the checkout the package was installed
    from (``python -m`` finds ``node`` in the cwd, but ``shiftnode_kernels`` only on the path)."""
    env = dict(os.environ)
    path = [str(REPO), str(REPO / "kernels")] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(path))
    return env


class NodeProcess:
    """A ``shiftnode serve`` subprocess on a free loopback port; stops on ``close()``.

    The constructor waits until the node answers; with ``wait=False`` it only launches the process
    and :meth:`wait_up` (or :func:`up`, for several) waits, so that nodes a test needs together
    start in parallel instead of one after another.
    """

    def __init__(self, *args: str, timeout_s: float = 120.0, wait: bool = True, port: int | None = None):
        self.port = port or free_port()  # a given port: a node restarted where clients expect it
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        if not any(a == "--compile" or a.startswith("--compile=") for a in args):
            # eager unless the test asks, whatever --compile's default becomes: a background compile per node
            # would load the shared cores of the suite
            args = (*args, "--compile", "none")
        cmd = [sys.executable, "-m", "node.cli", "serve", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO, env=checkout_env())
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.client: httpx.Client | None = None
        if wait:
            self.wait_up()

    def wait_up(self) -> "NodeProcess":
        """Block until the node answers ``/health`` (200, or 503: up but not able to serve yet)."""
        if self.client is not None:
            return self
        while True:  # asked at least once: a node launched long ago may have been up for a while
            if self.proc.poll() is not None:
                raise RuntimeError(f"node exited with {self.proc.returncode}:\n{self.logs()}")
            try:
                # up once it answers: 503 is a node that cannot serve yet (e.g. no decode peer ready)
                if httpx.get(self.url + "/health", timeout=1).status_code in (200, 503):
                    break
            except httpx.HTTPError:
                time.sleep(0.05)  # a refused connection costs microseconds: poll often
            if time.monotonic() >= self.deadline:
                self.close()
                raise RuntimeError(f"node did not start in {self.timeout_s}s:\n{self.logs()}")
        self.client = httpx.Client(base_url=self.url, timeout=120)
        return self

    def logs(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()

    def alive(self) -> bool:
        return self.proc.poll() is None and httpx.get(self.url + "/health", timeout=5).status_code == 200

    def health(self) -> tuple[int, dict]:
        """``GET /health``: (HTTP status, body)."""
        r = httpx.get(self.url + "/health", timeout=5)
        return r.status_code, r.json()

    def status(self) -> dict:
        return self.client.get("/v1/node").json()

    def wait_idle(self, timeout_s: float = 10.0) -> dict:
        """Wait until no device holds KV blocks or sequences; return the final status."""
        deadline = time.monotonic() + timeout_s
        while True:
            st = self.status()
            if all(d["kv_blocks_used"] == 0 and d["running"] == 0 and d["waiting"] == 0 for d in st["devices"]):
                return st
            if time.monotonic() > deadline:
                raise AssertionError(f"node not idle after {timeout_s}s: {st}")
            time.sleep(0.05)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def up(*nodes: NodeProcess) -> list[NodeProcess]:
    """Wait for nodes launched together with ``wait=False``; if one fails to start, close them all."""
    try:
        return [n.wait_up() for n in nodes]
    except BaseException:
        for n in nodes:
            n.close()
        raise


def raw_stream(port: int, body: bytes) -> socket.socket:
    """POST ``body`` (JSON bytes) to /v1/completions on a bare socket, the reply left unread: a client
    that can vanish at any moment (close the socket)."""
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return s


def post_concurrently(node: "NodeProcess", path: str, bodies: list[dict], workers: int) -> list[httpx.Response]:
    """POST each of ``bodies`` to ``path`` from ``workers`` threads, each with its own ``httpx.Client``,
    answers in order. One sync client shared by tens of threads has failed a read with EBADF on a loaded
    2-core CI machine (a pooled socket closed under another thread's read): a client per thread, as a
    load generator's workers have, keeps that out of the node's tests."""
    local = threading.local()
    clients: list[httpx.Client] = []
    lock = threading.Lock()

    def post(body: dict) -> httpx.Response:
        client = getattr(local, "client", None)
        if client is None:
            # verify=False: plain HTTP on loopback; a client that loads the CA bundle takes ~35 ms of the
            # GIL, and 32 of them delayed a load by over a second (test_migration's filler outran it)
            client = local.client = httpx.Client(base_url=node.url, timeout=120, verify=False)
            with lock:
                clients.append(client)
        return client.post(path, json=body)

    try:
        with cf.ThreadPoolExecutor(workers) as pool:
            return list(pool.map(post, bodies))
    finally:
        for client in clients:
            client.close()


def half_closed_post(port: int, body: dict, path: str = "/v1/completions",
                     headers: str = "") -> tuple[bytes, bytes, bytes]:
    """POST ``body`` on a bare HTTP/1.1 socket, shut its write side (TCP half-close, as ``nc -N`` does) and
    read until the node closes: (the interim 1xx responses, the final head, the body de-chunked if chunked).
    ``headers``: extra header lines, each ending in CRLF."""
    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{headers}"
                  f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        s.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    interim = b""
    while out.startswith(b"HTTP/1.1 1"):
        block, _, out = out.partition(b"\r\n\r\n")
        interim += block + b"\r\n\r\n"
    head, _, payload = out.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in head.lower():
        payload = dechunk(payload)
    return interim, head, payload


def dechunk(body: bytes) -> bytes:
    """An HTTP/1.1 chunked body's bytes; asserts the framing, down to the closing empty chunk."""
    out = b""
    while True:
        size, _, rest = body.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            assert rest == b"\r\n", rest
            return out
        assert rest[n : n + 2] == b"\r\n"
        out, body = out + rest[:n], rest[n + 2 :]


def sse_events(lines) -> list:
    """Parse SSE ``data:`` lines into JSON objects; ``"[DONE]"`` stays a string. Asserts the shape."""
    events = []
    for line in lines:
        if not line or line.startswith(":"):
            continue
        assert line.startswith("data: "), line
        payload = line[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    assert events and events[-1] == "[DONE]", f"stream did not end with [DONE]: {events[-3:]}"
    assert events.count("[DONE]") == 1
    return events


def stream(client: httpx.Client, path: str, body: dict) -> list:
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        return sse_events(list(r.iter_lines()))


def stream_text(events: list) -> dict[int, str]:
    """Concatenated text per choice index of a completions or chat stream."""
    out: dict[int, str] = {}
    for e in events:
        if e == "[DONE]":
            continue
        for c in e.get("choices", []):
            t = c.get("text")
            if t is None:
                t = c.get("delta", {}).get("content") or ""
            out[c["index"]] = out.get(c["index"], "") + t
    return out


def require_nixl() -> None:
    """Skip the caller unless NIXL (``nixl-cu12``, the ``nixl`` and ``test`` extras) is importable; under
    CI (CI=true) fail instead, since scripts/setup installs it there."""
    from node.transport.nixl_agent import nixl_available

    if nixl_available():
        return
    import pytest

    why = "NIXL (nixl-cu12) is not installed: pip install -e '.[nixl]'"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(why + "; CI must run this test", pytrace=False)
    pytest.skip(why)


async def generate_moving(node, rid: str, prompt: list[int], params, at: tuple[int, ...] = (30, 90)):
    """Run one choice on an in-process two-device ``node`` (:class:`~node.runtime.node.Node`), moving its
    sequence to the other device (reason ``manual``) each time its output reaches a count in ``at``.

    Returns:
        ``(tokens, moves)``: the output token ids, and per move ``(record, num_computed)``: the
        :class:`~node.runtime.moves.MigrationRecord` (None if the move did not happen) and the sequence's
        computed tokens after it.
    """
    got: list[int] = []
    plan, moves = list(at), []
    async for req, d in node.generate(rid, prompt, params):
        got += d.token_ids
        if plan and len(got) >= plan[0]:
            plan.pop(0)
            seq = req.seqs[0]
            src = node.engine(seq.device_id)
            dst = next(e for e in node.engines if e is not src)
            moves.append((await src.migrate(seq, dst, "manual"), seq.num_computed))
    return got, moves
