"""Issue 45 items 1, 3, 4 and 5: engine restarts that meet KV transfers, and requests that kill engines.

Each test runs an in-process node whose engines are real processes, kills one with SIGKILL at a chosen
point (a hand-off's blocks detached, an inbound reservation made, an in-node copy in flight), lets the
supervisor restart it, and checks with the ledger self-check on (``SHIFTNODE_LEDGER_CHECK``, after every
step: no block owned twice, none both free and owned) that nothing pinned before the restart is freed
into, or adopted by, the new engine's ledger; the sequences caught in it are resumed, greedy-exact.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from types import SimpleNamespace

import msgspec
import pytest
from structlog.testing import capture_logs

from node.core.roles import blocks_for
from node.core.sequence import SamplingParams
from node.runtime import block_pins
from node.runtime.node import Node
from node.transport.errors import DeviceDown
from support import reference_cases
from test_engine_faults import with_node

pytestmark = pytest.mark.slow_only("every test restarts an engine of an in-process node in the middle of a transfer")

CASES = reference_cases()
GREEDY = SamplingParams(max_tokens=40, temperature=0.0)


@pytest.fixture(autouse=True)
def ledger_check(monkeypatch):
    monkeypatch.setattr(block_pins, "LEDGER_CHECK", True)


async def wait_for(what, timeout_s: float = 60.0, every_s: float = 0.01):
    deadline = time.monotonic() + timeout_s
    while not (got := what()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(every_s)
    return got


async def collect(node: Node, rid: str, case: dict, params: SamplingParams = GREEDY,
                  started: asyncio.Event | None = None):
    """(token ids, error deltas) of one request."""
    ids, errors = [], []
    async for _, d in node.generate(rid, case["prompt_token_ids"], params):
        ids += d.token_ids
        errors += [d] if d.error else []
        if started is not None and len(ids) >= 3:
            started.set()
    return ids, errors


def kill(engine):
    """SIGKILL the device's engine process; return its runner (the engine before the restart)."""
    os.kill(engine.runner.process.pid, signal.SIGKILL)
    return engine.runner


async def restarted(engine, old_runner, timeout_s: float = 60.0) -> None:
    await wait_for(lambda: engine.runner is not old_runner and engine.failure is None, timeout_s)


def healthy(node: Node) -> None:
    """No engine error, and every block owned exactly as often as it is referenced."""
    for e in node.engines:
        assert "step" not in e.errors, e.errors
        e.check_ownership()


def _hand_off(node: Node, engine, req, seq):
    """A hand-off of ``seq`` to a peer that is never reached (its transfer outcome is decided by the test)."""
    from node.runtime.handoff import HandOff

    links = SimpleNamespace(timed_out=lambda e, side="sender": None, status_poll_s=1.0, reconnect_s=1.0, retries={},
                            node=SimpleNamespace(metrics=node.metrics, config=node.config))
    peer = SimpleNamespace(addr="peer:1", id="peer", hold_until=0.0, failures=0, sent=0)
    return HandOff(links, engine, req, seq, peer, "pooled", lambda committed: None)


