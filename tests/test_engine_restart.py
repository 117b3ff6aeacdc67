"""Issue 32 items 2 and 3: a dead engine is restarted (with backoff; a crash loop is left down) and the
streams it carried resume on a live device, or wait for its restart, with the exact greedy continuation.

One node of two devices; the engine of cpu:0 is killed with SIGKILL under four streams (its streams
resume on cpu:1; it restarts), then again once it serves streams (a crash loop with
``--engine-restart-max 1``: left down; its streams resume on cpu:1 again). ``/health`` and ``/v1/node``
say what is down, since when and what comes next; no KV block is left behind. Parking (no device up:
a sequence waits for the restart) and the ``--max-retries`` bound are checked on stand-ins.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from support import STORIES, NodeProcess, reference_cases

CASES = reference_cases()


def _pids(node: NodeProcess) -> dict[str, int]:
    return {d["device"]: d["engine"]["pid"] for d in node.status()["devices"]}


def _metric(node: NodeProcess, line_start: str) -> float:
    for line in node.client.get("/metrics").text.splitlines():
        if line.startswith(line_start + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{line_start} not exported")


def _stream(node: NodeProcess, case: dict, started: threading.Semaphore) -> tuple[list[int], list[dict]]:
    """Stream ``case`` greedily; release ``started`` after its second event; its token ids and errors."""
    body = {"prompt": case["prompt"], "max_tokens": len(case["output_token_ids"]), "temperature": 0.0,
            "stream": True, "return_token_ids": True}
    ids, errors, n = [], [], 0
    with node.client.stream("POST", "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                errors.append(event)
            for c in event.get("choices", []):
                ids += c.get("token_ids") or []
            n += 1
            if n == 2:
                started.release()
    return ids, errors


def _under_streams(node: NodeProcess, kill) -> None:
    """Run the four reference cases as streams, call ``kill()`` once each has had two events, and check
    that every stream ends with its exact greedy reference, without an error event."""
    started = threading.Semaphore(0)
    with ThreadPoolExecutor(len(CASES)) as pool:
        futures = [pool.submit(_stream, node, c, started) for c in CASES]
        for _ in CASES:
            assert started.acquire(timeout=60)
        kill()
        for case, f in zip(CASES, futures):
            ids, errors = f.result(timeout=120)
            assert errors == [] and ids == case["output_token_ids"], (case["prompt"], errors, len(ids))


def _wait(what, timeout_s: float = 60.0, every_s: float = 0.05):
    """Poll ``what()`` (over HTTP: nothing else to wait on) until it is truthy; return it."""
    deadline = time.monotonic() + timeout_s
    while not (got := what()):
        assert time.monotonic() < deadline, f"timed out waiting for {what.__doc__ or what}"
        time.sleep(every_s)
    return got


def test_a_killed_engine_restarts_its_streams_resume_exactly_and_a_crash_loop_is_left_down():
    node = NodeProcess("--model", str(STORIES), "--devices", "cpu:0,cpu:1", "--engine-restart-max", "1",
                       "--engine-restart-window-s", "600")
    try:
        pids = _pids(node)
        assert node.status()["devices"][0]["restart"] == {"restarts": 0, "restarts_in_window": 0, "max": 1,
                                                           "window_s": 600.0, "start_timeout_s": 600.0,
                                                           "outage": None}

        def kill():
            os.kill(pids["cpu:0"], signal.SIGKILL)
            # honest while down: what, since when, what next
            code, body = _wait(lambda: (h := node.health())[1]["status"] != "ok" and h)
            assert code == 200 and body["status"] == "degraded", body
            [reason] = body["reasons"]
            assert reason.startswith("engine cpu:0 down: engine process of cpu:0") and "signal 9" in reason, reason
            assert "down for " in reason and ("restart 1 of 1 in " in reason or "restarting now" in reason), reason
            outage = node.status()["devices"][0]["restart"]["outage"]
            assert outage["state"] in ("waiting", "starting") and "signal 9" in outage["reason"], outage
            assert outage["since_wall_s"] <= time.time()

        _under_streams(node, kill)  # the streams of cpu:0 resumed on cpu:1
        resumed = _metric(node, "shiftnode_kv_recomputes_total")
        assert resumed >= 1

        def restarted():
            d = node.status()["devices"][0]
            return d["failure"] is None and d

        d = _wait(restarted)
        assert d["engine"]["pid"] != pids["cpu:0"] and d["restart"]["restarts"] == 1 and d["restart"]["outage"] is None
        assert _metric(node, 'shiftnode_engine_restarts_total{device="cpu:0"}') == 1.0
        assert node.health() == (200, {"status": "ok"})

        # the restarted engine takes streams again; killed once more, it is a crash loop: left down
        pids = _pids(node)
        steps = node.status()["devices"][0]["steps"]
        _under_streams(node, lambda: _wait(lambda: node.status()["devices"][0]["steps"] > steps)
                       and os.kill(pids["cpu:0"], signal.SIGKILL))
        assert _metric(node, "shiftnode_kv_recomputes_total") > resumed  # resumed on cpu:1 again
        code, body = _wait(lambda: (h := node.health())[1]["status"] != "ok" and h)
        assert code == 200 and body["status"] == "degraded", body
        [reason] = body["reasons"]
        assert reason.startswith("engine cpu:0 down:") and "left down: crash loop, restarted 1 times within 600 s" in reason
        outage = node.status()["devices"][0]["restart"]["outage"]
        assert outage["state"] == "left_down" and outage["next_try_in_s"] is None, outage
        assert _metric(node, 'shiftnode_engine_restarts_total{device="cpu:0"}') == 1.0
        st = node.wait_idle()  # no block held on either device
        assert st["live_requests"] == 0
    finally:
        node.close()


@pytest.mark.quick
def test_resume_targets_a_live_device_parks_for_a_restart_and_respects_max_retries():
    """The Resumer's decisions on stand-ins: a live device takes the orphan (reset to recompute its
    prompt plus streamed tokens); with none up it is parked for the dead device's restart and queued
    there once it serves again; past --max-retries, or with nothing coming back, the choice ends with
    503 engine_down; a cancelled request is dropped."""
    from types import SimpleNamespace

    from node.config import NodeConfig
    from node.core.sequence import SamplingParams
    from node.runtime.request import RequestState
    from node.runtime.resume import Resumer
    from node.worker.tokenizer import TextTokenizer

    class Dev(SimpleNamespace):
        def add_seq(self, req, index, until=None):
            self.taken.append(req.seqs[index].seq_id)
            self.quarantined.append(until)

        def wake(self):
            pass

        @property
        def up(self):
            return self.failure is None

    a, b = (Dev(device_id=d, failure=None, taken=[], quarantined=[], fatal={}, fatal_alone=False,
                batcher=SimpleNamespace(waiting=[], running=[])) for d in ("cpu:0", "cpu:1"))
    will = {"restart": True}
    node = SimpleNamespace(config=NodeConfig(max_retries=1), engines=[a, b], metrics=SimpleNamespace(
        kv_recomputes=SimpleNamespace(inc=lambda: None)), least_loaded=lambda ids: [e for e in (a, b) if e.device_id in ids][0])
    supervisor = SimpleNamespace(will_restart=lambda e: will["restart"], restart_listeners=[], left_down_listeners=[])
    tok = TextTokenizer.from_folder(STORIES)
    case = CASES[0]

    def request(rid):
        req = RequestState(rid, case["prompt_token_ids"], SamplingParams(max_tokens=8), 1, tok, [2], 512, 0.0)
        seq = req.seqs[0]
        seq.token_ids += case["output_token_ids"][:3]  # three tokens streamed
        seq.num_computed, seq.num_registered = len(seq.token_ids) - 1, 1
        return req

    def errors(req):  # (status, code) of the error deltas pushed to the request's stream
        return [(d.error_status, d.error_code) for d in req.stream._items if d.error]

    r = Resumer(node, supervisor)
    assert a.orphan_listener == r.orphaned and supervisor.restart_listeners == [r.restarted]
    a.failure = "engine process of cpu:0 was killed by signal 9"
    req, bystander = request("r1"), request("r0")
    a.fatal = {"r1-0": 9}  # r1 was in the step the engine died in: a suspect, recomputed alone up to 9 tokens
    r.orphaned(a, req, 0)  # cpu:1 is up: it takes the sequence, to recompute from the start
    seq = req.seqs[0]
    assert b.taken == ["r1-0"] and (seq.num_computed, seq.num_registered, seq.block_ids) == (0, 0, [])
    assert seq.token_ids == case["prompt_token_ids"] + case["output_token_ids"][:3] and b.quarantined == [9]
    for _ in range(3):  # deaths it was not in are not charged to a bystander (and it is not quarantined)
        r.orphaned(a, bystander, 0)
    assert b.taken[1:] == ["r0-0"] * 3 and b.quarantined[1:] == [None] * 3 and not bystander.finished[0]
    b.failure = "down too"
    b.fatal = {"r1-0": 9}
    r.orphaned(b, req, 0)  # its second resume as a suspect (> --max-retries 1): an error
    assert errors(req) == [(503, "engine_down")] and "gave up after 1 resumes, --max-retries 1" in req.stream._items[0].error
    b.failure = None
    alone = request("r9")
    a.fatal, a.fatal_alone = {"r9-0": 9}, True  # it was alone in the fatal step (its quarantine): the cause
    r.orphaned(a, alone, 0)
    assert errors(alone) == [(500, "engine_crash")] and "not resumed again" in alone.stream._items[0].error
    b.failure = "down too"
    a.fatal, a.fatal_alone = {}, False
    parked = request("r2")
    r.orphaned(a, parked, 0)  # nothing up: waits for cpu:0's restart
    assert r.parked == {"cpu:0": [(parked, 0, None)]} and not parked.finished[0]
    a.failure = None
    r.restarted(a)
    assert a.taken == ["r2-0"] and r.parked == {}
    a.failure = "again"
    gone, lost = request("r3"), request("r4")
    gone.cancelled = True
    r.orphaned(a, gone, 0)
    r.orphaned(a, lost, 0)
    assert r.parked == {"cpu:0": [(lost, 0, None)]} and not gone.finished[0]
    r.left_down(a)  # cpu:0 will not come back, and nothing else is up
    assert errors(lost) == [(503, "engine_down")] and r.parked == {} and errors(gone) == []
    will["restart"] = False
    nowhere = request("r5")
    r.orphaned(a, nowhere, 0)
    assert errors(nowhere) == [(503, "engine_down")] and "will not be restarted" in nowhere.stream._items[0].error
    r.forget(req)
    assert "r1-0" not in r.retries


@pytest.mark.quick
def test_restart_backoff_doubles_a_crash_loop_is_left_down_and_the_window_forgets():
    """The supervisor's plan on a stand-in device and clock: restarts 1 s, 2 s, 4 s after each death
    within the window; the death after --engine-restart-max restarts is left down (and said so); once
    the window has passed the old restarts no longer count; what /health says at each point."""
    import asyncio
    from types import SimpleNamespace

    from node.config import NodeConfig
    from node.runtime.engine_supervisor import EngineSupervisor

    now = [1000.0]
    dev = SimpleNamespace(device_id="cpu:0", failure=None, engine_died=True, down_listeners=[])
    sup = EngineSupervisor(NodeConfig(engine_restart_max=3, engine_restart_window_s=100), [dev], clock=lambda: now[0])
    planned = []

    async def restart(engine, delay_s):  # instead of launching an engine: restarted at once, on the stand-in clock
        planned.append(delay_s)
        sup.recent(engine.device_id).append(now[0])
        sup.outages.pop(engine.device_id)

    sup._restart = restart
    left = []
    sup.left_down_listeners.append(left.append)

    async def die(reason="killed"):
        dev.failure = reason
        [listener(dev) for listener in dev.down_listeners]
        described = sup.describe("cpu:0", now[0])
        await asyncio.sleep(0)  # the planned restart runs
        return described

    async def go():
        said = [await die() for _ in range(3)]
        assert planned == [1.0, 2.0, 4.0] and left == []
        assert said == ["down for 0.0 s; restart 1 of 3 in 1.0 s", "down for 0.0 s; restart 2 of 3 in 2.0 s",
                        "down for 0.0 s; restart 3 of 3 in 4.0 s"]
        # the third restart under way: the window is full, yet the device is coming back (work waits for it)
        from node.runtime.engine_supervisor import Outage
        sup.outages["cpu:0"] = Outage("killed", now[0], 0.0, starting=True)
        assert sup.will_restart(dev) and sup.coming_back("cpu:0") and "crash loop" in sup.why_not(dev)
        sup.outages.clear()
        now[0] += 10
        assert (await die("again")).endswith("left down: crash loop, restarted 3 times within 100 s "
                                             "(--engine-restart-max 3, --engine-restart-window-s 100)")
        assert left == [dev] and sup.status("cpu:0", now[0])["outage"]["state"] == "left_down"
        now[0] += 100  # the three restarts are out of the window: the next death is restarted again
        sup.outages.clear()
        assert (await die()) == "down for 0.0 s; restart 1 of 3 in 1.0 s" and planned[-1] == 1.0
        dev.engine_died = False  # a step loop that ended in the node's own code is not restarted
        assert "not restarted: its step loop ended in the node's own code" in await die()

    asyncio.run(go())


def test_pooled_streams_wait_for_their_only_decode_device_to_restart(pooled_node):
    """The shared pooled node (prefill cpu:0, decode cpu:1): the decode engine is killed under four
    streams. Their sequences are prefilled again on cpu:0 and wait there for cpu:1's restart (it was
    the only decode device: they failed with 503 before), then decode there: every stream ends with
    its exact reference. The node is left as found: both devices up, no block held."""
    node = pooled_node
    pid = _pids(node)["cpu:1"]
    before = _metric(node, 'shiftnode_engine_restarts_total{device="cpu:1"}')

    def kill():
        _wait(lambda: node.status()["devices"][1]["running"] > 0)  # some stream decodes on cpu:1 now
        os.kill(pid, signal.SIGKILL)
        code, body = _wait(lambda: (h := node.health())[1]["status"] != "ok" and h)
        assert code == 503 and "no decode device is up and no decode peer is ready" in body["reasons"], body

    _under_streams(node, kill)
    d = _wait(lambda: (d := node.status()["devices"][1])["failure"] is None and d)
    assert d["engine"]["pid"] != pid and d["restart"]["outage"] is None
    assert _metric(node, 'shiftnode_engine_restarts_total{device="cpu:1"}') == before + 1
    node.wait_idle()
    assert node.health() == (200, {"status": "ok"})


@pytest.mark.quick
def test_the_restart_flags_default_to_5_in_600_s_and_bad_values_are_refused():
    import argparse

    import pytest

    from node.cli import config_from_args, serve_parser
    from node.config import ConfigError

    parser = argparse.ArgumentParser()
    serve_parser(parser.add_subparsers(dest="command"))
    parse = lambda *a: config_from_args(parser.parse_args(["serve", *a]))  # noqa: E731
    c = parse()
    assert (c.engine_restart_max, c.engine_restart_window_s) == (5, 600.0)
    parse("--engine-restart-max", "0").validate()  # 0: never restart
    with pytest.raises(ConfigError, match="--engine-restart-max must be at least 0"):
        parse("--engine-restart-max", "-1").validate()
    with pytest.raises(ConfigError, match="--engine-restart-window-s must be positive"):
        parse("--engine-restart-window-s", "0").validate()


@pytest.mark.quick
def test_a_restart_that_hangs_while_loading_is_stopped_and_counts_as_a_failed_start(monkeypatch):
    """--engine-start-timeout-s: a restarted engine whose load never finishes is stopped after the bound
    (which also ends the thread waiting for it), and the attempt is one more death of the device: the
    next restart is planned with the doubled backoff, and /health says why."""
    import asyncio
    from types import SimpleNamespace

    import node.runtime.engine_supervisor as es
    from node.config import NodeConfig

    class HangingEngine:  # stands in for an engine process stuck while loading its weights
        def __init__(self):
            self.released, self.stopped = threading.Event(), False

        def wait_ready(self):
            self.released.wait(30)
            raise RuntimeError("engine died before it was ready")

        def stop(self):
            self.stopped = True
            self.released.set()

    launched: list[HangingEngine] = []
    monkeypatch.setattr(es, "launch_engine", lambda *a: launched.append(HangingEngine()) or launched[-1])

    async def stop_runner():
        pass

    dev = SimpleNamespace(device_id="cpu:0", failure="killed", engine_died=True, down_listeners=[], runner=None,
                          stop_runner=stop_runner)
    sup = es.EngineSupervisor(NodeConfig(devices=["cpu:0"], engine_start_timeout_s=0.2), [dev])
    planned = []

    async def go():
        real = sup._restart

        async def restart(engine, delay_s):  # no backoff sleep in the test; the real restart otherwise
            planned.append(delay_s)
            if len(planned) == 1:
                await real(engine, 0.0)

        sup._restart = restart
        t0 = time.monotonic()
        [listener(dev) for listener in dev.down_listeners]
        await asyncio.wait_for(sup._tasks["cpu:0"], 10)
        return time.monotonic() - t0

    took = asyncio.run(go())
    assert 0.2 <= took < 5 and len(launched) == 1 and launched[0].stopped
    assert planned == [1.0, 2.0]  # the hung start was a failed one: the next restart waits twice as long
    assert "did not load within --engine-start-timeout-s 0.2" in dev.failure
    assert sup.total["cpu:0"] == 1 and "restart 2 of 5" in sup.describe("cpu:0", time.monotonic())
