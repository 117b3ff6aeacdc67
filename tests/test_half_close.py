"""Issue 32 item 6: an HTTP half-close is not a disconnect. A client that shuts its write side once its
request is sent still gets the whole answer, probed meanwhile with interim ``100 Continue`` responses and
SSE comments that its HTTP client skips; a client that fully closed is noticed by those probes (its
kernel answers one with a RST, the next write fails) and its request is aborted within about a probe
period, queued or not, streamed or not (node/api/serving.py)."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time

import aiohttp
import openai
import pytest

from support import NodeProcess, half_closed_post, raw_stream, reference_cases, sse_events

K = 40  # tokens per answer: the greedy reference's first K


def _reference() -> tuple[dict, list[int]]:
    case = reference_cases()[0]
    body = {"prompt": case["prompt"], "max_tokens": K, "temperature": 0, "return_token_ids": True}
    return body, case["output_token_ids"][:K]


def _stream_ids(events: list) -> list[int]:
    return [t for e in events[:-1] for c in e["choices"] for t in c["token_ids"]]


@pytest.mark.quick
def test_a_half_closed_client_gets_the_whole_answer(stories_node):
    body, ref = _reference()
    interim, head, payload = half_closed_post(stories_node.port, body)
    assert interim.startswith(b"HTTP/1.1 100 Continue\r\n\r\n") and head.startswith(b"HTTP/1.1 200 "), (interim, head)
    assert json.loads(payload)["choices"][0]["token_ids"] == ref
    # the connection closes after this answer, and the answer says so: a pooling client will not reuse it
    assert re.search(rb"(?i)(^|\r\n)connection: *close(\r\n|$)", head), head
    _, head, payload = half_closed_post(stories_node.port, {**body, "stream": True})
    assert head.startswith(b"HTTP/1.1 200 "), head
    assert _stream_ids(sse_events(payload.decode().split("\n"))) == ref


class HalfClosingProxy:
    """A TCP relay in front of a node that shuts the write side of its upstream connection once a request
    (its head and ``Content-Length`` body) has gone through, as some proxies do, then relays the answer
    and closes; ``relayed`` collects what the node sent."""

    def __init__(self, upstream: int):
        self.upstream = upstream
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.relayed: list[bytes] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._relay, args=(client,), daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        with client, socket.create_connection(("127.0.0.1", self.upstream)) as node:
            buf = b""
            while b"\r\n\r\n" not in buf:
                buf += client.recv(65536)
            head = buf.partition(b"\r\n\r\n")[0]
            length = re.search(rb"(?i)content-length: *(\d+)", head)
            while len(buf) < len(head) + 4 + (int(length.group(1)) if length else 0):
                buf += client.recv(65536)
            node.sendall(buf)
            node.shutdown(socket.SHUT_WR)
            while chunk := node.recv(65536):
                self.relayed.append(chunk)
                client.sendall(chunk)

    def close(self) -> None:
        self.server.close()


@pytest.mark.quick
def test_clients_behind_a_half_closing_proxy_skip_the_probes(stories_node):
    """The openai client (httpx) and aiohttp's client, whole answers and streams, through a proxy that
    half-closes: the interim responses are skipped and the answers equal the greedy reference."""
    body, ref = _reference()
    model = stories_node.client.get("/v1/models").json()["data"][0]["id"]
    proxy = HalfClosingProxy(stories_node.port)
    url = f"http://127.0.0.1:{proxy.port}/v1"
    try:
        args = dict(model=model, prompt=body["prompt"], max_tokens=K, temperature=0,
                    extra_body={"return_token_ids": True})
        with openai.OpenAI(base_url=url, api_key="unused", max_retries=0) as client:
            assert client.completions.create(**args).choices[0].model_extra["token_ids"] == ref
            chunks = client.completions.create(**args, stream=True)
            assert [t for c in chunks for ch in c.choices for t in ch.model_extra["token_ids"]] == ref

        async def with_aiohttp() -> tuple[list[int], list[int]]:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:  # one request each
                async with s.post(url + "/completions", json=body) as r:
                    whole = (await r.json())["choices"][0]["token_ids"]
                async with s.post(url + "/completions", json={**body, "stream": True}) as r:
                    lines = [line.decode().rstrip("\r\n") async for line in r.content]
            return whole, _stream_ids(sse_events(lines))

        assert asyncio.run(with_aiohttp()) == (ref, ref)
        assert b"".join(proxy.relayed).count(b"HTTP/1.1 100 Continue\r\n\r\n") >= 2  # the probes went through
    finally:
        proxy.close()


def _wait(node: NodeProcess, live: int, within_s: float) -> float:
    """Seconds until the node has ``live`` requests; fails past ``within_s``."""
    t0 = time.monotonic()
    while (n := node.status()["live_requests"]) != live:
        assert time.monotonic() - t0 < within_s, f"{n} live requests, not {live}, after {within_s} s"
        time.sleep(0.02)
    return time.monotonic() - t0


def test_clients_that_left_are_noticed_and_their_requests_aborted():
    """One request runs at a time (each step sleeps 20 ms: 400 tokens take 8 s): A, a stream whose client
    half-closes and reads on. Two clients whose requests queue behind it, a stream (its headers read) and
    a whole answer, close their sockets: a FIN as from A. The probes find them gone and end both within
    about a probe period, while A goes on, its SSE comment probes among its events; then a running
    non-streamed request's client leaves and it ends as fast."""
    node = NodeProcess("--benchmark-model", "sleep:20", "--max-num-seqs", "1")
    try:
        long = {"prompt": "Once", "max_tokens": 400, "ignore_eos": True}
        a = raw_stream(node.port, json.dumps({**long, "stream": True}).encode())
        a.shutdown(socket.SHUT_WR)
        a.settimeout(30)
        seen = b""
        while b"data: {" not in seen:  # A runs
            seen += a.recv(65536)
        queued = [raw_stream(node.port, json.dumps(b).encode()) for b in ({**long, "stream": True}, long)]
        queued[0].settimeout(30)
        got = b""
        while b"\r\n\r\n" not in got:  # the stream's head is read: its close is a FIN, not a RST for unread data
            got += queued[0].recv(65536)
        _wait(node, 3, 10)
        for s in queued:
            s.close()
        _wait(node, 1, 3)
        assert node.status()["devices"][0]["running"] == 1  # A goes on
        while b"\r\n4\r\n: \n\n\r\n" not in seen:  # a probe of A: an SSE comment in its own chunk
            seen += a.recv(65536)
        a.close()
        _wait(node, 0, 10)
        s = raw_stream(node.port, json.dumps(long).encode())
        _wait(node, 1, 10)
        s.close()
        _wait(node, 0, 3)
        assert node.wait_idle(5)["devices"][0]["kv_blocks_used"] == 0
    finally:
        node.close()