def test_a_restart_during_a_hand_off_neither_frees_nor_readopts_the_old_blocks():
    """Two sequences are detached for hand-offs (their blocks pinned); the engine is killed and
    restarted, and a new request takes blocks of the new pool. Then one peer "commits" (its blocks
    would be freed) and the other transfer fails (the sequence would be readopted with its blocks):
    with the old ids, the new request's blocks would be freed under it, and the readopted sequence
    would decode from KV that is not there. Instead neither happens, the failed one is resumed, and
    every stream equals the reference."""
    case, other = CASES[0], CASES[1]

    async def body(node: Node):
        e = node.engines[0]
        started = [asyncio.Event(), asyncio.Event()]
        runs = [asyncio.create_task(collect(node, f"r{i}", case, started=started[i])) for i in range(2)]
        await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 60)
        hands = []
        for rid in ("r0", "r1"):
            req = node.live[rid]
            h = _hand_off(node, e, req, req.seqs[0])
            await asyncio.wait_for(h.detach, 30)
            assert h._take() and h.blocks
            hands.append(h)
        pinned = [list(h.blocks) for h in hands]
        before = kill(e)
        await restarted(e, before)
        filler = await asyncio.wait_for(collect(node, "filler", other), 60)  # takes blocks 0.. of the new pool
        ids_taken = asyncio.create_task(collect(node, "filler2", other))
        await wait_for(lambda: e.batcher.running)
        hands[0]._committed()  # the peer took r0: its old blocks must not be freed now
        with capture_logs() as logs:  # r1 goes on here: resumed, not readopted
            hands[1]._failed(DeviceDown(f"device {e.device_id} is down: killed under the gather"))
        # the device's death is not the peer's fault, and an expected case: a warning, no traceback
        assert hands[1].peer.failures == 0 and hands[1].peer.hold_until == 0.0
        assert [x["log_level"] for x in logs if x["event"].startswith("handoff_")] == ["warning"], logs
        runs[0].cancel()  # (r0 would relay from the peer: end it)
        r1_ids, r1_errors = await asyncio.wait_for(runs[1], 60)
        assert r1_errors == [] and r1_ids == case["output_token_ids"][:40]
        assert filler == (other["output_token_ids"][:40], []) and (await ids_taken) == filler
        assert any(pinned), "nothing was pinned"
        await wait_for(lambda: e.batcher.ledger.num_used == 0 and not e.batcher.running, 10)
        healthy(node)

    with_node(body, mode="colocated")


def _layout(node: Node):
    from node.transport.tensors import layout_of

    return layout_of(node.engines[0].runner.kv_cache, node.config.model_name)


def _offer(node: Node, case: dict, tid: str, streamed: int = 5):
    from node.transport.protocol import SeqState, TransferOffer

    tokens = case["prompt_token_ids"] + case["output_token_ids"][:streamed]
    st = SeqState(request_id=tid, seq_id=f"{tid}-0", token_ids=tokens, prompt_len=len(case["prompt_token_ids"]),
                  num_computed=len(tokens) - 1, max_len=len(case["prompt_token_ids"]) + 40,
                  sampling=msgspec.structs.asdict(GREEDY))
    nblocks = blocks_for(len(tokens), node.config.block_size)
    return TransferOffer(transfer_id=tid, layout=_layout(node), seq=st, num_blocks=nblocks, nbytes_per_layer=0,
                         relay=True)


def test_down_devices_take_no_peer_kv_and_are_not_advertised():
    """Item 3: with cpu:0's engine dead (and left down), the receiver neither advertises its blocks to
    peers nor reserves an offered sequence there, although, its sequences orphaned, it has the most
    free blocks."""
    from node.runtime.kv_receiver import KVReceiver

    async def body(node: Node):
        dead, live = node.engines
        recv = KVReceiver(node, _layout(node))
        kill(dead)
        await wait_for(lambda: dead.failure is not None)
        status = recv._status(1)
        assert status.kv_total_blocks == live.batcher.ledger.num_blocks and status.accepting
        assert status.kv_free_blocks == live.batcher.ledger.num_free
        blocks, _ = recv._reserve(_offer(node, CASES[0], "t"))
        assert recv.incoming["t"][0] is live
        recv._on_abort("t", "test")
        await asyncio.sleep(0.1)
        assert live.batcher.ledger.num_used == 0
        healthy(node)

    with_node(body, mode="colocated", devices=["cpu:0", "cpu:1"], engine_restart_max=0, peer_secret="s")


def test_a_restart_during_an_inbound_reservation_neither_frees_nor_adopts_the_old_blocks():
    """Two peer offers are reserved on the device; its engine dies and restarts, and a local request
    takes blocks of the new pool. The first transfer is then aborted (its reservation would be freed:
    the new request's blocks), the second finishes (it would be adopted with blocks holding nothing of
    it, and its arriving layers written into the new pool): neither happens. The finished one is
    recomputed instead and its relayed tokens equal the reference."""
    from node.runtime.kv_receiver import KVReceiver
    from node.transport.server import ReceiveReport

    case, other = CASES[0], CASES[1]

    async def body(node: Node):
        e = node.engines[0]
        recv = KVReceiver(node, _layout(node))
        offers = [_offer(node, case, f"t{i}") for i in range(2)]
        for o in offers:
            assert recv._reserve(o) is not None
        before = kill(e)
        await restarted(e, before)
        local = asyncio.create_task(collect(node, "local", other))
        await wait_for(lambda: e.batcher.running)
        recv._on_abort("t0", "the sender hung up")
        with pytest.raises(RuntimeError, match="restarted"):
            await recv._on_layer("t1", 0, bytearray())
        relay = recv._on_done("t1", ReceiveReport("t1", offers[1], [], "peer"))
        got = []
        async for msg in relay:
            got += getattr(msg, "token_ids", [])
        assert got == case["output_token_ids"][5:40]
        assert await asyncio.wait_for(local, 60) == (other["output_token_ids"][:40], [])
        await wait_for(lambda: e.batcher.ledger.num_used == 0, 10)
        healthy(node)

    with_node(body, mode="colocated", peer_secret="s")


