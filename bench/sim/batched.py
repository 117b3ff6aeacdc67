"""Colocated mode, and the simulated device both batched modes share.

Every device is a :class:`node.core.batcher.Batcher` over a :class:`node.core.ledger.BlockLedger` —
the objects a live device engine runs — with a fixed step kind, and each step lasts what
:func:`bench.sim.stepcost.plan_step_s` says. A step's sampled tokens come at its end; steps are
pipelined as the node's device loop pipelines them (:class:`SimDevice`).

**Colocated**: every device runs MIXED steps (chunked prefill mixed with decode under the token
budget); an arriving request goes to the device with the fewest (queued prompts, resident sequences),
ties to the lowest index, as ``Node._place`` does. Requests whose prompt cannot fit a device's whole
pool are rejected at arrival. Pooled mode is :mod:`bench.sim.pooled`.

With ``prefix_caching`` the devices' ledgers keep the prefix cache, and prompts carry token ids
(:func:`prompt_token_ids`) so that requests sharing hash ids share cached blocks.
"""

from __future__ import annotations

import hashlib
import math
from collections import deque

from bench.sim.config import SimAborted, SimConfig, count_late
from bench.traffic.clients import TRUE_LENGTH
from bench.sim.stepcost import plan_step_s
from bench.traffic.traces import TraceRequest, hash_prompt_ids
from node.core.batcher import BatchConfig, Batcher, StepKind, StepPlan
from node.core.cost import CostModel
from node.core.roofline import RooflineCost
from node.core.ledger import BlockLedger
from node.core.sequence import PENDING, SamplingParams, Sequence
from bench.sim.trace import RequestTrace

__all__ = ["SimDevice", "client_bound", "new_sequence", "new_trace", "output_length", "simulate_colocated"]


class _SimStep:
    """A step sent to a simulated device: its plan, the placeholder slots of the tokens it samples
    (``(sequence, index in its token_ids)``) and when it starts and ends (s)."""

    __slots__ = ("plan", "pending", "start_s", "end_s")

    def __init__(self, plan: StepPlan, pending: list[tuple[Sequence, int]], start_s: float, end_s: float):
        self.plan, self.pending, self.start_s, self.end_s = plan, pending, start_s, end_s


