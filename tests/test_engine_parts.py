"""DeviceEngine's parts alone: each is built from what its constructor names (a ledger, a role, a batcher,
other parts, callbacks), with no engine and no node, and owns its state (issue 47, item 5)."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from node.core.batcher import BatchConfig, Batcher, StepKind
from node.core.ledger import BlockLedger, LedgerError
from node.core.quarantine import Quarantine
from node.core.role_config import RoleConfig
from node.core.roles import Role
from node.core.sequence import SamplingParams, Sequence
from node.runtime.block_pins import BlockPins
from node.runtime.engine_residents import Residents
from node.runtime.engine_revival import Revival
from node.runtime.engine_roles import RoleSwitcher
from node.runtime.moves import KVMover
from node.runtime.request import RequestState
from node.runtime.switching import DeviceRole, SwitchAbandoned
from node.runtime.worker_jobs import WorkerJobs
from node.worker.engine_process import EngineDied

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here


def test_block_pins_count_pins_and_drop_the_stale_after_a_new_incarnation():
    ledger = BlockLedger(8, 4)
    pins = BlockPins("cpu:0", lambda: ledger)
    blocks = ledger.allocate(2)
    first = pins.pin(blocks)
    second = pins.pin(list(blocks))  # a second transfer holds the same blocks: two pins, one reference
    assert first.incarnation == 0 and not pins.is_stale(first)
    with pytest.raises(LedgerError):
        pins.check([])  # pinned twice, referenced once
    assert pins.unpin(second)
    pins.check([])  # one pin, one reference
    pins.new_incarnation()
    assert pins.incarnation == 1 and pins.is_stale(first)
    free_before = ledger.num_free
    pins.release(first)  # pinned before the revive: names the dead pool, so nothing is freed
    assert ledger.num_free == free_before


def test_block_pins_release_frees_into_the_ledger_of_now():
    ledgers = [BlockLedger(8, 4)]
    pins = BlockPins("cpu:0", lambda: ledgers[-1])
    blocks = pins.pin(ledgers[-1].allocate(3))
    free_before = ledgers[-1].num_free
    pins.release(blocks)
    assert ledgers[-1].num_free == free_before + 3
    pins.check([])


class _Runner:
    """The part of a device's engine a role switch touches."""

    def __init__(self):
        self.stopping = False
        self.calls: list[str] = []

    def set_role(self, role: str) -> None:
        self.calls.append(f"set_role:{role}")

    def prepare_decode(self) -> None:
        self.calls.append("prepare_decode")


def _switcher(role: Role, failure: str | None = None, executor=None):
    batcher = Batcher(BlockLedger(16, 4), BatchConfig(max_batched_tokens=64))
    runner, woken, reported, errors = _Runner(), [], [], []
    part = RoleSwitcher("cpu:0", DeviceRole("cpu:0", role, 0.0, pause_floor_s=0.0), batcher, lambda: 0.0,
                        lambda: runner, executor, asyncio.Event(), lambda: failure, lambda: woken.append(1),
                        reported.append, errors.append)
    return part, batcher, runner, woken, reported, errors


def test_role_switcher_owns_the_role_its_configurations_and_the_chunk_budget():
    part, batcher, _runner, woken, _reported, _errors = _switcher(Role.DECODE)
    configs = {Role.PREFILL: RoleConfig("prefill", token_budget=32), Role.DECODE: RoleConfig("decode")}
    part.configure_roles(configs, BatchConfig(max_batched_tokens=64), kv_bytes_per_token=8)
    assert batcher.config.max_batched_tokens == 64  # the decode role's limits
    assert part.step_kind() is StepKind.DECODE and part.active_config is configs[Role.DECODE]
    part.switch_free(Role.MIXED, "test")
    assert part.role.role is Role.MIXED and part.step_kind() is StepKind.MIXED and woken
    part.set_chunk_budget(48)
    assert part.chunk_budget(StepKind.MIXED) == 48 and part.chunk_budget(StepKind.DECODE) is None
    with pytest.raises(ValueError):
        part.switch_free(Role.PREFILL, "not free")


def test_role_switcher_reconfigures_through_the_runner_it_was_given():
    async def body():
        with ThreadPoolExecutor(max_workers=1) as executor:
            part, batcher, runner, _woken, reported, _errors = _switcher(Role.PREFILL, executor=executor)
            configs = {Role.PREFILL: RoleConfig("prefill", token_budget=32), Role.DECODE: RoleConfig("decode")}
            part.configure_roles(configs, BatchConfig(max_batched_tokens=64), kv_bytes_per_token=8)
            assert batcher.config.max_batched_tokens == 32  # the prefill role's step budget
            part._idle.set()  # no step in flight
            record = await part.switch_role(Role.DECODE, "test")
        assert runner.calls == ["set_role:decode", "prepare_decode"]
        assert part.role.role is Role.DECODE and batcher.config.max_batched_tokens == 64
        assert reported == [record] and record.to_role == "decode"

    asyncio.run(body())


