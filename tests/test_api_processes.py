"""``--api-processes 2``: two HTTP front ends on one port in front of the control process give the
single-process node's answers, free a gone client's KV, merge their metrics, and end streams with an
error when the engine dies. One node serves every check (the engine kill last)."""

import contextlib
import json
import os
import re
import signal
import socket
import time

import httpx
import pytest

from support import STORIES, NodeProcess, half_closed_post, reference_cases, require_shared, sse_events, stream

KEY = "api-processes-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def launched():
    """The front-end node, launched (not yet waited for: the single-process node starts meanwhile)."""
    require_shared()
    # one restart: the engine's first death is survived, its second leaves the device down
    node = NodeProcess("--model", str(STORIES), "--api-processes", "2", "--api-key", KEY, "--engine-restart-max", "1",
                       "--api-heartbeat-timeout-s", "2", "--sse-buffer-bytes", "16384", "--sse-stall-s", "2",
                       wait=False)
    yield node
    node.close()


@pytest.fixture
def fe(launched):
    launched.wait_up()
    launched.client.headers.update(AUTH)
    return launched


def _strip(body):
    """A response without what differs between two nodes: ids, timestamps, prefix-cache hits."""
    if isinstance(body, dict):
        return {k: _strip(v) for k, v in body.items() if k not in ("id", "created", "prompt_tokens_details")}
    if isinstance(body, list):
        return [_strip(x) for x in body]
    return body


def test_outputs_equal_the_single_process_nodes(launched, stories_node):
    fe = launched.wait_up()
    fe.client.headers.update(AUTH)
    for case in reference_cases():  # greedy references (their first 64 tokens), whole and streamed
        k = min(case["max_new_tokens"], 64)
        body = {"prompt": case["prompt"], "max_tokens": k, "temperature": 0, "return_token_ids": True}
        r = fe.client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert (choice["token_ids"], choice["finish_reason"]) == (case["output_token_ids"][:k], "length")
        assert case["output_text"].startswith(choice["text"]) and len(choice["text"]) > 100
        events = stream(fe.client, "/v1/completions", body)
        assert [t for e in events[:-1] for t in e["choices"][0]["token_ids"]] == case["output_token_ids"][:k]
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == choice["text"]
    prompt = reference_cases()[1]["prompt"]
    bodies = [  # each against the one-process node, whole and streamed, every event compared
        ("/v1/completions", {"prompt": prompt, "max_tokens": 40, "temperature": 0, "stop": [" park"], "logprobs": 2,
                             "echo": True, "return_token_ids": True}),
        ("/v1/completions", {"prompt": [prompt, "The little dog"], "max_tokens": 12, "temperature": 0, "n": 2,
                             "stop": ["dog", "."], "stream_options": {"include_usage": True}}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}], "max_tokens": 24, "temperature": 0,
                                  "n": 2, "logprobs": True, "top_logprobs": 2, "stop": ["\n"]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell a story"}], "max_tokens": 30,
                                  "temperature": 0.9, "seed": 7, "min_tokens": 3, "stop": ["."]}),
    ]
    ends = []
    for path, body in bodies:
        whole = {k: v for k, v in body.items() if k != "stream_options"}  # a 400 without stream (as OpenAI)
        mine, ref = fe.client.post(path, json=whole), stories_node.client.post(path, json=whole)
        assert mine.status_code == ref.status_code == 200, (mine.text, ref.text)
        assert _strip(mine.json()) == _strip(ref.json()), path
        assert _strip(stream(fe.client, path, body)) == _strip(stream(stories_node.client, path, body)), path
        ends += [c["finish_reason"] for c in mine.json()["choices"]]
    assert ends.count("stop") >= 3 and "length" in ends, ends  # stop strings ended choices (the front end's ends)
    fe.wait_idle()  # the stop-string ends (the front end's) freed their KV in the control process
    ids = set()
    for _ in range(40):  # new connections: the kernel spreads them over both front ends (ids name the front end)
        r = httpx.post(fe.url + "/v1/completions", json={"prompt": "Once", "max_tokens": 1}, headers=AUTH)
        ids.add(re.match(r"cmpl-(a\d+)-", r.json()["id"]).group(1))
        if len(ids) == 2:
            break
    assert ids == {"a0", "a1"}
    assert len(fe.status()["api_processes"]) == 2


