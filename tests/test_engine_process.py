"""Engine processes: one per device, gone with the node however it ends; a dead one is a down device.

Also the step diff (:class:`node.runtime.step_encoder.StepEncoder`): what the engine is told is what
changed, and a replaced token list or block table is sent whole.
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from node.core.batcher import ScheduledSeq, StepKind, StepPlan
from node.core.sequence import SamplingParams, Sequence
from node.runtime.step_encoder import StepEncoder
from node.worker.engine_core import EngineCore
from support import STORIES, NodeProcess, reference_cases, up

CASE = reference_cases()[0]
NO_RESTART = ("--engine-restart-max", "0")  # a killed engine stays down (restarts: test_engine_restart.py)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie awaiting its parent's wait counts as gone
        return f.read().split(")")[1].split()[0] != "Z"


def _wait_gone(pids: list[int], timeout_s: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def _engine_pids(node: NodeProcess) -> dict[str, int]:
    return {d["device"]: d["engine"]["pid"] for d in node.status()["devices"]}


def _complete(node: NodeProcess, max_tokens: int = 24) -> httpx.Response:
    return node.client.post("/v1/completions", json={"prompt": CASE["prompt"], "max_tokens": max_tokens,
                                                       "temperature": 0.0})


@pytest.fixture(scope="module")
def no_restart_node():
    """A two-device node whose killed engines stay down, shared by the two tests below: the first kills
    cpu:0's engine, the second the last engine left (it kills cpu:0's first where it runs alone)."""
    node = NodeProcess("--model", str(STORIES), "--devices", "cpu:0,cpu:1", *NO_RESTART)
    yield node
    node.close()


def test_each_device_has_a_named_engine_process_and_a_killed_one_is_a_down_device(no_restart_node):
    node = no_restart_node
    pids = _engine_pids(node)
    assert set(pids) == {"cpu:0", "cpu:1"} and node.proc.pid not in pids.values()
    for device, pid in pids.items():
        assert open(f"/proc/{pid}/comm").read().strip() == f"shiftnode-{device}"
        assert int(open(f"/proc/{pid}/stat").read().split(")")[1].split()[1]) == node.proc.pid  # the node's child
    os.kill(pids["cpu:0"], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while node.health()[1]["status"] == "ok" and time.monotonic() < deadline:
        time.sleep(0.05)
    code, body = node.health()
    assert code == 200 and body["status"] == "degraded" and any("cpu:0" in r for r in body["reasons"]), body
    for _ in range(3):  # the other device serves everything, exactly
        r = _complete(node)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == CASE["output_text"][: len(r.json()["choices"][0]["text"])]
    status = {d["device"]: d for d in node.status()["devices"]}
    assert "cpu:0" in status["cpu:0"]["failure"] and "signal 9" in status["cpu:0"]["failure"]
    assert status["cpu:1"]["failure"] is None
    assert status["cpu:0"]["kv_blocks_used"] == 0 and status["cpu:0"]["running"] == 0  # nothing held by the dead
    assert 'shiftnode_engine_down{device="cpu:0"} 1.0' in node.client.get("/metrics").text


def test_an_engine_killed_mid_stream_ends_the_stream_with_an_error(no_restart_node):
    """With restarts off and no other device up, the stream cannot resume: it ends with an error. Then,
    every engine down, a request is a 503 engine_down with Retry-After, and /health a 503."""
    node = no_restart_node
    down = {d["device"] for d in node.status()["devices"] if d["failure"] is not None}
    if "cpu:0" not in down:  # run alone: leave cpu:1 the only device up, as the test above does
        os.kill(_engine_pids(node)["cpu:0"], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while node.health()[1]["status"] == "ok" and time.monotonic() < deadline:
            time.sleep(0.05)
    pid = _engine_pids(node)["cpu:1"]
    events = []
    with node.client.stream("POST", "/v1/completions", json={"prompt": "Once", "max_tokens": 400, "stream": True,
                                                               "ignore_eos": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 3:
                    os.kill(pid, signal.SIGKILL)
    assert events[-1] == "[DONE]" or "engine_down" in events[-1] or "engine_down" in events[-2], events[-3:]
    assert any("engine_down" in e for e in events), events[-3:]
    assert node.proc.poll() is None  # the node outlives its engines
    status = {d["device"]: d for d in node.status()["devices"]}
    assert status["cpu:1"]["kv_blocks_used"] == 0 and status["cpu:1"]["running"] == 0
    assert node.status()["live_requests"] == 0
    deadline = time.monotonic() + 10
    while node.health()[0] == 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    r = _complete(node)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_down", r.text
    assert int(r.headers["Retry-After"]) >= 1
    assert node.health()[0] == 503


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rpartition(")")[2].split()[1])


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` now."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if _parent(int(entry)) == pid:
                    out.append(int(entry))
            except (OSError, ValueError, IndexError):  # gone meanwhile
                pass
    return out


def test_engines_exit_with_the_node_on_sigterm_and_on_sigkill():
    """Both the engines forked at the start (the node's children) and a restarted one (forked from the
    node's fork server: node.worker.engine_start) end with the node. The restarted engine of the
    SIGKILLed node is stopped (SIGSTOP) first, so it cannot see its socket close: only the death
    signal that fires when the server exits can end it."""
    sigs = (signal.SIGTERM, signal.SIGKILL)
    nodes = up(*(NodeProcess("--model", str(STORIES), "--devices", "cpu:0,cpu:1", wait=False) for _ in sigs))
    try:
        killed = [_engine_pids(node)["cpu:1"] for node in nodes]
        for pid in killed:
            os.kill(pid, signal.SIGKILL)
        for sig, node, old in zip(sigs, nodes, killed):  # one node per signal (started together)
            deadline = time.monotonic() + 60
            while (_engine_pids(node)["cpu:1"] in (old, None) or node.health()[1]["status"] != "ok") \
                    and time.monotonic() < deadline:
                time.sleep(0.1)
            pids = _engine_pids(node)
            server = _parent(pids["cpu:1"])
            assert _parent(pids["cpu:0"]) == node.proc.pid and server != node.proc.pid
            assert _parent(server) == node.proc.pid and len(os.listdir(f"/proc/{server}/task")) == 1  # one thread
            assert _complete(node).status_code == 200
            if sig == signal.SIGKILL:
                os.kill(pids["cpu:1"], signal.SIGSTOP)
            family = {*pids.values(), server, *_children(node.proc.pid)}  # with multiprocessing's resource tracker
            node.proc.send_signal(sig)
            node.proc.wait(15)
            assert _wait_gone(sorted(family)) == [], f"engines, fork server or tracker left after {sig.name}"
    finally:
        for node in nodes:
            node.close()


def _seq(sid: str, prompt: list[int]) -> Sequence:
    return Sequence(sid, "r", 0, 0.0, prompt, SamplingParams(max_tokens=8, temperature=0.0), 64)


@pytest.mark.quick
def test_the_step_message_is_a_diff_and_replacements_are_sent_whole():
    enc = StepEncoder()
    a = _seq("a", [1, 2, 3])
    a.block_ids = [5]
    m = enc.encode(StepPlan(StepKind.MIXED, [ScheduledSeq(a, 3)]), {"a": 0})
    assert m.reset and [n.token_ids for n in m.new] == [[1, 2, 3]] and m.items[0].start == 0 and m.items[0].sample
    enc.sent(m)
    a.num_computed = 3
    a.token_ids.append(9)  # the node writes the sampled token over its placeholder: same length as the engine's
    m = enc.encode(StepPlan(StepKind.DECODE, [ScheduledSeq(a, 1)]), {"a": 0})
    assert not m.reset and m.new == [] and m.tokens == [] and m.blocks == [] and m.drop == []
    enc.sent(m)
    a.token_ids.append(4)
    a.num_computed = 4
    a.block_ids.append(6)  # an appended block travels alone
    m = enc.encode(StepPlan(StepKind.DECODE, [ScheduledSeq(a, 1)]), {"a": 0})
    assert [(b.keep, b.add) for b in m.blocks] == [(1, [6])] and m.tokens == []
    enc.sent(m)
    a.token_ids.append(7)
    a.block_ids = [8, 9]  # preempted and re-admitted: a new table
    a.token_ids = list(a.token_ids) + [11]  # tokens a peer streamed (a recompute): a new list, sent whole
    a.num_computed = 0
    m = enc.encode(StepPlan(StepKind.MIXED, [ScheduledSeq(a, len(a.token_ids))]), {"a": 0})
    assert [(b.keep, b.add) for b in m.blocks] == [(0, [8, 9])]
    assert [(t.keep, t.add) for t in m.tokens] == [(0, a.token_ids)]
    m = enc.encode(StepPlan(StepKind.MIXED, []), {})
    assert m.drop == ["a"] and enc.known == {}


class _FakeRunner:
    """Records the inputs the engine core builds; samples token 100 + position."""

    num_blocks, kv_cache = 16, None

    def __init__(self):
        self.steps = []

    def execute(self, step):
        from node.worker.runner import SeqOutput

        self.steps.append(step)
        return {s.seq_id: SeqOutput(token_id=100 + s.start + len(s.token_ids)) if s.sample else SeqOutput()
                for s in step.seqs}


@pytest.mark.quick
def test_the_engine_core_feeds_its_own_sampled_token_to_the_next_step():
    runner = _FakeRunner()
    core = EngineCore(runner)
    enc = StepEncoder()
    a = _seq("a", [1, 2, 3])
    a.block_ids = [2]
    for step in range(4):
        n = 3 if step == 0 else 1
        m = enc.encode(StepPlan(StepKind.MIXED, [ScheduledSeq(a, n)]), {"a": 0})
        enc.sent(m)
        a.token_ids.append(-1)  # the node's placeholder while the step is in flight
        a.num_computed += n
        reply = core.step(m)
        a.token_ids[-1] = reply.outputs[0].token_id
    fed = [s.seqs[0].token_ids for s in runner.steps]
    assert fed == [[1, 2, 3], [103], [104], [105]]
    assert core.seqs["a"].token_ids == a.token_ids == [1, 2, 3, 103, 104, 105, 106]
    sample = runner.steps[-1].seqs[0].sample
    assert sample.prompt_len == 3 and sample.output_index == 3 and sample.token_ids is core.seqs["a"].token_ids


def test_pooled_hand_offs_avoid_a_dead_decode_device():
    """Pooled, two decode devices, one killed: new requests are placed on the live one, a sequence whose
    target died is handed to the live one, and nothing hangs; with no decode device left, 503."""
    import json

    node = NodeProcess("--model", str(STORIES), "--mode", "pooled", "--prefill-devices", "cpu:0",
                       "--decode-devices", "cpu:1,cpu:2", "--link-gbps", "0.0005", *NO_RESTART)
    try:
        pids = _engine_pids(node)
        body = {"prompt": CASE["prompt"], "max_tokens": 24, "temperature": 0.0, "stream": True, "return_token_ids": True}
        with node.client.stream("POST", "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            first = next(x for x in lines if x.startswith("data: {"))  # placed on cpu:1 (ties go to the first)
            os.kill(pids["cpu:1"], signal.SIGKILL)  # while its KV is on the way there
            events = [json.loads(first[6:])] + [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        ids = [t for e in events for c in e["choices"] for t in c.get("token_ids") or []]
        assert ids == CASE["output_token_ids"][:24], events[-1]
        deadline = time.monotonic() + 10
        while not {d["device"]: d for d in node.status()["devices"]}["cpu:1"]["failure"] and time.monotonic() < deadline:
            time.sleep(0.05)
        for _ in range(4):
            r = _complete(node)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == CASE["output_text"][: len(r.json()["choices"][0]["text"])]
        moved = node.status()["kv_transfers"]
        assert moved and all(m["dst"] == "cpu:2" for m in moved)
        os.kill(pids["cpu:2"], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not {d["device"]: d for d in node.status()["devices"]}["cpu:2"]["failure"] and time.monotonic() < deadline:
            time.sleep(0.05)
        r = node.client.post("/v1/completions", json={"prompt": CASE["prompt"], "max_tokens": 24, "temperature": 0.0},
                             timeout=30)
        assert r.status_code == 503, r.text
        error = r.json()["error"]  # no peers: the node's own decode devices are down (it said peer_unavailable)
        assert error["code"] == "engine_down" and "cpu:1" in error["message"] and "cpu:2" in error["message"], r.text
    finally:
        node.close()


@pytest.mark.quick
def test_engine_threads_leave_a_core_to_the_control_loop_and_each_front_end():
    from node.config import NodeConfig
    from node.worker.engine_process import engine_threads

    assert engine_threads(NodeConfig(devices=["cpu:0"]), 2) == 1
    assert engine_threads(NodeConfig(devices=["cpu:0"]), 16) == 15
    assert engine_threads(NodeConfig(devices=["cpu:0"], api_processes=8), 16) == 7
    assert engine_threads(NodeConfig(devices=["cpu:0", "cpu:1"], api_processes=4), 16) == 5
    assert engine_threads(NodeConfig(devices=["cpu:0"], api_processes=4), 4) == 1  # never below one