def test_role_switcher_abandons_a_switch_of_a_down_device():
    async def body():
        part, _batcher, runner, _woken, reported, _errors = _switcher(Role.PREFILL, failure="engine died")
        part._idle.set()
        with pytest.raises(SwitchAbandoned, match="engine died"):
            await part.switch_role(Role.DECODE, "test")
        assert part.role.role is Role.PREFILL and runner.calls == [] and reported == []

    asyncio.run(body())


class _Home:
    """A device that holds no movable sequence (every move from it is refused)."""

    device_id, failure, incarnation, up, down_reason, kv_pools = "cpu:0", None, 0, True, None, []

    def movable(self, seq):
        return None


def test_kv_mover_refuses_a_move_of_a_sequence_not_decoding_at_home():
    async def body():
        woken = []
        mover = KVMover(_Home(), lambda: 0.0, None, lambda: woken.append(1), lambda *a: None)
        seq = Sequence("s0", "r0", 0, 0.0, [1, 2, 3, 4, 5], SamplingParams(max_tokens=4), max_model_len=64)
        seq.num_computed = 5
        fut = mover.migrate(seq, _Home(), "test")
        assert mover.queued and mover.outgoing_tokens == 5 and woken
        assert mover.destinations == ["cpu:0"]  # GET /v1/node's kv_moves_out: the move is not done
        await mover.apply_blocking()
        assert await fut is None and not mover.queued and mover.outgoing_tokens == 0 and mover.destinations == []

    asyncio.run(body())


class _Stream:
    """A request's stream that keeps what it is sent."""

    def __init__(self):
        self.deltas = []

    def push(self, delta) -> None:
        self.deltas.append(delta)


def _request(rid: str, n: int = 1) -> RequestState:
    return RequestState(rid, [1, 2, 3, 4, 5], SamplingParams(max_tokens=4), n, None, [0], 64, 0.0,
                        stream=_Stream(), detokenize=False)


def _residents(down: list[str | None] | None = None):
    """Residents of a 16-block device; ``down[0]``: why the device is down (None: up)."""
    down = down if down is not None else [None]
    batcher = Batcher(BlockLedger(16, 4), BatchConfig(max_batched_tokens=64))
    pins = BlockPins("cpu:0", lambda: batcher.ledger)
    woken, lost = [], []
    part = Residents("cpu:0", batcher, pins, Quarantine(), lambda: woken.append(1), lambda: down[0],
                     lambda req, index: lost.append((req.request_id, index)))
    return part, batcher, pins, woken, lost


def _decoding(req: RequestState, batcher: Batcher, pins: BlockPins) -> Sequence:
    """``req``'s first sequence, decoding (its prompt computed, one token sampled) in pinned blocks of the ledger."""
    seq = req.seqs[0]
    seq.token_ids.append(7)
    seq.num_computed = len(seq.token_ids) - 1
    seq.block_ids = pins.pin(batcher.ledger.allocate(2))
    return seq


def test_residents_own_the_requests_and_apply_aborts_between_steps():
    part, batcher, _pins, woken, _lost = _residents()
    req = _request("r0", n=2)
    part.add(req)
    assert part.requests == {"r0": req} and set(part.by_seq) == {"r0-0", "r0-1"} and woken
    assert len(batcher.waiting) == 2 and all(s.device_id == "cpu:0" for s in req.seqs)
    part.abort("r0")
    assert part.requests == {"r0": req}  # queued: applied at the next step boundary
    part.apply_aborts()
    assert part.requests == {} and part.by_seq == {} and not batcher.waiting


def test_residents_detach_a_decoding_sequence_with_its_blocks_pinned():
    async def body():
        part, batcher, pins, _woken, _lost = _residents()
        req = _request("r1")
        seq = _decoding(req, batcher, pins)
        part.adopt(req, 0, seq)
        assert seq in batcher.running and part.movable(seq) == (req, 0)
        fut = part.detach(seq)
        assert part.detaches_queued and not fut.done()
        part.apply_detaches()
        got_req, index, blocks = fut.result()
        assert got_req is req and index == 0 and len(blocks) == 2 and not pins.is_stale(blocks)
        assert part.requests == {} and seq not in batcher.running
        part.check_ownership()  # the detached blocks are held by their pins alone
        pins.release(blocks)
        assert batcher.ledger.num_free == 16

    asyncio.run(body())


def test_a_down_device_refuses_arrivals_and_hands_adoptions_to_lost():
    async def body():
        down = ["engine died"]
        part, batcher, pins, _woken, lost = _residents(down)
        req = _request("r2")
        part.add(req)
        delta = req.stream.deltas[-1]
        assert part.requests == {} and delta.error_status == 503 and delta.error_code == "engine_down"
        assert (await part.detach(req.seqs[0])) is None
        down[0] = None  # back up, but the blocks were pinned before a restart: they name the dead pool
        other = _request("r3")
        seq = _decoding(other, batcher, pins)
        pins.new_incarnation()
        part.adopt(other, 0, seq)
        assert lost == [("r3", 0)] and part.requests == {} and seq not in batcher.running

    asyncio.run(body())


