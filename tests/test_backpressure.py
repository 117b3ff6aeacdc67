"""Backpressure on streams (node/api/sse.py, issue 45 item 7): a client that keeps its connection open but
never reads is stalled, its KV freed and counted, and its stream ends with an error event it reads if it reads
again; a client that reads slowly gets every token.
The caps are shrunk by flags so that the checks take seconds."""

import json
import re
import socket
import threading
import time

import httpx
import pytest

from support import STORIES, NodeProcess, dechunk, require_shared, sse_events

pytestmark = pytest.mark.slow_only("both tests need a node of their own, with a client that never reads or reads slowly")

STALL_S = 2.0


@pytest.fixture(scope="module")
def node():
    require_shared()
    n = NodeProcess("--model", str(STORIES), "--sse-buffer-bytes", "16384", "--sse-stall-bytes", str(64 << 20),
                    "--sse-stall-s", str(STALL_S), "--kv-cache-memory", str(64 << 20))
    yield n
    n.close()


def _stalled(node) -> float:
    m = re.search(r"^shiftnode_stalled_clients_total (\S+)$", node.client.get("/metrics").text, re.M)
    return float(m.group(1)) if m else 0.0


def _post(port: int, body: dict, rcvbuf: int | None = None) -> socket.socket:
    s = socket.socket()
    if rcvbuf:  # before connect: the window the client offers stays small
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect(("127.0.0.1", port))
    data = json.dumps(body).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def test_a_client_that_never_reads_is_aborted_and_its_kv_freed(node):
    before = _stalled(node)
    # n 64, logprobs 20: about 1 KB of events per token per choice; the model's context (512) bounds max_tokens
    body = {"prompt": "Once", "n": 64, "logprobs": 20, "max_tokens": 500, "ignore_eos": True, "stream": True}
    s = _post(node.port, body, rcvbuf=4096)
    try:
        t0 = time.monotonic()
        running = False
        while time.monotonic() - t0 < 60:
            st = node.status()
            used = sum(d["kv_blocks_used"] for d in st["devices"])
            running = running or used > 0
            if running and used == 0 and st["live_requests"] == 0 and _stalled(node) == before + 1:
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"the stalled client still holds its request after 60 s: {st}")
        # freed while the client still holds its socket open, unread
        assert "client_stalled" in node.logs()
        s.settimeout(10)
        got = b""
        # the client reads again (within CLOSE_GRACE_S): what was sent, then the stream's end (an error
        # event saying why, [DONE], the body's last chunk), then EOF: closed, not reset
        while chunk := s.recv(1 << 20):
            got += chunk
        head, _, payload = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        events = sse_events(dechunk(payload).decode().split("\n"))
        error = events[-2]["error"]
        assert error["code"] == "client_stalled" and "stream ended" in error["message"], error
        assert all("error" not in e for e in events[:-2]) and len(events) > 3  # tokens were sent before it
    finally:
        s.close()


def test_a_client_that_reads_slowly_gets_every_token(node):
    # about 1 KB per token per choice, 8 MB in all: more than the kernel's socket buffers take, less than
    # --sse-stall-bytes
    body = {"prompt": "Once", "n": 16, "logprobs": 20, "max_tokens": 500, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    whole = node.client.post("/v1/completions", json={**body, "stream": False}).json()
    before = _stalled(node)
    s = _post(node.port, body, rcvbuf=4096)
    s.settimeout(30)
    # about 16 KB/s while the node generates (slower than it makes them, whatever the machine's load:
    # congested, its deltas held and joined; a read every 0.25 s is progress, so it is never stalled),
    # then everything at once. The slow reads run in a thread of their own, so a status poll that a loaded
    # machine makes slow never stretches the gap between two reads past the stall limit.
    generating = threading.Event()
    generating.set()
    slow: list[bytes] = []

    def read_slowly():
        while generating.is_set() or not slow:
            slow.append(s.recv(4096))
            time.sleep(0.25)

    reader = threading.Thread(target=read_slowly, daemon=True)
    reader.start()
    while (d := node.status()["devices"][0])["running"] or d["waiting"] or not slow:
        time.sleep(0.25)
    generating.clear()
    reader.join(60)
    assert not reader.is_alive()
    got = b"".join(slow)
    while not got.endswith(b"0\r\n\r\n"):
        chunk = s.recv(1 << 20)
        assert chunk, got[-200:]
        got += chunk
    s.close()

    head, _, rest = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    events = sse_events(dechunk(rest).decode().split("\n"))
    tokens: dict[int, list[int]] = {}
    text: dict[int, str] = {}
    for e in events[:-1]:
        for c in e["choices"]:
            tokens.setdefault(c["index"], []).extend(c["token_ids"])
            text[c["index"]] = text.get(c["index"], "") + c["text"]
    want = {c["index"]: c["token_ids"] for c in whole["choices"]}
    assert tokens == want
    assert text == {c["index"]: c["text"] for c in whole["choices"]}
    assert len(events) - 1 < 16 * 500  # fewer events than tokens: held deltas went out joined
    assert _stalled(node) == before
    assert node.wait_idle()["live_requests"] == 0