def test_a_structured_request_through_a_front_end_is_prepared_off_the_step(fe, stories_node):
    """The front end compiles its own copy of the grammar (the 400 checks); the control process holds the
    sequence until the engine has it compiled (:mod:`node.runtime.grammar_gate`), so no step compiles it
    (before, every new schema through a front end was compiled inside a step of the engine)."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["name", "age"]}
    body = {"prompt": "Once upon a time", "max_tokens": 60, "temperature": 0, "return_token_ids": True,
            "response_format": {"type": "json_schema", "json_schema": {"name": "fe", "schema": schema}}}
    mine, ref = fe.client.post("/v1/completions", json=body), stories_node.client.post("/v1/completions", json=body)
    assert mine.status_code == ref.status_code == 200, (mine.text, ref.text)
    assert mine.json()["choices"][0]["token_ids"] == ref.json()["choices"][0]["token_ids"]
    doc = json.loads(mine.json()["choices"][0]["text"])
    assert set(doc) == {"name", "age"}
    [device] = fe.status()["devices"]
    assert device["grammar_in_step"] == 0 and device["grammar_held"] >= 1, device


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_metrics_of_both_front_ends_are_merged_and_health_answers(fe):
    names = ("shiftnode_generation_tokens_total", "shiftnode_time_to_first_token_seconds_count",
             "shiftnode_inter_token_latency_seconds_count", "shiftnode_time_per_output_token_seconds_count",
             'shiftnode_requests_total{finish_reason="length"}', 'vllm:generation_tokens_total{model_name="stories260k"}')
    before = fe.client.get("/metrics").text
    for k in range(4):  # on new connections, so both front ends serve some
        body = {"prompt": "Once", "max_tokens": 7, "ignore_eos": True, "stream": k % 2 == 1}
        r = httpx.post(fe.url + "/v1/completions", json=body, headers=AUTH)
        assert r.status_code == 200
    want = [28, 4, 24, 4, 4, 28]
    deadline = time.monotonic() + 5
    while True:  # a stream's last report may trail its [DONE] by a moment
        after = fe.client.get("/metrics").text
        got = [_metric(after, n) - _metric(before, n) for n in names]
        if got == want or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert got == want, dict(zip(names, got))
    assert fe.client.get("/v1/node").json()["latency"]["itl"]["count"] == _metric(after, names[2])
    code, body = fe.health()
    assert code == 200 and body["status"] == "ok"


def test_auth_validation_and_unknown_routes_answer_as_one_process_does(fe):
    for path in ("/v1/completions", "/v1/node"):  # handled here / forwarded to the control process
        r = httpx.post(fe.url + path, json={"prompt": "x"}) if path.endswith("s") else httpx.get(fe.url + path)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
    r = fe.client.post("/v1/completions", json={"prompt": "x", "temperature": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", r.text
    r = fe.client.post("/v1/chat/completions", content=b"{", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = fe.client.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    assert fe.client.get("/v1/models").json()["data"][0]["id"] == "stories260k"


def test_a_client_leaving_mid_stream_frees_its_kv(fe):
    body = b'{"prompt": "Once", "max_tokens": 400, "ignore_eos": true, "stream": true}'
    s = socket.create_connection(("127.0.0.1", fe.port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    got = b""
    while got.count(b"data: ") < 3:
        got += s.recv(65536)
    assert fe.status()["devices"][0]["kv_blocks_used"] > 0  # it runs
    s.close()
    st = fe.wait_idle()
    assert st["live_requests"] == 0


def test_a_client_that_never_reads_is_aborted_by_its_front_end_and_counted(fe):
    """Backpressure in a front end (node/api/sse.py; tests/test_backpressure.py for one process): a client
    that never reads is aborted as stalled, its KV freed in the control process, and the front end's
    count reaches the node's /metrics."""
    before = _metric(fe.client.get("/metrics").text, "shiftnode_stalled_clients_total")
    body = json.dumps({"prompt": "Once", "n": 64, "logprobs": 20, "max_tokens": 500, "ignore_eos": True,
                       "stream": True}).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", fe.port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    try:
        deadline = time.monotonic() + 60
        while True:
            st = fe.status()
            stalled = _metric(fe.client.get("/metrics").text, "shiftnode_stalled_clients_total") - before
            if stalled == 1 and st["live_requests"] == 0 and st["devices"][0]["kv_blocks_used"] == 0:
                break
            assert time.monotonic() < deadline, (stalled, st["live_requests"])
            time.sleep(0.1)
    finally:
        s.close()


