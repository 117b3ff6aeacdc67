"""Engine failures are contained, and requests have a deadline (issue: every fault is explicit).

A failure in any part of a step (the model, post-processing of one sequence, a listener, a role
switch's reconfiguration) fails only the requests it touched, with a clear error; it is logged and
counted; the device goes on serving with exact outputs and every block freed. A step loop that ends
anyway marks its device down. ``--request-timeout-s`` ends a request with an error and frees its KV.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from node.config import NodeConfig
from node.core.sequence import SamplingParams
from node.runtime.health import STALLED_STEP_S, node_health
from node.runtime.node import Node
from node.runtime.output import OutputState
from support import STORIES, NodeProcess, reference_cases

CASE = reference_cases()[0]
PARAMS = SamplingParams(max_tokens=40, temperature=0.0)


async def collect(node: Node, rid: str, params: SamplingParams = PARAMS) -> tuple[list[int], list]:
    ids, errors = [], []
    async for _, d in node.generate(rid, CASE["prompt_token_ids"], params):
        ids += d.token_ids
        if d.error:
            errors.append(d)
    return ids, errors


async def idle(node: Node, timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if all(e.batcher.ledger.num_used == 0 and not e.batcher.running and not e.batcher.waiting for e in node.engines):
            return
        await asyncio.sleep(0.02)
    raise AssertionError([(e.device_id, e.batcher.ledger.num_used) for e in node.engines])


def with_node(body, **config):
    async def go():
        node = await Node.create(NodeConfig(model=str(STORIES), **config))
        node.start()
        try:
            await body(node)
        finally:
            await node.close()
    asyncio.run(go())


def test_a_postprocess_failure_fails_only_its_request():
    expected = CASE["output_token_ids"][:40]

    async def body(node: Node):
        real = OutputState.on_token

        def flaky(self, token_id, logprobs, position=None):
            if self.seq.request_id == "bad" and position - self.seq.prompt_len + 1 == 5:  # the 5th output token
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
            return real(self, token_id, logprobs, position)

        OutputState.on_token = flaky
        try:
            (good_ids, good_err), (bad_ids, bad_err) = await asyncio.gather(collect(node, "good"), collect(node, "bad"))
        finally:
            OutputState.on_token = real
        assert good_err == [] and good_ids == expected
        assert len(bad_err) == 1 and "postprocess" in bad_err[0].error and "UnicodeDecodeError" in bad_err[0].error
        assert len(bad_ids) == 4  # the tokens before the failure were streamed
        assert node.engines[0].errors == {"postprocess": 1}
        await idle(node)
        assert (await collect(node, "after"))[0] == expected  # the device goes on
        assert b'shiftnode_engine_errors_total{device="cpu:0",stage="postprocess"} 1.0' in node.metrics.render()

    with_node(body)


def test_a_model_failure_and_a_raising_listener_are_contained():
    expected = CASE["output_token_ids"][:40]

    async def body(node: Node):
        engine = node.engines[0]
        real = engine.runner.async_submit
        calls = {"n": 0}

        def failing_once(step):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("injected device fault")
            return real(step)

        engine.runner.async_submit = failing_once
        ids, errors = await collect(node, "hit")
        assert len(errors) == 1 and "injected device fault" in errors[0].error
        await idle(node)

        def broken_listener(*_):
            raise ValueError("observer bug")

        engine.step_listeners.append(broken_listener)
        ids, errors = await collect(node, "listened")
        assert errors == [] and ids == expected
        assert engine.errors["step"] == 1 and engine.errors["listener"] >= 40
        await idle(node)
        engine.batcher.ledger.check()

    with_node(body)


def test_a_step_that_fails_before_it_is_sent_leaves_no_block_it_registered_findable():
    """Its prompt's full blocks were registered (pending) when the step was planned; nothing will ever
    write them, so they leave the prefix cache (issue 33, item 3): the same prompt is computed again,
    exactly."""
    case = reference_cases()[1]  # a 12-token prompt: three full blocks of 4
    prompt, expected = case["prompt_token_ids"], case["output_token_ids"][:20]
    params = SamplingParams(max_tokens=20, temperature=0.0)

    async def run(node: Node, rid: str) -> tuple[list[int], list]:
        ids, errors = [], []
        async for _, d in node.generate(rid, prompt, params):
            ids += d.token_ids
            errors += [d] if d.error else []
        return ids, errors

    async def body(node: Node):
        engine = node.engines[0]
        real = engine._encoder.encode

        def failing_for_bad(plan, held):
            if any(it.seq.request_id == "bad" for it in plan.items):
                raise RuntimeError("injected encoder fault")
            return real(plan, held)

        engine._encoder.encode = failing_for_bad
        ids, errors = await run(node, "bad")
        assert len(errors) == 1 and "injected encoder fault" in errors[0].error
        await idle(node)
        led = engine.batcher.ledger
        assert [b for b in range(led.num_blocks) if led.is_pending(b)] == [] and led.num_cached == 0
        led.check()
        assert await run(node, "again") == (expected, [])

    with_node(body, block_size=4)


def test_a_failed_reconfiguration_still_completes_the_switch():
    expected = CASE["output_token_ids"][:40]

    async def body(node: Node):
        engine = node.engines[0]

        def broken(to_role):
            raise RuntimeError("graph capture exploded")

        engine.roles.reconfigure = broken
        ids, errors = await collect(node, "switching")
        assert errors == [] and ids == expected
        assert engine.errors["reconfigure"] >= 1

    with_node(body, reconfig_pause_ms=1.0)


def test_an_engine_whose_loop_ends_is_reported_down_and_fails_its_requests():
    async def body(node: Node):
        engine = node.engines[0]
        queued = asyncio.Event()  # the request waits on the device: now its loop may end

        async def dies():
            await queued.wait()
            raise GeneratorExit("the loop is gone")  # not an Exception: escapes containment, as a real bug might

        engine._iteration = dies
        engine._task.cancel()
        await asyncio.sleep(0)
        engine._task = asyncio.get_running_loop().create_task(engine._loop())
        engine._task.add_done_callback(engine.revival.on_loop_done)
        task = asyncio.create_task(collect(node, "stranded"))
        async with asyncio.timeout(5):
            while not engine.batcher.waiting:
                await asyncio.sleep(0.001)
        queued.set()
        ids, errors = await asyncio.wait_for(task, 5)
        assert engine.failure and "GeneratorExit" in engine.failure
        assert len(errors) == 1 and errors[0].error_status == 503 and errors[0].error_code == "engine_down"
        assert node.status()["devices"][0]["failure"] == engine.failure
        assert b'shiftnode_engine_down{device="cpu:0"} 1.0' in node.metrics.render()

    with_node(body, mode="colocated")


def test_request_timeout_ends_the_request_and_frees_its_kv():
    async def body(node: Node):
        # All the context there is, at >= 3 ms a step (the sleep benchmark model: the real model's step
        # time depends on the machine): >= 1.5 s, past the 0.6 s timeout, which still leaves a loaded
        # machine time for the first tokens (the timeout must end a running stream).
        n = 512 - len(CASE["prompt_token_ids"])
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        ids, errors = await asyncio.wait_for(collect(node, "slow", params), 30)
        assert len(errors) == 1 and errors[0].error_code == "request_timeout" and errors[0].error_status == 503
        assert 0 < len(ids) < n
        await idle(node)
        assert node.status()["requests_timed_out"] == 1 and node.status()["live_requests"] == 0
        ok, errs = await collect(node, "quick", SamplingParams(max_tokens=5, temperature=0.0))
        assert errs == [] and len(ok) == 5

    with_node(body, request_timeout_s=0.6, benchmark_model="sleep:3")


def test_request_timeout_over_http_is_503_with_retry_after():
    node = NodeProcess("--model", str(STORIES), "--request-timeout-s", "0.2")
    try:
        r = node.client.post("/v1/completions", json={"prompt": "Once", "max_tokens": 450, "ignore_eos": True})
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "request_timeout" and "--request-timeout-s" in r.json()["error"]["message"]
        assert int(r.headers["Retry-After"]) >= 1
        assert node.status()["request_timeout_s"] == 0.2
        assert "shiftnode_request_timeout_seconds 0.2" in node.client.get("/metrics").text
        node.wait_idle()
        assert "shiftnode_request_timeouts_total 1.0" in node.client.get("/metrics").text
    finally:
        node.close()


@pytest.mark.quick
def test_the_default_request_deadline_is_finite_shown_and_0_means_none(stories_node):
    """Issue 32 item 4: with no flag every request has a 600 s deadline, read from /v1/node and the
    ``shiftnode_request_timeout_seconds`` gauge; ``--request-timeout-s 0`` removes it; negative is refused."""
    import argparse

    from node.cli import config_from_args, serve_parser
    from node.config import ConfigError

    assert stories_node.status()["request_timeout_s"] == 600
    assert "shiftnode_request_timeout_seconds 600.0" in stories_node.client.get("/metrics").text
    parser = argparse.ArgumentParser()
    serve_parser(parser.add_subparsers(dest="command"))
    parse = lambda *a: config_from_args(parser.parse_args(["serve", *a]))  # noqa: E731
    assert parse().request_timeout_s == 600 and parse("--request-timeout-s", "0").request_timeout_s is None
    parse("--request-timeout-s", "0").validate()
    with pytest.raises(ConfigError, match="--request-timeout-s must be positive"):
        parse("--request-timeout-s", "-1").validate()


def test_a_bug_after_a_streams_headers_ends_that_stream_with_an_error_event_and_done():
    """A failure in the API's own per-step code (here: accounting the 5th token of one request) once
    the 200 and some events are out ends that stream with an error event and [DONE] on a well-formed
    body; the other stream and the node go on, and the failed request's KV is freed."""
    import json

    import aiohttp
    from aiohttp.test_utils import TestServer

    from node.api.app import create_app

    real = Node.account
    seen = {"bad": 0}

    def flaky(self, req, delta, now):
        if req.params.seed == 7:  # only the "bad" request sets this seed
            seen["bad"] += 1
            if seen["bad"] == 5:
                raise RuntimeError("injected")
        return real(self, req, delta, now)

    async def stream(server: TestServer, seed: int) -> list[str]:
        req = {"prompt": CASE["prompt"], "max_tokens": 40, "temperature": 0.0, "seed": seed, "stream": True}
        timeout = aiohttp.ClientTimeout(total=30)  # before the fix the failed stream never ended
        async with aiohttp.ClientSession(timeout=timeout) as s, s.post(server.make_url("/v1/completions"), json=req) as r:
            assert r.status == 200
            text = (await r.read()).decode()  # aiohttp's parser: a malformed chunked body raises
        return [e for e in text.split("\n\n") if e]

    async def go():
        node = await Node.create(NodeConfig(model=str(STORIES)))
        server = TestServer(create_app(node.config, node=node))  # the app starts the node and closes it
        await server.start_server()
        Node.account = flaky
        try:
            bad, good = await asyncio.gather(stream(server, 7), stream(server, 1))
            Node.account = real
            await idle(node)
            again = await stream(server, 7)
        finally:
            Node.account = real
            await server.close()
        return bad, good, again

    bad, good, again = asyncio.run(go())
    assert bad[-1] == "data: [DONE]"
    err = json.loads(bad[-2][len("data: "):])
    assert err["error"]["code"] == "internal_error" and "RuntimeError" in err["error"]["message"]
    assert len(bad) - 2 == 4  # the four tokens before the failure
    assert good[-1] == "data: [DONE]" and len(good) == 41
    assert len(again) == 41  # the node goes on