def _gate_copies(monkeypatch) -> threading.Event:
    """In-node copies wait for the returned event before they copy (the copy is then "in flight")."""
    from node.runtime import moves

    gate, real = threading.Event(), moves.copy_sharded_blocks

    def gated(*args, **kw):
        gate.wait(60)
        return real(*args, **kw)

    monkeypatch.setattr(moves, "copy_sharded_blocks", gated)
    return gate



async def _decoding(node: Node, case: dict):
    """Start ``case`` as request ``r`` and wait for its first token: (its task, its sequence, the engine it
    decodes on, another engine)."""
    started = asyncio.Event()
    run = asyncio.create_task(collect(node, "r", case, started=started))
    await asyncio.wait_for(started.wait(), 60)
    seq = node.live["r"].seqs[0]
    src = node.engine(seq.device_id)
    return run, seq, src, next(x for x in node.engines if x is not src)

def test_a_destination_restarted_during_an_in_node_move_does_not_adopt_it(monkeypatch):
    """A move's copy is in flight when its destination's engine dies and comes back: the blocks it
    reserved there belong to the dead pool. The move fails, the sequence stays on its source and
    decodes on, greedy-exact; the destination's new ledger is untouched."""
    gate = _gate_copies(monkeypatch)
    case, other = CASES[0], CASES[1]

    async def body(node: Node):
        run, seq, src, dst = await _decoding(node, case)
        move = src.migrate(seq, dst, "test", overlap=True)
        await wait_for(lambda: src.moves.copying is not None)
        before = kill(dst)
        await restarted(dst, before)
        local = asyncio.create_task(collect(node, "local", other))
        await asyncio.sleep(0.2)
        gate.set()
        assert await asyncio.wait_for(move, 30) is None  # refused after the copy: dst was restarted
        assert await asyncio.wait_for(run, 60) == (case["output_token_ids"][:40], [])
        assert await asyncio.wait_for(local, 60) == (other["output_token_ids"][:40], [])
        await wait_for(lambda: all(x.batcher.ledger.num_used == 0 for x in node.engines), 10)
        healthy(node)

    with_node(body, mode="colocated", devices=["cpu:0", "cpu:1"])


def test_a_source_dying_mid_copy_aborts_the_copy_at_once_and_resumes_the_sequence():
    """Item 5: an overlapped copy over a slow link (about a minute) is in flight when its source's
    engine dies. The copy is aborted at once, so the restart is not held behind it; the sequence is
    resumed like the device's others and ends greedy-exact."""
    case = CASES[0]

    async def body(node: Node):
        run, seq, src, dst = await _decoding(node, case)
        layers = src.runner.kv_cache.shape[0]
        src.link_gbps = 0.01  # 1.25 MB/s
        src.block_layer_bytes = int(60 * 1.25e6 / (layers * len(seq.block_ids)))  # the copy takes ~60 s
        move = src.migrate(seq, dst, "test", overlap=True)
        await wait_for(lambda: src.moves.copying is not None)
        await asyncio.sleep(0.3)
        t0 = time.monotonic()
        before = kill(src)
        assert await asyncio.wait_for(move, 10) is None  # aborted: the sequence did not move
        assert await asyncio.wait_for(run, 60) == (case["output_token_ids"][:40], [])
        await restarted(src, before, timeout_s=40)
        assert time.monotonic() - t0 < 40, "the restart waited for the copy"
        src.link_gbps = src.block_layer_bytes = None
        await wait_for(lambda: all(x.batcher.ledger.num_used == 0 for x in node.engines), 10)
        healthy(node)

    with_node(body, mode="colocated", devices=["cpu:0", "cpu:1"])


