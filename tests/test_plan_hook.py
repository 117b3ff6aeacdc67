"""A device engine runs its driver's pending decision round at the start of each pass of its step loop,
before it plans (``Driver.before_plan``), so a prompt that arrived while a step was in flight is placed in
the step planned next, as colocated mode adds it in the request's own callback, and not one step later
when the driver's task happens to run after the engine's step reply was handled."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from node.core.batcher import BatchConfig, Batcher
from node.core.ledger import BlockLedger
from node.core.sequence import SamplingParams
from node.runtime.driver import Driver
from node.runtime.engine import DeviceEngine
from node.runtime.request import RequestState
from node.worker.engine_core import StepReply
from node.worker.runner import SeqOutput

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here


class _Engine:
    """An engine in the node's process that records each step's sequences and answers only when told."""

    stopping = False
    kv_cache = None

    def __init__(self):
        self.steps: list[list[str]] = []  # each step's sequence ids
        self.replies: list[tuple[asyncio.Future, list[SeqOutput]]] = []  # unanswered steps, oldest first

    def stop(self) -> None:
        pass

    def async_submit(self, msg):
        self.steps.append([it.seq_id for it in msg.items])
        fut = asyncio.get_running_loop().create_future()
        self.replies.append((fut, [SeqOutput(5) if it.sample else SeqOutput() for it in msg.items]))
        return fut


class _Placing(Driver):
    """Places every pending request on the one device, in its decision round."""

    rounds = 0

    def tick(self) -> None:
        self.rounds += 1
        for req in self.pending:
            self.node.engines[0].add(req)
        self.pending.clear()


def _request(rid: str) -> RequestState:
    return RequestState(rid, [1, 2, 3], SamplingParams(max_tokens=8, ignore_eos=True), 1, None, [2], 64,
                        time.monotonic(), detokenize=False)


def test_a_prompt_kicked_in_during_a_step_is_placed_in_the_next_plan():
    async def go():
        runner = _Engine()
        engine = DeviceEngine("cpu:0", runner, Batcher(BlockLedger(64, 4), BatchConfig()), time.monotonic)
        driver = _Placing(SimpleNamespace(engines=[engine]), time.monotonic)
        driver.start()
        engine.start()
        driver.submit(_request("a"))
        for _ in range(50):  # the driver's task places "a"; the engine sends its steps and waits
            await asyncio.sleep(0)
        assert runner.steps and len(runner.replies) == 2  # two steps in flight (overlap), none answered
        # "b" arrives and, in the same callback, the oldest step's reply is ready: the engine resumes and
        # plans before the driver's task would run
        driver._task.cancel()  # (its own task cannot run at all: only the plan hook can place "b")
        await asyncio.sleep(0)
        driver.submit(_request("b"))
        fut, outs = runner.replies.pop(0)
        fut.set_result(StepReply(outs))
        for _ in range(20):
            await asyncio.sleep(0)
        planned_after = runner.steps[2]
        assert any(sid.startswith("b") for sid in planned_after), runner.steps
        assert not driver._event.is_set()  # the kick was taken by that round
        for fut, outs in runner.replies:
            fut.set_result(StepReply(outs))
        await engine.stop(grace_s=0)

    asyncio.run(go())


def test_the_drivers_task_does_not_repeat_a_round_a_plan_has_run():
    """A kick wakes the driver's task; when a device's plan runs the round first, the task, woken by
    that same kick, does not run a second one (it would find nothing new: a snapshot for nothing)."""

    async def go():
        engine = SimpleNamespace(plan_hooks=[], batcher=SimpleNamespace(running=[], waiting=[]))
        driver = _Placing(SimpleNamespace(engines=[engine]), time.monotonic)
        driver.start()
        for _ in range(5):
            await asyncio.sleep(0)
        assert driver.rounds == 1  # its first round at start
        driver.kick()  # the task's waiter is woken now...
        engine.plan_hooks[0]()  # ...but a device plans first and runs the round
        assert driver.rounds == 2
        for _ in range(5):
            await asyncio.sleep(0)
        assert driver.rounds == 2
        driver.kick()  # a kick no plan takes: the task runs it
        for _ in range(5):
            await asyncio.sleep(0)
        assert driver.rounds == 3
        await driver.stop()

    asyncio.run(go())