def test_starting_a_node_twice_runs_one_step_loop_per_device():
    """A second start() (e.g. create_app given a node already started) must not add a second step
    loop: with two, every token came out twice."""
    expected = CASE["output_token_ids"][:40]

    async def body(node: Node):
        node.start()  # with_node started it already
        ids, errors = await collect(node, "twice")
        assert errors == [] and ids == expected

    with_node(body)


def test_a_step_that_never_returns_is_reported_stalled():
    """The engine's ``step_started_s`` is None when idle and the send time of the oldest step in flight
    otherwise; a step that never comes back (an engine looping inside a kernel) makes /health name the
    device stalled once STALLED_STEP_S have passed, and unavailable when it is the only device."""

    async def body(node: Node):
        engine = node.engines[0]
        ids, errors = await collect(node, "before")
        assert ids == CASE["output_token_ids"][:40] and not errors
        await idle(node)
        assert engine.step_started_s is None and node_health(node).status == "ok"
        real = engine.runner.async_submit
        calls = {"n": 0}

        def wedge(step):
            calls["n"] += 1
            return real(step) if calls["n"] < 3 else asyncio.get_running_loop().create_future()  # never answered

        engine.runner.async_submit = wedge
        task = asyncio.create_task(collect(node, "wedged"))
        for _ in range(1000):  # the third step is sent and, overlapped, the fourth
            if calls["n"] >= 4:
                break
            await asyncio.sleep(0.01)
        assert calls["n"] >= 4
        started = engine.step_started_s
        assert started is not None and started <= time.monotonic()
        assert node_health(node, started + 1.0).status == "ok"
        h = node_health(node, started + STALLED_STEP_S + 1.0)
        assert h.status == "unavailable" and h.http_status == 503
        assert h.reasons == ["every engine is down or stalled",
                             f"engine {engine.device_id} stalled: a step has run for {STALLED_STEP_S + 1.0:.0f} s"]
        task.cancel()

    with_node(body)