def test_a_half_closed_client_gets_the_whole_answer(fe):
    """A client that shuts its write side after the request is answered in full by a front end, whole or
    streamed, as by one process (tests/test_half_close.py; the front ends serve with serving.NodeRunner)."""
    case = reference_cases()[0]
    body = {"prompt": case["prompt"], "max_tokens": 40, "temperature": 0, "return_token_ids": True}
    interim, head, payload = half_closed_post(fe.port, body, headers=f"Authorization: Bearer {KEY}\r\n")
    assert interim.startswith(b"HTTP/1.1 100 Continue") and head.startswith(b"HTTP/1.1 200 "), (interim, head)
    assert json.loads(payload)["choices"][0]["token_ids"] == case["output_token_ids"][:40]
    _, head, payload = half_closed_post(fe.port, {**body, "stream": True}, headers=f"Authorization: Bearer {KEY}\r\n")
    events = sse_events(payload.decode().split("\n"))
    assert [t for e in events[:-1] for t in e["choices"][0]["token_ids"]] == case["output_token_ids"][:40]
    assert fe.wait_idle()["live_requests"] == 0


def test_a_killed_front_end_is_reaped_reported_and_started_again(fe):
    """kill -9 of one front end: it is reaped (no zombie), dropped from /v1/node's list, /health says the
    node is degraded and why, and a new front end is started that serves beside the other."""
    deadline = time.monotonic() + 30
    while len(pids := fe.status()["api_processes"]) < 2:  # both listen (the node answers once one does)
        assert time.monotonic() < deadline, pids
        time.sleep(0.05)
    os.kill(pids[0], signal.SIGKILL)
    deadline = time.monotonic() + 30
    seen = []
    while time.monotonic() < deadline:
        try:  # a connection the kernel handed to the killed front end's listener (SO_REUSEPORT) is reset
            code, body = fe.health()
            seen.append(body)
            listed = fe.status()["api_processes"]
        except httpx.TransportError:
            time.sleep(0.05)
            continue
        if body == {"status": "ok"} and len(listed) == 2 and pids[0] not in listed:
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"no new front end within 30 s: {seen[-3:]}")
    said = [r for b in seen for r in b.get("reasons", [])]
    assert any(re.match(rf"API front end [01] down: pid {pids[0]} exited", r) for r in said), seen[:5]
    assert not os.path.exists(f"/proc/{pids[0]}")  # reaped
    for _ in range(4):  # both listeners answer (connections are spread over them)
        r = fe.client.post("/v1/completions", json={"prompt": "Once", "max_tokens": 4}, headers={"Connection": "close"})
        assert r.status_code == 200, r.text


