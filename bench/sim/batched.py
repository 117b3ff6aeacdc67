"""Colocated and pooled modes: devices running the node's own batch former on a virtual clock.

Every device is a :class:`node.core.batcher.Batcher` over a :class:`node.core.ledger.BlockLedger` —
the objects a live device engine runs — with a fixed step kind, and each step lasts what
:func:`bench.sim.stepcost.plan_step_s` says. A step's sampled tokens come at its end.

* **colocated** — every device runs MIXED steps (chunked prefill mixed with decode under the token
  budget); an arriving request goes to the device with the fewest (queued prompts, resident
  sequences), ties to the lowest index, as ``Node._place`` does.
* **pooled** — ``cfg.num_prefill_devices`` devices run PREFILL steps, the rest DECODE steps. Arrivals
  go to the least-loaded prefill device. A sequence whose prefill sampled its first token (TTFT) is
  detached with its blocks and queued for transfer: in FIFO order, once a decode device has free
  blocks for its KV (the one with the fewest resident sequences, then the lowest index), those blocks
  are taken there and the KV is sent over the prefill device's link, one transfer at a time per link,
  taking :func:`node.plan.transfer_s` of ``kv_bytes_per_token x cached tokens``; on arrival the prefill
  blocks are freed and the decode device adopts the sequence. A sequence preempted on a decode
  device (its batch ran out of blocks) goes back to the least-loaded prefill device to be recomputed.

Requests whose prompt cannot fit a device's whole pool are rejected at arrival.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from bench.sim.config import SimConfig
from bench.sim.stepcost import plan_step_s
from bench.traces import TraceRequest
from node.core.batcher import BatchConfig, Batcher, StepKind, StepPlan
from node.core.cost import CostModel
from node.core.ledger import BlockLedger
from node.core.sequence import SamplingParams, Sequence
from node.core.virtual import RequestTrace
from node.plan import transfer_s

__all__ = ["SimDevice", "simulate_batched"]


class SimDevice:
    """One device: its batch former, the step in flight and its busy time (s)."""

    def __init__(self, device_id: str, kind: StepKind, cfg: SimConfig):
        self.device_id = device_id
        self.kind = kind
        self.batcher = Batcher(BlockLedger(cfg.kv_blocks, cfg.block_size),
                               BatchConfig(max_num_seqs=cfg.max_num_seqs, max_batched_tokens=cfg.max_num_batched_tokens))
        self.plan: StepPlan | None = None
        self.sampling: list[Sequence] = []
        self.busy_until_s = math.inf
        self.busy_s = 0.0

    @property
    def load(self) -> tuple[int, int]:
        return len(self.batcher.waiting), len(self.batcher.running)

    def start(self, now_s: float, cost: CostModel) -> None:
        """Start the next step if idle and there is work of this device's kind."""
        if self.plan is not None or not self.batcher.has_work(self.kind):
            return
        plan = self.batcher.schedule(self.kind)
        if not plan:
            return
        dur = plan_step_s(cost, plan)
        self.plan, self.sampling = plan, [it.seq for it in plan.items if it.samples]
        self.busy_until_s = now_s + dur
        self.busy_s += dur

    def complete(self) -> list[Sequence]:
        """End the step in flight: commit it, append a token to each sampling sequence; return those."""
        self.batcher.commit(self.plan)
        out = self.sampling
        for seq in out:
            seq.token_ids.append(0)
        self.plan, self.sampling, self.busy_until_s = None, [], math.inf
        return out


@dataclass
class _Transfer:
    seq: Sequence
    src: SimDevice
    src_blocks: list[int]
    dst: SimDevice | None = None
    end_s: float = math.inf


