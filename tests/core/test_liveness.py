"""Liveness of time-shared and adaptive modes: the role scheduler (two-role, and the adaptive policy
with its MIXED role) over the live Batcher and BlockLedger always makes progress, whatever the load,
down to KV pools that hold a single sequence.

A small discrete-event loop on a virtual clock plays the shell (the node's RoleDriver and engines):
it builds the policy's snapshot from the batchers, applies its decisions, and runs each device's
steps of its role (prefill steps take time per token, decode steps a fixed time, switches a pause).
Random workloads (arrival bursts, prompt and output lengths up to the context, wrong output
estimates, tiny pools) must finish every request with every block freed, and no stretch of
``MAX_IDLE_ROUNDS`` decision rounds may pass without a step or a switch starting while work exists.
"""

from __future__ import annotations

import random

import pytest

from node.core.adaptive import AdaptiveScheduler, ChunkBudget
from node.core.batcher import BatchConfig, Batcher, StepKind, StepPlan
from node.core.cost import CostModel
from node.core.imbalance import Migrate
from node.core.ledger import BlockLedger
from node.core.roles import (DeviceState, NodeSnapshot, Place, Reject, ResidentSeq, Role, RoleScheduler,
                             RoleSchedulerConfig, SwitchRole, WaitingPrompt)
from node.core.sequence import SamplingParams, Sequence

MAX_IDLE_ROUNDS = 40  # decision rounds without a step or switch starting, while work exists
TICK_S = 0.005  # the shell re-decides at least this often (node.runtime.driver.TICK_S)
PREFILL_PER_TOKEN_S, DECODE_STEP_S = 2e-5, 1e-3
_KIND = {Role.PREFILL: StepKind.PREFILL, Role.DECODE: StepKind.DECODE, Role.MIXED: StepKind.MIXED}


class EagerMixed(CostModel, frozen=True, kw_only=True):
    """A step with prompt and decode work costs ``penalty_s`` more than the linear model (mixed steps run
    eagerly, decode replays graphs): the adaptive policy gathers prompts, or windows when no chunk fits."""

    penalty_s: float = 0.0

    def mixed_step_s(self, prompt_tokens: int, decode_seqs: int, context_tokens: int) -> float:
        base = CostModel.mixed_step_s(self, prompt_tokens, decode_seqs, context_tokens)
        return base + (self.penalty_s if prompt_tokens > 0 and decode_seqs > 0 else 0.0)


class _Dev:
    def __init__(self, device_id: str, blocks: int, block_size: int, max_seqs: int, budget: int, role: Role):
        self.id = device_id
        self.batcher = Batcher(BlockLedger(blocks, block_size), BatchConfig(max_num_seqs=max_seqs, max_batched_tokens=budget))
        self.role, self.since_s = role, 0.0
        self.chunk = 0  # the adaptive policy's chunk budget for MIXED steps
        self.to_role: Role | None = None
        self.switch_start_s = 0.0
        self.switch_done_s: float | None = None
        self.plan: StepPlan | None = None
        self.busy_until_s = 0.0
        self.reserve: dict[str, int] = {}  # seq id → blocks reserved at placement
        self.expected: dict[str, int] = {}  # seq id → the output tokens the policy was told to expect


