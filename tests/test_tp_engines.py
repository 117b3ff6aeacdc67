"""A tensor-parallel group of engine processes runs as one device (``--tensor-parallel-size``, colocated).

One node (in this process) over ``cpu:0,cpu:1`` at size 2: a single device ``cpu:0+cpu:1`` whose two
engine processes are ranks of one gloo group. The four stories260k reference prompts, served
concurrently and greedily, give llama2.c's reference tokens exactly; each rank's KV pool holds its
half of the KV heads with the same number of blocks, twice the blocks of one device at the same
budget; sampled requests (seeded and not) leave the ranks in agreement. Then a killed rank makes
the whole group down with an error naming the group, the rank, its device and the signal, the
other rank is ended, and new requests are refused (503 ``engine_down``). The CLI serves a group
over HTTP (ranks forked before the event loop) and its ranks exit with the node. A rank that fails
to load is named in the start-up error. The refusals at start-up (other modes, a device count or
a model that the size does not divide, mixed device kinds, the thread layout, KV transfers) run
without starting an engine, and how the group combines its ranks' replies (agreement, a failure
on every rank, a disagreement, a rank failing alone, a dead rank) is checked on fake ranks.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from node.cli import config_from_args, serve_parser
from node.config import ConfigError, NodeConfig
from node.core.sequence import SamplingParams
from node.runtime.admission import EnginesDown
from node.runtime.node import Node
from node.worker.loader import StartupError, load_model_info
from node.worker.model_config import ModelConfig
from node.worker.runner import plan_kv_blocks
from support import STORIES, NodeProcess, reference_cases, require_shared
from test_engine_process import _wait_gone

KV_BYTES = 5 * 1024 * 1024  # per device: 256 blocks of stories260k at size 1, 512 per rank at 2


def tp_config(**over) -> NodeConfig:
    base = dict(model=str(STORIES), devices=["cpu:0", "cpu:1"], mode="colocated", tensor_parallel_size=2,
                kv_cache_memory_bytes=KV_BYTES)
    return NodeConfig(**(base | over))


async def run_case(node: Node, rid: str, case: dict) -> list[int]:
    ids = []
    params = SamplingParams(max_tokens=case["max_new_tokens"], temperature=0.0)
    async for _, d in node.generate(rid, case["prompt_token_ids"], params):
        assert d.error is None, d.error
        ids += d.token_ids
    return ids


def test_a_tp2_group_serves_the_references_exactly_and_a_killed_rank_downs_the_group():
    require_shared()
    cases = reference_cases()
    cfg = ModelConfig.from_folder(STORIES)

    async def go():
        t0 = time.perf_counter()
        node = await Node.create(tp_config(engine_restart_max=0))  # the group stays down (restarts: test_engine_restart)
        started = time.perf_counter() - t0
        node.start()
        try:
            assert [e.device_id for e in node.engines] == ["cpu:0+cpu:1"]
            engine = node.engines[0]
            group = engine.runner
            pids = group.pids
            assert len(set(pids)) == 2 and os.getpid() not in pids
            for pid, device in zip(pids, ("cpu:0", "cpu:1")):
                assert open(f"/proc/{pid}/comm").read().strip() == f"shiftnode-{device}"
            # each rank: its K/2 KV heads, the same blocks, twice those of one device at the same budget
            blocks = plan_kv_blocks(cfg, load_model_info(tp_config()).dtype, 16, KV_BYTES, 2)
            assert blocks == 2 * plan_kv_blocks(cfg, load_model_info(tp_config()).dtype, 16, KV_BYTES)
            assert group.num_blocks == blocks == engine.batcher.ledger.num_blocks
            for kv in group.kv_caches:
                assert list(kv.shape) == [cfg.num_layers, 2, blocks, 16, cfg.num_kv_heads // 2, cfg.head_dim]
            assert group.kv_cache is None  # no node-side view: transfers are refused for groups
            status = node.status()["devices"]
            assert len(status) == 1 and status[0]["device"] == "cpu:0+cpu:1"
            assert status[0]["tensor_parallel"] == {"size": 2, "devices": ["cpu:0", "cpu:1"], "pids": pids, "active_layout": None}
            assert status[0]["engine"]["pid"] == pids[0]

            t1 = time.perf_counter()
            got = await asyncio.gather(*(run_case(node, f"ref-{i}", c) for i, c in enumerate(cases)))
            served = time.perf_counter() - t1
            for g, c in zip(got, cases):
                assert g == c["output_token_ids"], c["prompt"]
            assert engine.failure is None and engine.batcher.ledger.num_used == 0
            # sampled requests (seeded and not) draw the same tokens on both ranks: the group stays up
            for rid, seed in (("sampled-seeded", 7), ("sampled", None)):
                params = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=seed)
                async for _, d in node.generate(rid, cases[1]["prompt_token_ids"], params):
                    assert d.error is None, d.error
            assert engine.failure is None and engine.batcher.ledger.num_used == 0

            # kill rank 1 mid-stream: the group is down, rank 0 is ended, requests are refused
            long = cases[0]
            task = asyncio.create_task(collect_errors(node, long))
            await asyncio.sleep(0.3)
            os.kill(pids[1], signal.SIGKILL)
            errors = await asyncio.wait_for(task, 20)
            for _ in range(200):
                if engine.failure:
                    break
                await asyncio.sleep(0.05)
            failure = engine.failure
            assert failure and "tensor-parallel group cpu:0+cpu:1 is down" in failure, failure
            assert "rank 1" in failure and "cpu:1" in failure and "signal 9" in failure, failure
            assert errors and errors[-1].error_code == "engine_down", errors
            assert engine.batcher.ledger.num_used == 0 and not engine.batcher.running
            for _ in range(100):
                if not group.ranks[0].process.is_alive():
                    break
                await asyncio.sleep(0.05)
            assert not group.ranks[0].process.is_alive()  # the surviving rank does not wait in a collective
            with pytest.raises(EnginesDown, match="cpu:0\\+cpu:1 is down"):
                node.open_request("after", long["prompt_token_ids"], SamplingParams(max_tokens=4, temperature=0.0))
            assert node.status()["devices"][0]["failure"] == failure
        finally:
            await node.close()
        print(f"\nTP=2 node: start {started:.1f} s, four reference cases {served:.1f} s")

    asyncio.run(go())


async def collect_errors(node: Node, case: dict) -> list:
    errors = []
    params = SamplingParams(max_tokens=case["max_new_tokens"], temperature=0.0)
    async for _, d in node.generate("killed", case["prompt_token_ids"], params):
        if d.error:
            errors.append(d)
    return errors


def test_the_cli_serves_a_group_over_http_and_its_ranks_exit_with_the_node():
    """``shiftnode serve --tensor-parallel-size 2``: the ranks are forked before the event loop
    (prelaunch), the completion equals the reference, and both ranks end with the node (SIGTERM)."""
    case = reference_cases()[1]
    node = NodeProcess("--model", str(STORIES), "--mode", "colocated", "--devices", "cpu:0,cpu:1",
                       "--tensor-parallel-size", "2", "--kv-cache-memory", str(KV_BYTES))
    try:
        device = node.status()["devices"][0]
        assert device["device"] == "cpu:0+cpu:1" and device["tensor_parallel"]["size"] == 2
        pids = device["tensor_parallel"]["pids"]
        assert all(int(open(f"/proc/{p}/stat").read().split(")")[1].split()[1]) == node.proc.pid for p in pids)
        r = node.client.post("/v1/completions", json={"prompt": case["prompt"], "max_tokens": 40, "temperature": 0.0})
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["text"]
        assert text and case["output_text"].startswith(text), (text, case["output_text"])
        node.proc.send_signal(signal.SIGTERM)
        node.proc.wait(15)
        assert _wait_gone(pids) == [], "ranks left after SIGTERM"
    finally:
        node.close()


# --- start-up refusals (no engine starts) --------------------------------------------------------------


@pytest.mark.parametrize("over, message", [
    (dict(mode="time-shared"), r"--tensor-parallel-size 2 is colocated mode.s degree \(the mode is "
                               r"time-shared\): time-shared and pooled modes take --decode-tp and --prefill-tp"),
    (dict(devices=["cpu:0", "cpu:1", "cpu:2"]), r"consecutive runs of 2, but 3 devices \(cpu:0,cpu:1,cpu:2\) is not a multiple of 2"),
    (dict(devices=["cpu:0", "cuda:0"]), r"mixes device kinds \(cpu:0\+cuda:0\)"),
    (dict(engine_layout="thread"), r"needs --engine-layout process"),
    (dict(kv_port=0, peer_secret="s"), r"--kv-port and --peers are not supported with --tensor-parallel-size 2 yet"),
    (dict(tensor_parallel_size=0), r"--tensor-parallel-size must be a positive integer, got 0"),
])
def test_configurations_the_slice_does_not_run_are_refused_at_start(over, message):
    config = tp_config(**over)
    with pytest.raises(ConfigError, match=message):
        config.validate()
    with pytest.raises(StartupError, match=message):
        asyncio.run(Node.create(config))


def test_a_size_the_model_does_not_divide_is_refused_with_its_numbers():
    # stories260k: 8 heads, 4 KV heads; size 8 splits the heads but not the KV heads
    config = tp_config(devices=[f"cpu:{i}" for i in range(8)], tensor_parallel_size=8)
    config.validate()  # the flags alone are consistent
    with pytest.raises(StartupError, match=r"--tensor-parallel-size 8: tensor-parallel degree 8 does not divide "
                                           r"the model's num_key_value_heads 4"):
        asyncio.run(Node.create(config))


def test_a_rank_that_fails_to_load_is_named_in_the_start_up_error():
    # per rank 640 KV bytes per token (half the KV heads): 100000 bytes hold 9 blocks, 144 tokens < 512
    with pytest.raises(StartupError, match=r"tensor-parallel group cpu:0\+cpu:1: rank 0 \(cpu:0\): .*KV budget of "
                                           r"100000 bytes on cpu:0 holds 144 tokens .*at 640 bytes/token"):
        asyncio.run(Node.create(tp_config(kv_cache_memory_bytes=100000)))


@pytest.mark.quick
def test_the_flag_defaults_to_1_and_groups_devices():
    import argparse

    parser = argparse.ArgumentParser()
    serve_parser(parser.add_subparsers(dest="command"))
    default = config_from_args(parser.parse_args(["serve", "--devices", "cpu:0,cpu:1"]))
    assert default.tensor_parallel_size == 1 and default.device_groups() == [["cpu:0"], ["cpu:1"]]
    assert default.tensor_parallel_error() is None
    a = parser.parse_args(["serve", "--mode", "colocated", "--devices", "cpu:0,cpu:1,cpu:2,cpu:3",
                           "--tensor-parallel-size", "2"])
    config = config_from_args(a)
    config.validate()
    assert config.device_groups() == [["cpu:0", "cpu:1"], ["cpu:2", "cpu:3"]]


# --- how the group combines its ranks' replies (no processes) ----------------------------------------


class _FakeProcess:
    def __init__(self):
        self.terminated = False

    def is_alive(self) -> bool:
        return not self.terminated

    def terminate(self) -> None:
        self.terminated = True


class _FakeRank:
    """A rank whose replies the test sets: each async_submit_frame returns a fresh future."""

    def __init__(self):
        self.process = _FakeProcess()
        self.futures: list[asyncio.Future] = []
        self.stopping = False

    def async_submit_frame(self, frame: bytes) -> asyncio.Future:
        self.futures.append(asyncio.get_running_loop().create_future())
        return self.futures[-1]


def _fake_group(monkeypatch, tmp_path):
    from node.worker.engine_group import TPEngineGroup

    monkeypatch.setattr("tempfile.mkdtemp", lambda prefix: str(tmp_path))  # the rendezvous folder
    group = TPEngineGroup(tp_config(), ["cpu:0", "cpu:1"], "spawn")
    group.ranks = [_FakeRank(), _FakeRank()]
    group._loop = asyncio.get_running_loop()
    return group


@pytest.mark.quick
def test_the_group_answers_rank_0s_reply_and_goes_down_when_ranks_disagree(monkeypatch, tmp_path):
    from node.worker.engine_core import StepMsg, StepReply
    from node.worker.engine_messages import EngineDied, EngineError, StepAck
    from node.worker.runner import SeqOutput

    async def go():
        group = _fake_group(monkeypatch, tmp_path)
        r0, r1 = group.ranks
        reply = StepReply([SeqOutput(token_id=5), SeqOutput()])
        out = group.async_submit(StepMsg([]))  # agreeing ranks: rank 0's reply
        r1.futures[-1].set_result(StepAck([5, -1]))
        await asyncio.sleep(0)
        assert not out.done()  # waits for every rank
        r0.futures[-1].set_result(reply)
        assert await out is reply
        out = group.async_submit(StepMsg([]))  # the same failure on every rank: contained
        for r in group.ranks:
            r.futures[-1].set_exception(EngineError("KeyError: 'x'", "KeyError"))
        with pytest.raises(EngineError, match="KeyError"):
            await out
        assert group._dead is None and not r0.process.terminated
        out = group.async_submit(StepMsg([]))  # rank 1 sampled something else: the group is down
        r0.futures[-1].set_result(reply)
        r1.futures[-1].set_result(StepAck([6, -1]))
        with pytest.raises(EngineDied, match=r"group cpu:0\+cpu:1 is down: rank 1 \(cpu:1\) sampled \[6, -1\] "
                                             r"where rank 0 sampled \[5, -1\]: the ranks diverged"):
            await out
        assert r0.process.terminated and r1.process.terminated
        with pytest.raises(EngineDied):
            group.async_submit(StepMsg([]))

    asyncio.run(go())


@pytest.mark.quick
def test_a_rank_failing_alone_downs_the_group(monkeypatch, tmp_path):
    from node.worker.engine_core import StepMsg, StepReply
    from node.worker.engine_messages import EngineDied, EngineError

    async def go():
        group = _fake_group(monkeypatch, tmp_path)
        r0, r1 = group.ranks
        out = group.async_submit(StepMsg([]))
        r0.futures[-1].set_result(StepReply([]))
        r1.futures[-1].set_exception(EngineError("RuntimeError: out of memory", "RuntimeError"))
        with pytest.raises(EngineDied, match=r"rank 1 \(cpu:1\) failed \(RuntimeError: out of memory\) while another "
                                             r"rank did not: the ranks' collectives are out of step"):
            await out
        group2 = _fake_group(monkeypatch, tmp_path)
        out = group2.async_submit(StepMsg([]))  # a dead rank: down at once, without waiting for the others
        group2.ranks[1].futures[-1].set_exception(EngineDied("engine process of cpu:1 (pid 7) was killed by signal 9"))
        with pytest.raises(EngineDied, match=r"rank 1 \(cpu:1\): engine process of cpu:1 \(pid 7\) was killed by signal 9"):
            await out

    asyncio.run(go())