class SimDevice:
    """One device (or tensor-parallel group): its batch former, the steps in flight and its busy time (s).

    Steps are pipelined as on the node (``DeviceEngine._iteration``): a step is planned and committed to
    the batcher when it is sent — each sampling sequence gets a :data:`~node.core.sequence.PENDING`
    placeholder token, so the next step can be planned on it — and up to ``cfg.step_pipeline`` steps
    are in flight, each starting when the one before it ends. With the default 2, the step after the
    running one is planned when the running one starts, so what arrives meanwhile waits for the step
    after that. ``plan`` and ``busy_until_s`` are the oldest step's (None and infinity when idle).

    ``kv_blocks`` overrides ``cfg.kv_blocks`` (pooled prefill instances at another degree than the
    decode ones); ``cfg.max_item_tokens`` is the batch's per-sequence cap (a time-shared group that
    prefills as several instances).

    ``node`` is the index of its node (pooled cluster scope); ``sending`` is set while it sends a KV
    cache and may run no step (pooled, blocking transfers).
    """

    def __init__(self, device_id: str, kind: StepKind, cfg: SimConfig, node: int = 0, kv_blocks: int | None = None):
        self.device_id = device_id
        self.kind = kind
        self.node = node
        blocks = cfg.kv_blocks if kv_blocks is None else kv_blocks
        self.batcher = Batcher(BlockLedger(blocks, cfg.block_size, prefix_caching=cfg.prefix_caching),
                               BatchConfig(max_num_seqs=cfg.max_num_seqs, max_batched_tokens=cfg.max_num_batched_tokens,
                                           max_item_tokens=cfg.max_item_tokens))
        self.depth = cfg.step_pipeline
        self.inflight: deque[_SimStep] = deque()
        self.busy_s = 0.0
        self.sending = False
        self.version = 0  # bumped on every change of its queues or blocks (views of it may be cached)
        self.chunk_tokens: int | None = None  # adaptive MIXED steps: prompt tokens per step (None: the budget's rest)
        self.copy_until_s = -math.inf  # end of the last KV copy from or to this device (its steps slow down beside it)
        self.copy_slowdown = cfg.copy_slowdown
        self.last_step: _SimStep | None = None  # the step complete() ended last

    @property
    def plan(self) -> StepPlan | None:
        """The oldest step in flight (None: idle)."""
        return self.inflight[0].plan if self.inflight else None

    @property
    def busy_until_s(self) -> float:
        """End of the oldest step in flight (infinity: idle)."""
        return self.inflight[0].end_s if self.inflight else math.inf

    @property
    def last_end_s(self) -> float:
        """End of the newest step in flight (minus infinity: idle)."""
        return self.inflight[-1].end_s if self.inflight else -math.inf

    @property
    def load(self) -> tuple[int, int]:
        return len(self.batcher.waiting), len(self.batcher.running)

    def start(self, now_s: float, cost: CostModel | RooflineCost) -> list[_SimStep]:
        """Send steps of this device's kind while fewer than ``depth`` are in flight and there is work
        (none while ``sending``), each starting at ``now_s`` or when the one before it ends, whichever is
        later; a step whose start falls inside a KV copy from or to the device that is under way when the
        step is sent (``copy_until_s``) lasts ``1 + cfg.copy_slowdown`` times its cost (a step sent before
        the copy began keeps its cost: an approximation). Returns the steps sent."""
        sent = []
        while len(self.inflight) < self.depth and not self.sending and self.batcher.has_work(self.kind):
            plan = self.batcher.schedule(self.kind, self.chunk_tokens if self.kind is StepKind.MIXED else None)
            if not plan:
                break
            dur = plan_step_s(cost, plan)  # before commit: it reads the sequences' context
            pending = []
            for it in plan.items:
                if it.samples:  # before commit: the step reaches the end of the known tokens
                    it.seq.token_ids.append(PENDING)
                    it.seq.num_pending += 1
                    pending.append((it.seq, len(it.seq.token_ids) - 1))
            self.batcher.commit(plan)
            self.version += 1
            start = max(self.inflight[-1].end_s, now_s) if self.inflight else now_s
            if start < self.copy_until_s:  # a copy from or to this device runs beside the step
                dur *= 1 + self.copy_slowdown
            step = _SimStep(plan, pending, start, start + dur)
            self.inflight.append(step)
            self.busy_s += dur
            sent.append(step)
        return sent

    def complete(self) -> list[Sequence]:
        """End the oldest step in flight: its sampled tokens replace their placeholders; returns the
        sequences that got one."""
        step = self.last_step = self.inflight.popleft()
        self.batcher.settle(step.plan)  # its blocks are written: transfers may reuse them (node.core.ledger)
        self.version += 1
        out = []
        for seq, index in step.pending:
            seq.num_pending -= 1
            if index < len(seq.token_ids) and seq.token_ids[index] == PENDING:
                seq.token_ids[index] = 0
            out.append(seq)
        return out


SIM_VOCAB = 32000  # ids of hash-built prompts stay below this (any value works: the sim runs no model)


def prompt_token_ids(rid: str, r: TraceRequest, prefix_caching: bool) -> list[int]:
    """Token ids of a request's prompt in the simulator: built from its hash ids when it has them
    (:func:`bench.traffic.traces.hash_prompt_ids`, as the live replay builds them, so shared hashes share
    blocks); else, with the prefix cache on, a first id unique to the request (BLAKE2b of its id; the
    block keys chain from it, so nothing of it is ever shared); else zeros (nothing is looked up)."""
    if r.hash_ids and r.hash_block_tokens and len(r.hash_ids) * r.hash_block_tokens >= r.prompt_tokens:
        return hash_prompt_ids(r, SIM_VOCAB)
    if not prefix_caching or r.prompt_tokens == 0:
        return [0] * r.prompt_tokens
    first = -1 - int.from_bytes(hashlib.blake2b(rid.encode(), digest_size=7).digest(), "big")
    return [first] + [0] * (r.prompt_tokens - 1)


def client_bound(r: TraceRequest, cfg: SimConfig) -> tuple[int, bool]:
    """``(max_tokens, ignore_eos)`` of the request the client sends: its drawn ``max_tokens``
    (:mod:`bench.traffic.clients`; absent: the context left beside the prompt, the node's default) with EOS
    honoured, or, with ``cfg.client_max_tokens == "true"`` (the oracle), the true length and ``ignore_eos``."""
    if cfg.client_max_tokens == TRUE_LENGTH:
        return r.output_tokens, True
    return (r.max_tokens if r.max_tokens is not None else max(1, cfg.max_model_len - r.prompt_tokens)), False