def _killers(monkeypatch, marker: str = "killer") -> list[str]:
    """Make any engine die while it computes a step that holds a sequence whose id contains ``marker``
    (as a request that crashes a kernel would): the replies of the steps before it are delivered,
    that step's and later ones never are. Returns the list of killed steps' sequence ids."""
    from node.worker.engine_process import EngineProcess

    killed: list[str] = []
    submit, on_frame = EngineProcess.async_submit, EngineProcess._on_frame

    def async_submit(self, msg):
        fut = submit(self, msg)
        if any(marker in it.seq_id for it in msg.items):
            self._fatal_replies = getattr(self, "_fatal_replies", set()) | {fut}
            fut._test_seqs = [it.seq_id for it in msg.items]
        return fut

    def _on_frame(self, frame):
        if getattr(self, "_test_killed", False):
            return
        if self._waiting and self._waiting[0] in getattr(self, "_fatal_replies", ()):
            self._test_killed = True
            killed.append(self._waiting[0]._test_seqs)
            os.kill(self.process.pid, signal.SIGKILL)
            return
        on_frame(self, frame)

    monkeypatch.setattr(EngineProcess, "async_submit", async_submit)
    monkeypatch.setattr(EngineProcess, "_on_frame", _on_frame)
    return killed


def test_two_requests_that_kill_their_engine_fail_alone_and_leave_the_device_up(monkeypatch):
    """Item 4 on a one-device node (--engine-restart-max 2, --max-retries 1): two requests whose steps
    kill the engine run beside two ordinary ones. Each suspect is recomputed alone once; killing the
    engine again alone, it ends with 500 engine_crash. The bystanders are resumed after every death
    (three) without a retry charged, and end greedy-exact; the blamed restarts are not a crash loop,
    so the device serves afterwards."""
    killed = _killers(monkeypatch)

    async def body(node: Node):
        e = node.engines[0]
        good = [asyncio.create_task(collect(node, f"good{i}", CASES[i])) for i in range(2)]
        await asyncio.sleep(0.05)
        bad = [asyncio.create_task(collect(node, f"killer{i}", CASES[2])) for i in range(2)]
        for i, t in enumerate(good):
            assert await asyncio.wait_for(t, 120) == (CASES[i]["output_token_ids"][:40], [])
        for t in bad:
            _ids, errors = await asyncio.wait_for(t, 120)
            assert [(d.error_status, d.error_code) for d in errors] == [(500, "engine_crash")]
            assert "killed the engine again while it ran alone" in errors[0].error
        assert [len(k) for k in killed[1:]] == [1, 1]  # the deaths after the first: a suspect alone
        await wait_for(lambda: e.failure is None, 60)
        assert len(node.supervisor.recent(e.device_id)) == 1 and node.supervisor.total[e.device_id] == len(killed) == 3
        assert await asyncio.wait_for(collect(node, "after", CASES[0]), 60) == (CASES[0]["output_token_ids"][:40], [])
        healthy(node)

    with_node(body, mode="colocated", engine_restart_max=2, max_retries=1)


def test_a_revive_during_a_switch_pause_configures_the_role_being_taken():
    """Item 5: the engine dies while its device is in a role switch's pause (role SWITCHING, the new
    layout already set on the dead engine). The restarted engine is configured for the role being
    taken, not for SWITCHING (which configures nothing: the switch would end in the wrong layout)."""
    from node.core.roles import Role

    async def body(node: Node):
        e = node.engines[0]
        calls = []
        real = e.roles.reconfigure
        e.roles.reconfigure = lambda role: (calls.append(role), real(role))
        before = kill(e)
        await wait_for(lambda: e.failure is not None)
        target = Role.DECODE if e.role.role is not Role.DECODE else Role.PREFILL
        e.role.begin(target, time.monotonic())  # the switch's pause: the switch task itself is not needed here
        await restarted(e, before)
        assert calls == [target]

    with_node(body, mode="time-shared")


