"""The role policy a node starts with plans a tensor-parallel group as the group runs, and keeps doing
so as the node refits its cost model (issue 33, item 5). No node is started."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest

from node.config import NodeConfig
from node.core.cost import CostModel
from node.core.group_cost import GroupCost
from node.runtime.role_driver import RoleDriver
from node.runtime.role_policy import DEFAULT_CPU_COST, role_scheduler

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here

DEVICES = ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]


def test_a_group_of_four_prefill_instances_plans_with_the_group_step():
    config = NodeConfig(mode="time-shared", devices=DEVICES, decode_tp=4, prefill_tp=1, max_num_batched_tokens=512,
                        reconfig_pause_ms=3.0)
    s = role_scheduler(config)
    assert s.config.prefill_token_budget == 2048  # the group's PREFILL step: 4 instances of 512 tokens
    assert isinstance(s.cost, GroupCost) and s.cost.instances == 4
    assert s.cost.prefill == msgspec.structs.replace(DEFAULT_CPU_COST, pause_s=0.003) and s.pause_s == 0.003
    assert s.prefill_s(2048) == pytest.approx(DEFAULT_CPU_COST.prefill_step_s(512))


def test_one_instance_plans_with_its_own_budget():
    for devices, d, p in ((DEVICES[:1], 1, 1), (DEVICES[:2], 2, 2)):
        s = role_scheduler(NodeConfig(mode="adaptive", devices=devices, decode_tp=d, prefill_tp=p,
                                      max_num_batched_tokens=512))
        assert s.config.prefill_token_budget == 512 and isinstance(s.cost, CostModel)


def test_a_groups_refit_fits_the_longest_instance_and_keeps_the_group():
    config = NodeConfig(mode="time-shared", devices=DEVICES[:2], decode_tp=2, prefill_tp=1, max_num_batched_tokens=256)
    node = SimpleNamespace(config=SimpleNamespace(imbalance_threshold=0.0, link_gbps=0.0), engines=[])
    driver = RoleDriver(node, role_scheduler(config), lambda: 0.0)
    for n in (64, 128, 256):  # per instance: 1 ms + 10 us a token
        driver._prefill.append((n, 0.001 + 1e-5 * n))
    driver._pauses.append(0.02)
    driver.refit()
    cost = driver.scheduler.cost
    assert isinstance(cost, GroupCost) and cost.instances == 2 and cost.pause_s == pytest.approx(0.02)
    assert cost.prefill.prefill_per_token_s == pytest.approx(1e-5) and cost.prefill is cost.decode
    assert driver.imbalance.cost is cost
    assert driver.measured_pause_s == pytest.approx(0.02)


def test_one_configuration_refits_prompt_costs_on_the_decode_fixed_cost():
    """A node whose prompt and decode steps are one forward configuration (same degree, no decode graphs:
    the CPU node) refits its prompt costs on the decode fixed cost: prompt-chunk shares 3 ms above it by
    noise give no mixed-step penalty (the adaptive policy would hold prompts for it)."""
    config = NodeConfig(mode="adaptive", devices=DEVICES[:1])
    roles = config.role_configs()
    assert not roles["decode"].cuda_graphs and roles["prefill"].tp_degree == roles["decode"].tp_degree
    node = SimpleNamespace(config=SimpleNamespace(imbalance_threshold=0.0, link_gbps=0.0), engines=[])
    for one, penalty in ((False, 0.003), (True, 0.0)):
        driver = RoleDriver(node, role_scheduler(config), lambda: 0.0, one_configuration=one)
        for s, k in ((1, 40), (4, 300), (16, 900), (32, 2500), (8, 100)):
            driver._decode.append((0, s, k, 0.002 + 5e-5 * s + 1e-6 * k))
        for n in (32, 64, 96, 128):
            driver._prefill.append((n, 0.005 + 2e-5 * n))
        driver.refit()
        cost = driver.scheduler.cost
        assert cost.prefill_fixed_s - cost.decode_fixed_s == pytest.approx(penalty, abs=1e-6)


def test_the_adaptive_driver_skips_the_snapshot_while_every_device_only_decodes():
    """The snapshot walks every sequence of the node; at each step's end of a decode-only node the adaptive
    policy would decide nothing (AdaptiveScheduler.quiet_when_decoding), so the driver does not build it,
    nor for a device left in MIXED once its prompts are computed (AdaptiveScheduler.quiet_decisions)."""
    from node.core.roles import Role

    class Built(Exception):
        pass

    def snapshot(now):
        raise Built

    from node.core.batcher import Batcher

    decoding = SimpleNamespace(is_decoding=True)
    batcher = SimpleNamespace(running=[decoding] * 3, waiting=[])
    batcher.has_work = lambda kind: Batcher.has_work(batcher, kind)
    engine = SimpleNamespace(device_id="cpu:0", failure=None, batcher=batcher, role=SimpleNamespace(role=Role.DECODE),
                             step_listeners=[], switch_listeners=[], migration_listeners=[], compile_listeners=[])
    node = SimpleNamespace(config=SimpleNamespace(imbalance_threshold=0.0, link_gbps=0.0), engines=[engine],
                           draining=False)
    driver = RoleDriver(node, role_scheduler(NodeConfig(mode="adaptive", devices=DEVICES[:1])), lambda: 0.0)
    driver.snapshot = snapshot
    driver.tick()  # quiet: no snapshot
    assert not driver.needs_timer()  # residents, but nothing to decide with time alone: kicks only
    ended = SimpleNamespace(request_id="e", seqs=[SimpleNamespace(seq_id="e-0")])
    driver.finished(ended, ["length"], 5)
    assert not driver._due  # a resident's end leaves a quiet node quiet: no round for it
    for change in (lambda: batcher.running.append(SimpleNamespace(is_decoding=False)),  # a prompt in progress
                   lambda: batcher.waiting.append(object()),  # a prompt queued on the device
                   lambda: driver.pending.append(object()),  # a prompt not yet placed
                   lambda: setattr(engine.role, "role", Role.PREFILL)):  # a window
        change()
        with pytest.raises(Built):
            driver.tick()
        assert driver.needs_timer()  # not quiet: urgency grows with age
        driver.finished(ended, ["length"], 5)
        assert driver._due  # and an end may let a prompt in: a round
        driver._due = False
        batcher.running[3:], batcher.waiting[:], driver.pending[:], engine.role.role = [], [], [], Role.DECODE
        driver.tick()
    # a device still in MIXED after its last prompt chunk: back to DECODE as decide() would, no snapshot
    switches = []
    engine.switch_free = lambda role, reason: (switches.append((role, reason)), setattr(engine.role, "role", role))
    node.engine = lambda device_id: {"cpu:0": engine}[device_id]
    engine.role.role = Role.MIXED
    driver.tick()
    assert switches == [(Role.DECODE, "nothing_waits")] and not driver.needs_timer()
    assert driver.scheduler._mixed_s["cpu:0"] == 0.0  # gathering counts from this last MIXED instant
    # the two-role policy parks idle devices in PREFILL: it always decides
    driver = RoleDriver(node, role_scheduler(NodeConfig(mode="time-shared", devices=DEVICES[:1])), lambda: 0.0)
    driver.snapshot = snapshot
    with pytest.raises(Built):
        driver.tick()


def test_a_device_that_mixes_every_step_refits_its_decode_terms_from_the_mixed_steps():
    """A CPU node (one configuration) whose device runs mixed steps only, on a virtual clock: each step
    is 1.5 ms + 80 us a sequence + 0.5 us a context token + 15 us a prompt token, while the model starts at
    the CPU defaults (2 ms, 100 us a sequence, nothing per context token, 20 us a prompt token). The
    refits fit decode and mixed steps jointly, so the decode terms are learnt from the mixed steps (before,
    the decode part was refitted from decode steps alone, none here, and each mixed step's prompt share was
    its time less the current model's decode cost: the model's own error, fed back into its samples)."""
    from node.core.batcher import StepKind
    from node.core.roles import Role
    from node.runtime.role_driver import REFIT_EVERY

    true = CostModel(prefill_fixed_s=0.0015, prefill_per_token_s=1.5e-5, decode_fixed_s=0.0015, decode_per_seq_s=8e-5,
                     decode_per_context_token_s=5e-7)
    clock = [0.0]
    engine = SimpleNamespace(device_id="cpu:0", failure=None, role=SimpleNamespace(role=Role.MIXED),
                             batcher=SimpleNamespace(running=[], waiting=[], has_work=lambda kind: True),
                             step_listeners=[], switch_listeners=[], migration_listeners=[], compile_listeners=[])
    node = SimpleNamespace(config=SimpleNamespace(imbalance_threshold=0.0, link_gbps=0.0), engines=[engine], draining=False)
    driver = RoleDriver(node, role_scheduler(NodeConfig(mode="adaptive", devices=DEVICES[:1])), lambda: clock[0],
                        one_configuration=True)
    assert driver.scheduler.cost.decode_per_context_token_s == 0.0
    for i in range(40 * REFIT_EVERY):
        b, ctx, prompt = 2 + i % 7, 100 + (i * 37) % 400, 8 + (i * 13) % 57
        items = [SimpleNamespace(seq=SimpleNamespace(num_computed=ctx, num_output=3), num_tokens=1) for _ in range(b)]
        items.append(SimpleNamespace(seq=SimpleNamespace(num_computed=0, num_output=0), num_tokens=prompt))
        seconds = true.mixed_step_s(prompt, b, b * ctx)
        clock[0] += max(seconds, 0.02)  # refits at least REFIT_MIN_S apart
        driver._on_step(engine, SimpleNamespace(kind=StepKind.MIXED, items=items, preempted=[],
                                                num_tokens=b + prompt), seconds)
    cost = driver.scheduler.cost
    for field in ("decode_fixed_s", "decode_per_seq_s", "decode_per_context_token_s", "prefill_per_token_s"):
        assert getattr(cost, field) == pytest.approx(getattr(true, field), rel=0.02), field


def test_refits_are_at_most_every_refit_min_s_and_quiet_decode_steps_do_not_kick():
    """A refit holds the event loop ~2.5 ms: in adaptive mode at most one per REFIT_MIN_S however short the steps. On a
    quiet node (the last tick found nothing to decide) a decode step that preempted nothing does not wake
    the driver; one that preempted does."""
    import asyncio

    from node.core.batcher import StepKind
    from node.core.roles import Role
    from node.runtime.role_driver import REFIT_EVERY, REFIT_MIN_S

    async def run():
        clock = [0.0]
        from node.core.batcher import Batcher

        batcher = SimpleNamespace(running=[SimpleNamespace(is_decoding=True)], waiting=[])
        batcher.has_work = lambda kind: Batcher.has_work(batcher, kind)
        engine = SimpleNamespace(device_id="cpu:0", failure=None, role=SimpleNamespace(role=Role.DECODE),
                                 batcher=batcher, step_listeners=[], switch_listeners=[], migration_listeners=[], compile_listeners=[])
        node = SimpleNamespace(config=SimpleNamespace(imbalance_threshold=0.0, link_gbps=0.0), engines=[engine],
                               draining=False)
        driver = RoleDriver(node, role_scheduler(NodeConfig(mode="adaptive", devices=DEVICES[:1])), lambda: clock[0])
        refits = []
        driver.refit = lambda: refits.append(clock[0])
        plan = lambda preempted=(): SimpleNamespace(kind=StepKind.DECODE, preempted=list(preempted),  # noqa: E731
                                                    items=[SimpleNamespace(seq=SimpleNamespace(num_computed=9), num_tokens=1)])
        for _ in range(3 * REFIT_EVERY):  # 96 steps within 3 ms
            clock[0] += 1e-5
            driver._on_step(engine, plan(), 1e-5)
        assert len(refits) == 1
        clock[0] += REFIT_MIN_S
        for _ in range(REFIT_EVERY):
            driver._on_step(engine, plan(), 1e-5)
        assert len(refits) == 2
        driver.tick()  # quiet: every device decodes, nothing waits
        driver._due = False
        driver._on_step(engine, plan(), 1e-5)
        assert not driver._due
        driver._on_step(engine, plan([object()]), 1e-5)
        assert driver._due and not driver._event.is_set()  # for the engine's next plan: the task sleeps on

    asyncio.run(run())


def test_the_expected_output_is_the_mean_of_the_recent_natural_ends():
    """Driver.expected_output keeps a running sum of its last SAMPLES outputs (a snapshot asks once per
    resident): the mean of the recent requests that stopped on their own, plus one, capped by max_tokens."""
    import random

    from node.runtime.driver import DEFAULT_EXPECTED_OUTPUT, SAMPLES

    node = SimpleNamespace(config=SimpleNamespace(imbalance_threshold=0.0, link_gbps=0.0), engines=[])
    driver = RoleDriver(node, role_scheduler(NodeConfig(mode="adaptive", devices=DEVICES[:1])), lambda: 0.0)
    req = lambda n=1, max_tokens=10_000: SimpleNamespace(  # noqa: E731
        request_id="r", seqs=[SimpleNamespace(seq_id=f"r-{i}") for i in range(n)], params=SimpleNamespace(max_tokens=max_tokens))
    assert driver.expected_output(req()) == DEFAULT_EXPECTED_OUTPUT
    rng = random.Random(2)
    seen = []
    for i in range(3 * SAMPLES):
        n, out = rng.choice((1, 2)), rng.randrange(1, 900)
        driver.finished(req(n), ["stop" if i % 5 else "length"] * n, out * n)
        if i % 5:
            seen.append(max(1, out))
        if len(seen) >= 8:
            recent = seen[-SAMPLES:]
            assert driver.expected_output(req()) == int(sum(recent) / len(recent)) + 1
    assert driver.expected_output(req(max_tokens=3)) == 3


def test_a_mixing_device_step_end_after_a_fresh_round_does_not_kick():
    """In adaptive mode the end of a step of a device in MIXED, with prompt work queued and nothing waiting
    to be placed, makes no decision round when a full round ran since the device's last step end (that
    round saw the step's tokens); without such a round, or once the queue has drained, or with a prompt
    waiting, or when the step preempted, it does."""
    import asyncio

    from node.core.batcher import Batcher, StepKind
    from node.core.roles import Role

    async def run():
        prompt = SimpleNamespace(is_decoding=False)
        batcher = SimpleNamespace(running=[SimpleNamespace(is_decoding=True), prompt], waiting=[])
        batcher.has_work = lambda kind: Batcher.has_work(batcher, kind)
        engine = SimpleNamespace(device_id="cpu:0", failure=None, role=SimpleNamespace(role=Role.MIXED),
                                 batcher=batcher, step_listeners=[], switch_listeners=[], migration_listeners=[], compile_listeners=[])
        node = SimpleNamespace(config=SimpleNamespace(imbalance_threshold=0.0, link_gbps=0.0), engines=[engine],
                               draining=False)
        driver = RoleDriver(node, role_scheduler(NodeConfig(mode="adaptive", devices=DEVICES[:1])), lambda: 0.0)
        driver.refit = lambda: None
        driver.snapshot = lambda now: (_ for _ in ()).throw(AssertionError("no round expected"))
        def kicked(preempted=()):
            driver._due = False
            plan = SimpleNamespace(kind=StepKind.MIXED, preempted=list(preempted), items=[], num_tokens=0)
            driver._on_step(engine, plan, 1e-3)
            return driver._due

        assert kicked()  # the first step end: no round seen yet
        assert kicked()  # no full round since the last step end
        driver._rounds += 1  # a full round (the arrival's) ran during the next step's flight
        assert not kicked()
        assert kicked()  # and the one after kicks again
        for change, undo in ((lambda: driver.pending.append(object()), lambda: driver.pending.clear()),
                             (lambda: batcher.running.remove(prompt), lambda: batcher.running.append(prompt)),
                             (lambda: setattr(engine.role, "role", Role.DECODE), lambda: setattr(engine.role, "role", Role.MIXED))):
            driver._rounds += 1
            change()
            assert kicked()
            undo()
        driver._rounds += 1
        assert kicked(preempted=[object()])

    asyncio.run(run())


def test_a_resting_driver_still_looks_at_the_node_now_and_then():
    """A quiet adaptive driver waits for kicks, but with sequences resident it also wakes every RESTING_TICK_S:
    prompt work queued on a device by a path that forgot to kick is decided on within that, not never. On a
    virtual clock (tests/virtual_time.py): the round comes exactly one RESTING_TICK_S after the driver went
    quiet, however loaded the machine is."""
    import asyncio

    from node.core.batcher import Batcher
    from node.core.roles import Role
    from node.runtime.driver import RESTING_TICK_S
    from virtual_time import run_virtual

    async def run():
        loop = asyncio.get_running_loop()
        batcher = SimpleNamespace(running=[SimpleNamespace(is_decoding=True)], waiting=[])
        batcher.has_work = lambda kind: Batcher.has_work(batcher, kind)
        engine = SimpleNamespace(device_id="cpu:0", failure=None, role=SimpleNamespace(role=Role.DECODE), batcher=batcher,
                                 plan_hooks=[], step_listeners=[], switch_listeners=[], migration_listeners=[], compile_listeners=[])
        node = SimpleNamespace(config=SimpleNamespace(imbalance_threshold=0.0, link_gbps=0.0), engines=[engine],
                               draining=False)
        driver = RoleDriver(node, role_scheduler(NodeConfig(mode="adaptive", devices=DEVICES[:1])), lambda: 0.0)
        snapshots = []  # the loop's clock at each round's snapshot
        looked = asyncio.Event()
        driver.snapshot = lambda now: (snapshots.append(loop.time()), looked.set(),
                                       (_ for _ in ()).throw(RuntimeError("stop here")))
        driver.start()
        await asyncio.sleep(RESTING_TICK_S / 10)
        assert driver._quiet and not snapshots  # every device decodes, nothing waits (its first round ran at 0)
        batcher.waiting.append(object())  # prompt work appears, and nobody kicks
        async with asyncio.timeout(RESTING_TICK_S * 10):  # a driver without the resting timer: TimeoutError
            await looked.wait()
        # the resting timer found it (the round itself is cut short by the fake snapshot), one resting tick
        # after the quiet round at 0
        assert snapshots == [pytest.approx(RESTING_TICK_S, abs=1e-6)]
        await driver.stop()

    run_virtual(run())


def test_a_device_ordered_to_switch_shows_switching_before_its_switch_task_begins():
    """A switch to PREFILL is ordered in a round; its task (``DeviceEngine.switch_role``) begins a loop
    iteration later. A round in between (another device's plan) sees the device switching to PREFILL, not
    in DECODE: otherwise it forgot a hand-off window and could send a move or chunks into the window
    (found by a helper's review). Once the engine is switching, its own state shows."""
    from node.core.roles import Role
    from node.core.batcher import BatchConfig, Batcher
    from node.core.ledger import BlockLedger

    role = SimpleNamespace(role=Role.DECODE, since_s=0.0, switching_to=None, switch_done_est_s=None, switch_started_s=None)
    engine = SimpleNamespace(device_id="cpu:0", failure=None, role=role, step_started_s=None, last_step_s=0.0,
                             requests={}, batcher=Batcher(BlockLedger(16, 4), BatchConfig()),
                             step_listeners=[], switch_listeners=[], migration_listeners=[], compile_listeners=[])
    node = SimpleNamespace(config=SimpleNamespace(imbalance_threshold=0.0, link_gbps=0.0), engines=[engine])
    driver = RoleDriver(node, role_scheduler(NodeConfig(mode="adaptive", devices=DEVICES[:1])), lambda: 2.0)
    assert driver.views(2.0)[0].role is Role.DECODE
    driver._switching["cpu:0"] = (Role.PREFILL, 1.5)  # as tick records an ordered switch
    v = driver.views(2.0)[0]
    assert (v.role, v.switching_to, v.role_since_s, v.switch_done_s) == (Role.SWITCHING, Role.PREFILL, 1.5, None)
    st = driver.snapshot(2.0).devices[0]
    assert st.role is Role.SWITCHING and st.switching_to is Role.PREFILL
    role.role, role.switching_to, role.switch_started_s, role.switch_done_est_s = Role.SWITCHING, Role.PREFILL, 1.6, 2.1
    v = driver.views(2.0)[0]
    assert (v.role, v.role_since_s, v.switch_done_s) == (Role.SWITCHING, 1.6, 2.1)


def test_the_adaptive_driver_keeps_its_timer_while_a_device_is_in_prefill_on_an_idle_node():
    """A hand-off window closes after a dwell with nothing to do; with no sequence anywhere no other event
    would run that round (a device stayed in PREFILL for 16 s, found by a helper's review). Time-shared
    devices park in PREFILL: no timer for them."""
    from node.core.roles import Role

    batcher = SimpleNamespace(running=[], waiting=[])
    role = SimpleNamespace(role=Role.PREFILL)
    engine = SimpleNamespace(device_id="cpu:0", failure=None, batcher=batcher, role=role,
                             step_listeners=[], switch_listeners=[], migration_listeners=[], compile_listeners=[])
    node = SimpleNamespace(config=SimpleNamespace(imbalance_threshold=0.0, link_gbps=0.0), engines=[engine],
                           draining=False)
    adaptive = RoleDriver(node, role_scheduler(NodeConfig(mode="adaptive", devices=DEVICES[:1])), lambda: 0.0)
    assert adaptive.needs_timer()
    role.role = Role.DECODE
    assert not adaptive.needs_timer()
    role.role = Role.PREFILL
    shared = RoleDriver(node, role_scheduler(NodeConfig(mode="time-shared", devices=DEVICES[:1])), lambda: 0.0)
    assert not shared.needs_timer()