def test_a_hung_front_end_is_found_by_the_heartbeat_and_replaced(fe):
    """SIGSTOP of one front end (its process hangs; its socket stays open, so nothing exits): the
    control process's heartbeat finds it within --api-heartbeat-timeout-s, kills it and starts
    another; /health says it hung meanwhile."""
    deadline = time.monotonic() + 30
    while len(pids := fe.status()["api_processes"]) < 2:
        assert time.monotonic() < deadline, pids
        time.sleep(0.05)
    os.kill(pids[1], signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 90  # found in about 2 s; a spawned front end loads in seconds (30 s on a busy CPU)
        seen = []
        while time.monotonic() < deadline:
            try:  # a connection the kernel gives the stopped front end waits, then is reset when it is killed
                body = httpx.get(fe.url + "/health", timeout=0.5).json()
                listed = httpx.get(fe.url + "/v1/node", timeout=0.5, headers=AUTH).json()["api_processes"]
            except httpx.HTTPError:
                continue
            seen.append(body)
            if body == {"status": "ok"} and len(listed) == 2 and pids[1] not in listed:
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"the stopped front end was not replaced within 90 s: {seen[-3:]}")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pids[1], signal.SIGCONT)
    said = [r for b in seen for r in b.get("reasons", [])]
    assert any(re.match(rf"API front end [01] down: pid {pids[1]} hung \(no heartbeat", r) for r in said), seen[:5]
    assert not os.path.exists(f"/proc/{pids[1]}")  # killed and reaped
    for _ in range(4):
        r = fe.client.post("/v1/completions", json={"prompt": "Once", "max_tokens": 4}, headers={"Connection": "close"})
        assert r.status_code == 200, r.text


def test_an_engine_killed_mid_stream_is_restarted_then_left_down(fe):
    """Last: the node has no device afterwards. The first kill is survived (restart, the stream goes on,
    exact); the second ends the stream with an error event, and the node answers 503."""
    case = reference_cases()[0]
    pid = fe.status()["devices"][0]["engine"]["pid"]
    lines = []
    with fe.client.stream("POST", "/v1/completions", json={"prompt": case["prompt"], "max_tokens": 48, "stream": True,
                                                             "temperature": 0, "return_token_ids": True}) as r:
        for line in r.iter_lines():
            lines.append(line)
            if line.startswith("data: ") and sum(x.startswith("data: ") for x in lines) == 5:  # once (not again
                os.kill(pid, signal.SIGKILL)  # on the blank line after it: the engine may be reaped by then)
    events = sse_events(lines)
    assert not any("error" in e for e in events[:-1]), events[-3:]
    assert [t for e in events[:-1] for t in e["choices"][0]["token_ids"]] == case["output_token_ids"][:48]
    restarted = fe.status()["devices"][0]["engine"]["pid"]
    assert restarted != pid
    pid = restarted
    lines = []
    with fe.client.stream("POST", "/v1/completions", json={"prompt": "Once", "max_tokens": 400, "stream": True,
                                                             "ignore_eos": True}) as r:
        for line in r.iter_lines():
            lines.append(line)
            if line.startswith("data: ") and sum(x.startswith("data: ") for x in lines) == 3:
                os.kill(pid, signal.SIGKILL)
    events = sse_events(lines)
    assert events[-2]["error"]["code"] == "engine_down", events[-3:]
    r = fe.client.post("/v1/completions", json={"prompt": "Once", "max_tokens": 4})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_down", r.text
    assert int(r.headers["Retry-After"]) >= 1
    assert fe.health()[0] == 503
    device = fe.status()["devices"][0]
    assert device["kv_blocks_used"] == 0 and fe.status()["live_requests"] == 0


@pytest.mark.quick
def test_frames_survive_any_split_and_a_plain_token_carries_three_values():
    import msgspec

    from node.api.link_protocol import Admitted, FrameReader, Step, frame
    from node.runtime.token_output import TokenDelta

    messages = [Step([TokenDelta(3, 0, [17]), TokenDelta(4, 1, [9], "length", 2)]), Admitted(7, "overloaded", "full"),
                Step([TokenDelta(5, 0, [], error="gone", error_status=503, retry_after_s=1.0)])]
    data = b"".join(frame(m) for m in messages)
    for size in (1, 5, len(data)):  # byte by byte, odd pieces, all at once
        reader, got = FrameReader(), []
        for i in range(0, len(data), size):
            got += reader.feed(data[i : i + size])
        assert got == messages
    assert msgspec.msgpack.decode(frame(Step([TokenDelta(3, 0, [17])]))[4:]) == ["Step", [{"k": 3, "i": 0, "t": [17]}]]