def test_blocks_reserved_for_nixl_writes_are_quarantined_after_an_abort():
    """Item 2: an offer accepted for NIXL writes (its blocks handed to the sender) ends in an abort or
    a hang-up: the sender's writes may still be in flight, so its blocks stay reserved for twice the
    transfer timeout (past any write's stall timeout), then are freed. An offer for a device whose
    pool is not registered (its engine died) is answered over TCP (no NIXL pool)."""
    from support import require_nixl

    require_nixl()
    case = CASES[0]

    async def body(node: Node):
        await node.start_network()
        e, recv, plane = node.engines[0], node.receiver, node.nixl
        offer = msgspec.structs.replace(_offer(node, case, "t"), nixl=True)
        blocks, _cached, pool = await recv._reserve_for_offer(offer)
        assert pool == 0
        t0 = time.monotonic()
        recv._on_abort("t", "the sender hung up")
        await asyncio.sleep(0.5)
        assert e.batcher.ledger.num_used == len(blocks)  # quarantined: a late write may still land
        await wait_for(lambda: e.batcher.ledger.num_used == 0, 10)
        assert time.monotonic() - t0 >= 2 * node.config.kv_transfer_timeout_s - 0.1
        plane.down.add(e.device_id)  # as while its engine is dead or restarting
        got = recv._reserve_for_offer(msgspec.structs.replace(offer, transfer_id="u"))
        assert isinstance(got, tuple) and len(got) == 2  # (blocks, cached): a TCP accept
        recv._on_abort("u", "test")
        await wait_for(lambda: e.batcher.ledger.num_used == 0, 10)
        healthy(node)

    with_node(body, mode="colocated", kv_port=0, kv_transport="nixl", peer_secret="s", kv_transfer_timeout_s=2.5)


def test_a_pooled_prompt_waits_for_its_prefill_devices_restart_instead_of_failing():
    """Found by the chaos run (bench/load/chaos.py): with the only prefill device's engine dead and its
    restart planned, the pooled router placed new prompts on it (it looked idle: nothing queued) and each
    failed at once with 503 ``engine_down``. A down prefill device takes no prompt now: they wait for the
    restart (within their deadline) and are served by the new engine, greedy-exact."""
    async def body(node: Node):
        pre = node.engine("cpu:0")
        before = kill(pre)
        await wait_for(lambda: pre.failure is not None)
        assert await asyncio.wait_for(collect(node, "r", CASES[0]), 120) == (CASES[0]["output_token_ids"][:40], [])
        assert pre.runner is not before and pre.failure is None  # prefilled by the restarted engine
        await wait_for(lambda: all(x.batcher.ledger.num_used == 0 for x in node.engines), 10)
        healthy(node)

    with_node(body, mode="pooled", prefill_devices=["cpu:0"], decode_devices=["cpu:1"])


def test_a_prefilled_sequence_whose_decode_device_died_goes_to_a_peer_instead_of_waiting(monkeypatch):
    """Found by the chaos run: a pooled node's prefilled sequence whose local decode device died during its
    copy waited on its prefill device for that device's restart (seconds to tens of seconds; killed again,
    until the request's deadline) although a decode peer had room. It goes to the peer now, greedy-exact."""
    from support import free_port
    from test_peers import SECRET, decode_node

    gate = _gate_copies(monkeypatch)
    case = CASES[0]
    port = free_port()
    peer = decode_node(port)

    async def body(node: Node):
        await node.start_network()
        await wait_for(lambda: node.peers.ready(time.monotonic()), 30)
        src, dst = node.engine("cpu:0"), node.engine("cpu:1")  # the router's pick: local first at equal room
        run = asyncio.create_task(collect(node, "r", case))
        await wait_for(lambda: src.moves.copying is not None)
        kill(dst)
        await wait_for(lambda: dst.failure is not None)
        gate.set()  # the copy goes on into the dead pool, and fails
        assert await asyncio.wait_for(run, 120) == (case["output_token_ids"][:40], [])
        assert sum(p.sent for p in node.peers.peers.values()) == 1  # decoded by the peer, not after the restart
        await wait_for(lambda: src.batcher.ledger.num_used == 0, 10)
        healthy(node)

    try:
        with_node(body, mode="pooled", prefill_devices=["cpu:0"], decode_devices=["cpu:1"],
                  peers=[f"127.0.0.1:{port}"], peer_secret=SECRET)
    finally:
        peer.close()
