"""DeviceEngine's parts alone: each is built from what its constructor names (a ledger, a role, a batcher,
callbacks), with no engine and no node, and owns its state (issue 47, item 5)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest

from node.core.batcher import BatchConfig, Batcher, StepKind
from node.core.ledger import BlockLedger, LedgerError
from node.core.role_config import RoleConfig
from node.core.roles import Role
from node.core.sequence import SamplingParams, Sequence
from node.runtime.block_pins import BlockPins
from node.runtime.engine_roles import RoleSwitcher
from node.runtime.moves import KVMover
from node.runtime.switching import DeviceRole, SwitchAbandoned

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