def output_length(r: TraceRequest, cfg: SimConfig) -> tuple[int, bool]:
    """``(output tokens the request produces, whether EOS ends it)``: the true length (the trace's) where it
    comes before the client's bound and the context limit (EOS: a stop the node does not foresee), else the
    bound (a ``length`` end, which teaches the node's output estimate nothing)."""
    max_tokens, ignore_eos = client_bound(r, cfg)
    bound = max(1, min(max_tokens, cfg.max_model_len - r.prompt_tokens))
    if not ignore_eos and r.output_tokens <= bound:
        return max(1, r.output_tokens), True
    return max(1, min(r.output_tokens, bound) if ignore_eos else bound), False


def new_sequence(rid: str, r: TraceRequest, cfg: SimConfig) -> Sequence:
    """The sequence a live node would make of a trace request (token-id prompt, the client's ``max_tokens``;
    :func:`client_bound`). It ends where :func:`output_length` says (the simulators check their traces)."""
    max_tokens, ignore_eos = client_bound(r, cfg)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
    return Sequence(rid, rid, 0, r.arrival_s, prompt_token_ids(rid, r, cfg.prefix_caching), params, cfg.max_model_len)


def new_trace(rid: str, r: TraceRequest, cfg: SimConfig) -> RequestTrace:
    """The trace of a request: its output the length :func:`output_length` gives."""
    n, eos = output_length(r, cfg)
    return RequestTrace(rid, r.arrival_s, r.prompt_tokens, n, ends_by_eos=eos)


def simulate_colocated(requests: list[TraceRequest], cfg: SimConfig, cost: CostModel | RooflineCost,
                       prefix: str = "r") -> tuple[list[RequestTrace], dict]:
    """Replay ``requests`` on one colocated node; ``(traces in request order, stats)``."""
    devices = [SimDevice(f"dev{i}", StepKind.MIXED, cfg) for i in range(cfg.devices)]
    ids = [f"{prefix}{i}" for i in range(len(requests))]
    traces = {rid: new_trace(rid, r, cfg) for rid, r in zip(ids, requests)}
    pending = sorted(zip(ids, requests), key=lambda x: (x[1].arrival_s, x[0]))
    i = 0
    now = pending[0][1].arrival_s if pending else 0.0
    t_end = now + cfg.max_sim_s
    while True:
        for d in devices:
            while d.busy_until_s <= now:
                for seq in d.complete():
                    tr = traces[seq.request_id]
                    if tr.done:  # a token of a step planned before its EOS was seen: discarded, as live
                        continue
                    tr.token_times_s.append(now)
                    tr.device_id = tr.device_id or d.device_id
                    if tr.done:
                        d.batcher.remove(seq)
        while i < len(pending) and pending[i][1].arrival_s <= now:
            rid, r = pending[i]
            i += 1
            if -(-(r.prompt_tokens + 1) // cfg.block_size) > cfg.kv_blocks:
                traces[rid].rejected = True
                continue
            min(devices, key=lambda d: d.load).batcher.add(new_sequence(rid, r, cfg))
        for d in devices:
            d.start(now, cost)
        if cfg.abort_late is not None:
            late = sum(count_late((q.arrival_s for q in d.batcher.waiting), now, cfg.ttft_slo_ms / 1e3, cfg.abort_late)
                       for d in devices)
            if late >= cfg.abort_late:
                raise SimAborted(f"{cfg.abort_late} requests waited past the TTFT SLO")
        events = [pending[i][1].arrival_s] if i < len(pending) else []
        events += [d.busy_until_s for d in devices if d.plan is not None]
        if not events:
            break
        now = max(now, min(events))
        if now > t_end:
            break
    stats = {"switches": 0, "pause_s": 0.0, "busy_s": {d.device_id: d.busy_s for d in devices},
             "transfers": 0, "transfer_bytes": 0, "preemptions": sum(d.batcher.num_preemptions for d in devices),
             "cached_tokens": sum(d.batcher.prefix_hit_tokens for d in devices)}
    return [traces[rid] for rid in ids], stats