def test_a_client_that_closes_mid_prefill_is_noticed_within_milliseconds():
    """Issue 45 item 9: a client that sends a request and closes (a FIN; it never half-closed) while its
    prompt is prefilled (each step sleeps 200 ms) is noticed about a round trip later, by the second
    probe, not a probe period later: its request is aborted in that step, and no token is generated
    and counted for it."""
    node = NodeProcess("--benchmark-model", "sleep:200", "--max-num-seqs", "1")
    try:
        def generated() -> float:
            m = re.search(r"^shiftnode_generation_tokens_total (\S+)$", node.client.get("/metrics").text, re.M)
            return float(m.group(1))

        before = generated()
        s = raw_stream(node.port, json.dumps({"prompt": "Once upon a time", "max_tokens": 50}).encode())
        _wait(node, 1, 10)  # admitted: its prefill step runs (200 ms)
        closed = time.monotonic()
        s.close()
        while node.status()["live_requests"]:
            time.sleep(0.002)
        noticed = time.monotonic() - closed
        assert noticed < 0.15, noticed  # the probes' period is 0.25 s
        time.sleep(0.5)  # the prefill step's token, had it been the client's, would have been counted by now
        assert generated() == before
        assert node.wait_idle(5)["devices"][0]["kv_blocks_used"] == 0
    finally:
        node.close()