class _Cluster:
    def __init__(self, cfg: SimConfig, cost: CostModel, prefix: str = ""):
        self.cfg, self.cost = cfg, cost
        if cfg.mode == "colocated":
            self.front = [SimDevice(f"{prefix}dev{i}", StepKind.MIXED, cfg) for i in range(cfg.devices)]
            self.back: list[SimDevice] = []
        else:
            p = cfg.num_prefill_devices
            self.front = [SimDevice(f"{prefix}dev{i}", StepKind.PREFILL, cfg) for i in range(p)]
            self.back = [SimDevice(f"{prefix}dev{i}", StepKind.DECODE, cfg) for i in range(p, cfg.devices)]
        self.devices = self.front + self.back
        self.traces: dict[str, RequestTrace] = {}
        self.queued: deque[_Transfer] = deque()
        self.flying: list[_Transfer] = []
        self.link_free_s = {d.device_id: 0.0 for d in self.front}
        self.transfers = 0
        self.transfer_bytes = 0

    def admit(self, seq: Sequence, now_s: float) -> None:
        min(self.front, key=lambda d: d.load).batcher.add(seq)

    def on_tokens(self, dev: SimDevice, seqs: list[Sequence], now_s: float) -> None:
        for seq in seqs:
            tr = self.traces[seq.request_id]
            tr.token_times_s.append(now_s)
            if tr.device_id is None:
                tr.device_id = dev.device_id
            if seq.num_output >= seq.params.max_tokens or len(seq.token_ids) >= seq.max_len:
                dev.batcher.remove(seq)
            elif dev.kind is StepKind.PREFILL:
                self.queued.append(_Transfer(seq, dev, dev.batcher.release(seq)))

    def reroute_preempted(self, now_s: float) -> None:
        """Pooled: sequences preempted on a decode device go back to a prefill device (recompute)."""
        for dev in self.back:
            while dev.batcher.waiting:
                self.admit(dev.batcher.waiting.pop(0), now_s)

    def start_transfers(self, now_s: float) -> None:
        while self.queued:
            t = self.queued[0]
            need = t.src.batcher.ledger.blocks_for(t.seq.num_computed)
            fits = [d for d in self.back if d.batcher.ledger.num_free >= need
                    and len(d.batcher.running) < d.batcher.config.max_num_seqs]
            if not fits:
                return  # FIFO: later transfers wait behind this one
            self.queued.popleft()
            t.dst = min(fits, key=lambda d: len(d.batcher.running))
            t.seq.block_ids = t.dst.batcher.ledger.allocate(need)
            nbytes = self.cfg.kv_bytes_per_token * t.seq.num_computed
            start = max(now_s, self.link_free_s[t.src.device_id])
            t.end_s = start + transfer_s(nbytes, self.cfg.link_gbps)
            self.link_free_s[t.src.device_id] = t.end_s
            self.transfers += 1
            self.transfer_bytes += nbytes
            self.flying.append(t)

    def land_transfers(self, now_s: float) -> None:
        for t in [t for t in self.flying if t.end_s <= now_s]:
            self.flying.remove(t)
            t.src.batcher.ledger.free(t.src_blocks)
            t.dst.batcher.adopt(t.seq)

    def run(self, requests: list[tuple[str, TraceRequest]]) -> None:
        pending = sorted(requests, key=lambda x: (x[1].arrival_s, x[0]))
        for rid, r in pending:
            self.traces[rid] = RequestTrace(rid, r.arrival_s, r.prompt_tokens, r.output_tokens)
        i = 0
        now = pending[0][1].arrival_s if pending else 0.0
        t_end = now + self.cfg.max_sim_s
        total_blocks = self.cfg.kv_blocks
        while True:
            for d in self.devices:
                if d.plan is not None and d.busy_until_s <= now:
                    self.on_tokens(d, d.complete(), now)
            self.land_transfers(now)
            while i < len(pending) and pending[i][1].arrival_s <= now:
                rid, r = pending[i]
                i += 1
                if -(-(r.prompt_tokens + 1) // self.cfg.block_size) > total_blocks:
                    self.traces[rid].rejected = True
                    continue
                params = SamplingParams(max_tokens=r.output_tokens, temperature=0.0, ignore_eos=True)
                self.admit(Sequence(rid, rid, 0, r.arrival_s, [0] * r.prompt_tokens, params, self.cfg.max_model_len), now)
            self.start_transfers(now)
            for d in self.back:
                d.start(now, self.cost)
            self.reroute_preempted(now)
            for d in self.front:
                d.start(now, self.cost)
            events = [pending[i][1].arrival_s] if i < len(pending) else []
            events += [d.busy_until_s for d in self.devices if d.plan is not None]
            events += [t.end_s for t in self.flying]
            if not events:
                break
            now = max(now, min(events))
            if now > t_end:
                break

    def stats(self) -> dict:
        return {"switches": 0, "pause_s": 0.0, "busy_s": {d.device_id: d.busy_s for d in self.devices},
                "transfers": self.transfers, "transfer_bytes": self.transfer_bytes,
                "preemptions": sum(d.batcher.num_preemptions for d in self.devices)}


def simulate_batched(requests: list[TraceRequest], cfg: SimConfig, cost: CostModel,
                     prefix: str = "r") -> tuple[list[RequestTrace], dict]:
    """Replay ``requests`` on one colocated or pooled node; ``(traces in request order, stats)``."""
    cluster = _Cluster(cfg, cost)
    ids = [f"{prefix}{i}" for i in range(len(requests))]
    cluster.run(list(zip(ids, requests)))
    return [cluster.traces[i] for i in ids], cluster.stats()