def test_a_device_dying_with_two_steps_in_flight_ends_every_wait_on_it_with_an_error():
    """Issue 33 item 4: the engine dies while two steps are in flight. A role switch waiting for them,
    a hand-off's detach queued behind them and the request end with errors within a bound (they waited
    for ever: ``_idle`` was never set, detaches never resolved); a sequence adopted afterwards (a
    peer's) fails at once instead of waiting on a device that will never step."""
    from node.core.roles import Role
    from node.runtime.request import RequestState
    from node.runtime.switching import SwitchAbandoned
    from node.worker.engine_messages import EngineDied

    async def body(node: Node):
        e = node.engines[0]
        held: list[asyncio.Future] = []

        def submit(msg):  # steps are taken and never answered, until the engine "dies"
            held.append(asyncio.get_running_loop().create_future())
            return held[-1]

        e.runner.async_submit = submit
        run = asyncio.create_task(collect(node, "r", SamplingParams(max_tokens=8, temperature=0.0)))
        for _ in range(500):
            if len(held) >= 2:
                break
            await asyncio.sleep(0.01)
        assert len(held) == 2 and len(e._inflight) == 2  # chunked prefill: the next chunk goes before the first returns
        seq = node.live["r"].seqs[0]
        detach = e.detach(seq)
        to = Role.DECODE if e.role.role is not Role.DECODE else Role.PREFILL
        switch = asyncio.create_task(e.switch_role(to, "test"))
        await asyncio.sleep(0.05)
        assert not switch.done() and not detach.done()  # both wait for the steps in flight
        held[0].set_exception(EngineDied("engine process exited (test)"))
        with pytest.raises(SwitchAbandoned, match="is down"):
            await asyncio.wait_for(switch, 5)
        assert await asyncio.wait_for(detach, 5) is None
        _, errors = await asyncio.wait_for(run, 5)
        assert [d.error_code for d in errors] == ["engine_down"]
        assert e.failure and e.role.switching_to is None
        peer_req = RequestState("peer/x", CASE["prompt_token_ids"], SamplingParams(max_tokens=4), 1, node.tokenizer,
                                node.eos_ids(), node.max_model_len, time.monotonic())
        e.adopt(peer_req, 0, peer_req.seqs[0])
        [delta] = await asyncio.wait_for(peer_req.stream.take(), 1)
        assert delta.error_code == "engine_down" and peer_req.finished[0]

    with_node(body, engine_layout="thread", max_num_batched_tokens=4)