class _Shell:
    """The node's role of applying decisions and running steps, on a virtual clock."""

    def __init__(self, rng: random.Random, n_devices: int, blocks: int, block_size: int, max_seqs: int,
                 budget: int, pause_ms: float, stagger: str, max_len: int, adaptive: bool = False,
                 handoff: bool = False):
        first = Role.DECODE if adaptive else Role.PREFILL  # as the node starts its devices
        self.devs = [_Dev(f"d{i}", blocks, block_size, max_seqs, budget, first) for i in range(n_devices)]
        self.pause_s = pause_ms / 1e3
        cost = CostModel(prefill_fixed_s=0.0, prefill_per_token_s=PREFILL_PER_TOKEN_S, decode_fixed_s=DECODE_STEP_S,
                         decode_per_seq_s=0.0, pause_s=self.pause_s)
        self.penalty_s = 0.0
        if adaptive:  # mixed steps as one configuration, or eager beside graph-replayed decode (gathering, windows)
            penalty = rng.choice([0.0, 0.002, 0.020])
            cost = EagerMixed(**{f: getattr(cost, f) for f in cost.__struct_fields__},
                              penalty_s=0.020 if handoff else penalty)
            self.penalty_s = cost.penalty_s
        config = RoleSchedulerConfig(
            # TPOT 20 ms (adaptive): T = 18 ms, under a mixed step's 20 ms penalty and over decode, where
            # the first gap of a hand-off fits outputs of 15 tokens or more (node.core.handoff_windows)
            ttft_slo_ms=rng.choice([50, 500, 5000]),
            tpot_slo_ms=20 if handoff else rng.choice([5, 20, 50, 200] if adaptive else [5, 50, 200]),
            reconfig_pause_ms=pause_ms,
            min_window_ms=rng.choice([1, 20]), max_window_ms=rng.choice([20, 200]), prefill_token_budget=budget,
            stagger=stagger)
        self.policy = (AdaptiveScheduler(config, cost, max_step_tokens=budget) if adaptive
                       else RoleScheduler(config, cost))
        self.max_len = max_len
        self.now = 0.0
        self.pending: list[tuple[Sequence, int]] = []  # (sequence, expected output told to the policy)
        self.finished: list[Sequence] = []
        self.progress = False
        self.roles_seen: set[Role] = set()  # roles some step ran in
        self.reasons: set[str] = set()  # switch reasons the policy gave
        self.moves = 0  # hand-off moves made

    # --- the policy's view ------------------------------------------------------------------------
    def snapshot(self) -> NodeSnapshot:
        states = []
        for d in self.devs:
            b = d.batcher
            resident = tuple(ResidentSeq(s.seq_id, s.first_token_s, s.num_output, s.num_computed, d.expected.get(s.seq_id, 0))
                             for s in b.running if s.is_decoding)
            pq = b.prefill_queue()
            held = {s.seq_id: len(s.block_ids) for s in b.running + b.waiting}
            reserved = sum(max(0, blocks - held.get(sid, 0)) for sid, blocks in d.reserve.items())
            role_since = d.switch_start_s if d.role is Role.SWITCHING else d.since_s
            states.append(DeviceState(
                device_id=d.id, role=d.role, role_since_s=role_since, switching_to=d.to_role,
                switch_done_s=d.switch_done_s, busy_until_s=max(self.now, d.busy_until_s) if d.plan else self.now,
                resident=resident, prefill_queue_tokens=pq.tokens, prefill_queue_seqs=pq.seqs,
                kv_free_blocks=b.ledger.num_free, kv_reserved_blocks=reserved, kv_total_blocks=b.ledger.num_blocks,
                block_size=b.ledger.block_size, seq_slots_free=b.config.max_num_seqs - len(resident) - pq.seqs,
                prefill_queue_oldest_s=pq.oldest_arrival_s, prefill_runnable=pq.runnable))
        waiting = tuple(WaitingPrompt(s.seq_id, s.prompt_len, s.arrival_s, exp) for s, exp in self.pending)
        return NodeSnapshot(tuple(states), waiting)

    def apply(self, decisions) -> None:
        by_id = {s.seq_id: (s, exp) for s, exp in self.pending}
        for dec in decisions:
            if isinstance(dec, ChunkBudget):
                next(x for x in self.devs if x.id == dec.device_id).chunk = dec.tokens
            elif isinstance(dec, SwitchRole):
                self.reasons.add(dec.reason)
                d = next(x for x in self.devs if x.id == dec.device_id)
                if d.role is Role.SWITCHING or d.role is dec.to_role:
                    continue
                if {d.role, dec.to_role} <= {Role.DECODE, Role.MIXED}:  # the same configuration: free, at once
                    d.role = dec.to_role
                    continue
                d.role, d.to_role, d.switch_start_s = Role.SWITCHING, dec.to_role, self.now
                d.switch_done_s = max(self.now, d.busy_until_s if d.plan else self.now) + self.pause_s
                self.progress = True
            elif isinstance(dec, Place):
                seq, exp = by_id.pop(dec.request_id)
                self.pending.remove((seq, exp))
                d = next(x for x in self.devs if x.id == dec.device_id)
                d.reserve[seq.seq_id] = dec.reserve_blocks
                d.expected[seq.seq_id] = exp
                seq.device_id = d.id
                d.batcher.add(seq)
            elif isinstance(dec, Migrate):  # a hand-off window's move (node.core.handoff_windows): at once, as a copy
                self._move(dec)
            elif isinstance(dec, Reject):
                raise AssertionError(f"a prompt that fits an empty device was rejected: {dec}")

    def _move(self, m: Migrate) -> None:
        """Move a decoding sequence no step in flight holds; refused (it stays) where the destination
        has no free blocks, as the node refuses."""
        src = next(x for x in self.devs if x.id == m.src_device)
        dst = next(x for x in self.devs if x.id == m.dst_device)
        seq = next((s for s in src.batcher.running if s.seq_id == m.seq_id), None)
        if seq is None or not seq.is_decoding or (src.plan and any(it.seq is seq for it in src.plan.items)):
            return
        blocks = dst.batcher.ledger.allocate(len(seq.block_ids))
        if blocks is None:
            return
        src.batcher.ledger.free(src.batcher.release(seq))
        seq.block_ids = blocks
        seq.device_id = dst.id
        dst.batcher.adopt(seq)
        dst.reserve[seq.seq_id] = src.reserve.pop(seq.seq_id, 0)
        dst.expected[seq.seq_id] = src.expected.pop(seq.seq_id, 0)
        self.moves += 1
        self.progress = True

    # --- devices ------------------------------------------------------------------------------------
    def advance(self) -> None:
        """Finish the steps and switches due by ``now``, then start steps on idle devices."""
        for d in self.devs:
            if d.plan is not None and d.busy_until_s <= self.now + 1e-12:
                self._finish_step(d)
            if d.role is Role.SWITCHING and d.plan is None and d.switch_done_s <= self.now + 1e-12:
                d.role, d.since_s, d.to_role, d.switch_done_s = d.to_role, self.now, None, None
            if d.plan is None and d.role in _KIND:
                kind = _KIND[d.role]
                if d.batcher.has_work(kind):
                    plan = d.batcher.schedule(kind, d.chunk if kind is StepKind.MIXED else None)
                    if plan:
                        d.plan = plan
                        self.roles_seen.add(d.role)
                        decodes = sum(1 for it in plan.items if it.seq.is_decoding)
                        d.busy_until_s = self.now + (DECODE_STEP_S if decodes else 0.0) + \
                            (plan.num_tokens - decodes) * PREFILL_PER_TOKEN_S
                        if decodes and plan.num_tokens > decodes:  # a mixed step: eager (EagerMixed)
                            d.busy_until_s += self.penalty_s
                        self.progress = True

    def _finish_step(self, d: _Dev) -> None:
        plan, d.plan = d.plan, None
        d.batcher.commit(plan)
        for it in plan.items:
            s = it.seq
            if s.num_computed < len(s.token_ids):
                continue
            s.token_ids.append(7)  # the token's value does not matter to the policy
            if s.first_token_s is None:
                s.first_token_s = self.now
            if len(s.token_ids) >= s.max_len:
                d.batcher.remove(s)
                d.reserve.pop(s.seq_id, None)
                d.expected.pop(s.seq_id, None)
                self.finished.append(s)

    def next_time(self, arrivals: list[tuple[float, Sequence, int]]) -> float:
        times = [self.now + TICK_S]
        times += [d.busy_until_s for d in self.devs if d.plan is not None]
        times += [d.switch_done_s for d in self.devs if d.switch_done_s is not None]
        if arrivals:
            times.append(arrivals[0][0])
        return max(self.now, min(times))

    def has_work(self) -> bool:
        return bool(self.pending) or any(d.batcher.running or d.batcher.waiting for d in self.devs)