@pytest.mark.quick
def test_a_stop_string_inside_a_delta_cuts_it_and_ends_the_choice():
    from node.api.frontend_node import FrontRequest
    from node.core.sequence import SamplingParams
    from node.runtime.delta_stream import DeltaStream
    from node.runtime.token_output import TokenDelta
    from node.worker.tokenizer import TextTokenizer

    tok = TextTokenizer.byte_level()
    ids = tok.encode("ab STOP cd", add_special_tokens=False)
    stream = DeltaStream()
    r = FrontRequest(1, "r", [1, 2], SamplingParams(max_tokens=50, stop=("STOP",)), 1, stream, 0, [], tok, 512, 0.0)
    r.on_wire(TokenDelta(1, 0, ids[:2]))  # "ab": nothing held back
    r.on_wire(TokenDelta(1, 0, ids[2:]))  # " STOP cd" in one delta: cut at the stop string
    r.on_wire(TokenDelta(1, 0, [ids[0]]))  # a token the control loop made before the end reached it
    first, second = stream._items
    assert (first.text, first.token_ids, first.finish_reason) == ("ab", ids[:2], None)
    assert second.text == " " and second.finish_reason == "stop" and r.ended == [True]
    assert second.token_ids == ids[2 : 2 + len(tok.encode(" STOP", add_special_tokens=False))]


@pytest.mark.quick
def test_a_refused_admission_is_the_same_503_in_the_front_end():
    """The control process's refusal (queue full, draining, engines down) reaches the front end's handler
    as the same exception the one-process handler turns into a 503 with Retry-After."""
    import asyncio

    from node.api.frontend_link import FrontendLink
    from node.api.frontend_node import FrontNode
    from node.api.link_protocol import FrameReader, Job, Open
    from node.config import NodeConfig
    from node.core.sequence import SamplingParams
    from node.runtime.admission import KVCapacityExceeded, NodeDraining, QueueFullError
    from node.worker.loader import load_model_info

    class Refusing:  # the control process's node, refusing as Node.check_admission does
        def __init__(self, error):
            self.error = error

        def check_admission(self, new):
            raise self.error

    class Wire:  # a transport that keeps what is written
        def __init__(self):
            self.data = b""

        def is_closing(self):
            return False

        def write(self, data):
            self.data += data

    async def go(error):
        link = FrontendLink(Refusing(error), server=None)
        link.transport = Wire()
        link.handle(Open(3, [Job(0, "r-p0", [1, 2], SamplingParams(max_tokens=4), 1, 0)]))
        link.flush()
        (answer,) = FrameReader().feed(link.transport.data)
        front = FrontNode(NodeConfig(), load_model_info(NodeConfig()), 0, lambda data: None)
        job = type("J", (), {"prompt_ids": [1, 2], "params": SamplingParams(max_tokens=4), "index0": 0})
        opening = asyncio.ensure_future(front.open_requests("r", [job], 1, None))
        await asyncio.sleep(0)
        answer.ticket = 0  # the front end's first ticket
        front.on_admitted(answer)
        try:
            await opening
        except QueueFullError as e:
            return answer, e, front.requests
        raise AssertionError("admitted")

    answer, e, left = asyncio.run(go(QueueFullError("5 sequences are queued (limit 4)")))
    assert (answer.refusal, answer.message) == ("overloaded", "5 sequences are queued (limit 4)")
    assert type(e) is QueueFullError and str(e) == answer.message and left == {}
    answer, e, _ = asyncio.run(go(NodeDraining("draining")))
    assert answer.refusal == "draining" and type(e) is NodeDraining
    answer, e, _ = asyncio.run(go(KVCapacityExceeded("needs 40 KV blocks")))  # the handler's 400, not a 503
    assert answer.refusal == "kv_capacity" and type(e) is KVCapacityExceeded


@pytest.mark.quick
def test_the_default_count_and_the_accepted_range():
    from node.api.flags import default_api_processes
    from node.config import ConfigError, NodeConfig

    assert [default_api_processes(c) for c in (None, 1, 2, 4, 7, 8, 12, 16, 64)] == [1, 1, 1, 1, 1, 2, 3, 4, 4]
    for bad in (0, 65):
        with pytest.raises(ConfigError, match="--api-processes"):
            NodeConfig(api_processes=bad).validate()
    NodeConfig(api_processes=2).validate()