def test_kill_9_of_an_engine_logs_no_unretrieved_future():
    """Issue 32: kill -9 of an engine process with two steps in flight logged "Future exception was never
    retrieved" (the second step's reply got EngineDied and nobody awaited it). The loop's exception
    handler must see nothing once the replies are settled and collected."""
    import gc
    import os
    import signal

    async def body(node: Node):
        loop = asyncio.get_running_loop()
        seen: list[dict] = []
        loop.set_exception_handler(lambda _loop, context: seen.append(context))
        e = node.engines[0]
        run = asyncio.create_task(collect(node, "r", SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)))
        for _ in range(1000):
            if len(e._inflight) == 2:
                break
            await asyncio.sleep(0.005)
        replies = [r.reply for r in e._inflight]
        assert len(replies) == 2  # async scheduling: a step is planned while the one before it computes
        os.kill(e.runner.process.pid, signal.SIGKILL)
        _, errors = await asyncio.wait_for(run, 20)
        assert [d.error_code for d in errors] == ["engine_down"]
        await asyncio.wait(replies, timeout=10)  # the dead engine's replies all get their error
        assert all(f.done() for f in replies)
        del replies
        gc.collect()  # an unread exception is reported when its future is collected
        await asyncio.sleep(0)
        assert not [c for c in seen if "never retrieved" in c.get("message", "")], seen

    with_node(body, engine_restart_max=0)  # the engine stays down: the request ends with its error