def _workload(rng: random.Random, n: int, max_len: int) -> list[tuple[float, Sequence, int]]:
    burst = rng.random() < 0.5
    t, out = 0.0, []
    for i in range(n):
        t += 0.0 if burst else rng.expovariate(200.0)
        prompt = rng.randint(1, max_len - 1)
        output = rng.randint(1, max_len - prompt)
        seq = Sequence(f"r{i:03d}", f"r{i:03d}", 0, t, [3] * prompt, SamplingParams(max_tokens=output), max_len)
        expected = rng.choice([output, 1, max(1, output // 4), max_len])  # right, or wrong either way
        out.append((t, seq, expected))
    return out


def run_case(seed: int, adaptive: bool = False, handoff: bool = False) -> _Shell:
    """One random case; ``handoff``: adaptive cases in the regime of hand-off windows (2-4 devices, room
    for several sequences each, long contexts, a 20 ms mixed-step penalty against TPOT 20 ms)."""
    rng = random.Random(seed)
    block_size = rng.choice([4, 8, 16])
    max_len = rng.choice([64, 128] if handoff else [16, 32, 64, 128])
    one_seq = -(-max_len // block_size)
    blocks = rng.choice([4 * one_seq, 8 * one_seq] if handoff else [one_seq, one_seq + 1, 2 * one_seq, 4 * one_seq])
    devices = rng.choice([2, 3, 4] if handoff else [1, 1, 2, 3])
    shell = _Shell(rng, devices, blocks, block_size, rng.choice([4, 16] if handoff else [1, 2, 4, 16]),
                   rng.choice([8, 32, 256]), rng.choice([0.0, 2.0, 20.0]), rng.choice(["hard", "soft", "off"]), max_len,
                   adaptive or handoff, handoff)
    arrivals = _workload(rng, rng.randint(1, 24), max_len)
    total = len(arrivals)
    idle_rounds = 0
    for _ in range(200_000):
        while arrivals and arrivals[0][0] <= shell.now:
            _, seq, exp = arrivals.pop(0)
            shell.pending.append((seq, exp))
        shell.progress = False
        shell.advance()
        shell.apply(shell.policy.decide(shell.now, shell.snapshot()))
        shell.advance()
        if shell.has_work():
            idle_rounds = 0 if shell.progress or any(d.plan or d.role is Role.SWITCHING for d in shell.devs) else idle_rounds + 1
            assert idle_rounds <= MAX_IDLE_ROUNDS, f"seed {seed} (adaptive {adaptive}): no progress at t={shell.now:.3f}: {shell.snapshot()}"
        elif not arrivals:
            break
        shell.now = shell.next_time(arrivals)
    assert len(shell.finished) == total, f"seed {seed} (adaptive {adaptive}): {len(shell.finished)}/{total} finished by t={shell.now:.2f}"
    for d in shell.devs:
        d.batcher.ledger.check()
        assert d.batcher.ledger.num_free == d.batcher.ledger.num_blocks, f"seed {seed}: {d.id} leaked blocks"
    return shell


@pytest.mark.parametrize("chunk", range(8))
def test_every_workload_finishes_with_progress_at_every_round(chunk):
    for seed in range(chunk * 40, (chunk + 1) * 40):
        run_case(seed)


@pytest.mark.parametrize("chunk", range(4))
def test_adaptive_every_workload_finishes_with_progress_at_every_round(chunk):
    """The same random workloads under the adaptive policy (DECODE, MIXED with its online chunk
    budget, PREFILL windows)."""
    for seed in range(chunk * 40, (chunk + 1) * 40):
        run_case(seed, adaptive=True)


@pytest.mark.parametrize("chunk", range(2))
def test_handoff_cases_finish_with_progress_and_hand_off(chunk):
    """Random cases in the regime of hand-off windows (node.core.handoff_windows): every workload
    finishes with progress at every round, no block leaks, and hand-offs happen (moves applied)."""
    moves, opened = 0, 0
    for seed in range(chunk * 60, (chunk + 1) * 60):
        shell = run_case(seed, handoff=True)
        moves += shell.moves
        opened += "handoff" in shell.reasons
    assert moves > 0 and opened >= 10


def test_adaptive_cases_use_every_role():
    """The adaptive cases do exercise MIXED steps and PREFILL windows, not only one of them, and the
    holds of the decode configuration (gathering, spacing)."""
    kinds, reasons = set(), set()
    for seed in range(80):
        shell = run_case(seed, adaptive=True)
        kinds |= shell.roles_seen
        reasons |= shell.reasons
    assert {Role.MIXED, Role.PREFILL, Role.DECODE} <= kinds
    # spaced mixed steps (a 20 ms penalty against T = 4.5 or 18 ms); hand-off windows: the test above
    assert {"chunks_fit", "gather", "spacing", "no_headroom"} <= reasons, reasons


@pytest.mark.quick
def test_preemption_under_kv_pressure_is_exercised():
    """The random cases do reach the state that deadlocked the node: sequences preempted for KV."""
    assert sum(sum(s.num_preemptions for s in run_case(seed).finished) for seed in range(40)) > 0


@pytest.mark.quick
def test_a_window_whose_queue_waits_on_resident_kv_ends():
    """The reported deadlock as a snapshot: a PREFILL device holding decoding residents, whose only
    queued work (a preempted sequence) cannot be admitted, switches to DECODE at once."""
    policy = RoleScheduler(RoleSchedulerConfig(), CostModel())
    residents = tuple(ResidentSeq(f"s{i}", 0.0, 10, 400) for i in range(7))
    dev = DeviceState(device_id="d0", role=Role.PREFILL, role_since_s=0.0, resident=residents,
                      prefill_queue_tokens=420, prefill_queue_seqs=1, kv_free_blocks=4, kv_total_blocks=128,
                      prefill_queue_oldest_s=0.0, prefill_runnable=False)
    out = policy.decide(1.0, NodeSnapshot((dev,), (WaitingPrompt("new", 10, 0.5, 10),)))
    assert SwitchRole("d0", Role.DECODE, "blocked") in out
    assert not any(isinstance(d, Place) for d in out)  # nothing more is queued behind the blocked work


@pytest.mark.quick
def test_a_decode_device_recomputes_its_own_preempted_sequences():
    """A DECODE device whose own queue (preempted sequences) can run gets a window for it, with no
    new prompt waiting anywhere."""
    policy = RoleScheduler(RoleSchedulerConfig(min_window_ms=1, ttft_slo_ms=100), CostModel())
    dev = DeviceState(device_id="d0", role=Role.DECODE, role_since_s=0.0,
                      resident=(ResidentSeq("s0", 0.0, 10, 40),), prefill_queue_tokens=50, prefill_queue_seqs=1,
                      kv_free_blocks=20, kv_total_blocks=32, prefill_queue_oldest_s=0.0, prefill_runnable=True)
    out = policy.decide(0.5, NodeSnapshot((dev,)))
    assert [d.to_role for d in out if isinstance(d, SwitchRole)] == [Role.PREFILL]