def test_worker_jobs_run_in_order_on_the_worker_and_fail_once_the_device_is_down():
    async def body():
        down, woken = [None], []
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="worker-test") as executor:
            jobs = WorkerJobs("cpu:0", executor, lambda: down[0], lambda: woken.append(1))
            first = jobs.submit(lambda: threading.current_thread().name)
            failing = jobs.submit(lambda: 1 / 0)
            freed = []
            jobs.after_queued(lambda: freed.append(1))
            assert jobs.queued and len(woken) == 3 and not freed
            await jobs.run_queued()
            await asyncio.sleep(0)  # the after_queued callback runs on the loop
            assert first.result().startswith("worker-test") and freed == [1] and not jobs.queued
            with pytest.raises(ZeroDivisionError):
                failing.result()
            stranded = jobs.submit(lambda: None)
            down[0] = "engine died"
            jobs.fail_queued()
            with pytest.raises(RuntimeError, match="engine died"):
                stranded.result()
            with pytest.raises(RuntimeError, match="is down"):
                jobs.submit(lambda: None).result()

    asyncio.run(body())


def test_after_queued_on_a_down_device_runs_then_and_leaves_no_unretrieved_failure():
    """``free_pinned`` on a device that died (a hand-off's blocks, a receiver's aborted reservation) goes through
    ``after_queued``, whose future fails at once; nobody keeps that future, so unless ``after_queued`` takes the
    failure itself asyncio logs "Future exception was never retrieved" when it is collected (the chaos run
    found those lines in both nodes' logs)."""
    import gc

    async def body():
        seen: list[dict] = []
        asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: seen.append(ctx))
        with ThreadPoolExecutor(max_workers=1) as executor:
            down = [None]
            jobs = WorkerJobs("cpu:0", executor, lambda: down[0], lambda: None)
            freed = []
            jobs.after_queued(lambda: freed.append("queued"))  # queued, then failed by the death
            down[0] = "engine process of cpu:0 (pid 1) was killed by signal 9"
            jobs.fail_queued()
            jobs.after_queued(lambda: freed.append("down"))  # the device is down already: fails at once
            for _ in range(3):
                await asyncio.sleep(0)
            assert freed == ["queued", "down"]
        gc.collect()
        await asyncio.sleep(0)
        assert not [c for c in seen if "never retrieved" in c.get("message", "")], seen

    asyncio.run(body())


class _Loop:
    """The step loop revival drives: records what it is asked."""

    device_id = "cpu:0"

    def __init__(self, runner):
        self.runner, self.calls, self.dying = runner, [], None

    def start(self):
        self.calls.append("start")

    def wake(self):
        pass

    def dying_step(self):
        return self.dying

    def drop_steps(self):
        self.calls.append("drop_steps")

    def serve_on(self, runner):
        self.runner = runner
        self.calls.append("serve_on")

    def notify_down(self):
        self.calls.append("down")


class _FreshEngine:
    """An engine as revival sees it: its pool's size, and whether the node is stopping it."""

    def __init__(self, num_blocks: int):
        self.num_blocks, self.stopping = num_blocks, False


def test_revival_hands_the_sequences_of_a_dead_engine_on_and_revives_on_a_fresh_one():
    async def body():
        with ThreadPoolExecutor(max_workers=1) as executor:
            loop = _Loop(_FreshEngine(16))
            part, batcher, pins, _woken, _lost = _residents()
            quarantine = Quarantine()
            jobs = WorkerJobs("cpu:0", executor, lambda: revival.failure, lambda: None)
            moves = KVMover(_Home(), lambda: 0.0, executor, lambda: None, lambda *a: None)
            roles = RoleSwitcher("cpu:0", None, batcher, lambda: 0.0, lambda: loop.runner, executor, asyncio.Event(),
                                 lambda: revival.failure, lambda: None, lambda rec: None, lambda stage: None)
            revival = Revival(loop, batcher, part, pins, quarantine, moves, jobs, roles, executor)
            orphans = []
            revival.orphan_listener = lambda device, req, index: orphans.append((device, req.request_id, index))
            req = _request("r4")
            part.add(req)
            job = jobs.submit(lambda: None)

            async def dies():
                raise EngineDied("engine process exited (SIGKILL)")

            task = asyncio.get_running_loop().create_task(dies())
            with pytest.raises(EngineDied):
                await task
            revival.on_loop_done(task)
            assert revival.failure == "engine process exited (SIGKILL)" and revival.engine_died and not revival.up
            assert orphans == [(loop, "r4", 0)] and part.requests == {} and revival.fatal == {}
            assert loop.calls == ["drop_steps", "down"]
            with pytest.raises(RuntimeError, match="is down"):
                job.result()
            await revival.revive(_FreshEngine(32))
            assert revival.up and revival.failure is None and not revival.engine_died
            assert batcher.ledger.num_blocks == 32 and pins.incarnation == 1
            assert loop.calls[-2:] == ["serve_on", "start"] and loop.runner.num_blocks == 32

    asyncio.run(body())
