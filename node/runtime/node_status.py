"""``GET /v1/node``: the node's state as JSON (mode, SLOs, queue, per device its role, KV blocks, resident
and queued sequences, the role timeline and KV transfers, the latency histograms, the network)."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any, Protocol

import msgspec

from node.runtime.interfaces import StateSource
from node.worker.engine_group import TPEngineGroup
from node.worker.grammar import grammar_cache_status


class StatusSource(StateSource, Protocol):
    """What the status page reads of the node, beside :class:`~node.runtime.interfaces.StateSource`."""

    max_model_len: int
    metrics: Any  # node.runtime.metrics.NodeMetrics: latency_histograms()
    migrations: Any  # recent KV moves (MigrationRecord), oldest first
    membership: Any  # node.runtime.membership.Membership or None: status()
    nixl: Any  # node.runtime.kv_plane.NixlPlane or None: status()
    fingerprint: Any  # node.transport.protocol.Fingerprint or None
    timed_out: int
    started_wall_s: float
    supervisor: Any  # node.runtime.engine_supervisor.EngineSupervisor: status(device_id, now)
    compile_watch: Any  # node.runtime.compile_watch.CompileWatch: status(engine)


def node_status(node: StatusSource, history: int = 200, since_s: float | None = None) -> dict:
    """The node's state for ``GET /v1/node``: mode, SLOs, queue, and per device its role, KV blocks,
    resident and queued sequences, switch count and pause total, and the last ``history`` switches
    (the role timeline) and KV transfers; with ``since_s`` (node clock, s) instead those that ended
    after it, all that are kept (a poller such as /dashboard asks only for what is new). ``latency``
    holds the cumulative TTFT/ITL/TPOT/E2E histograms, for quantiles over any window."""
    now = time.monotonic()
    recent = _since(history, since_s)
    devices = []
    decoders = node.config.decode_group_ids()
    for e in node.engines:
        d = {
            "device": e.device_id,
            "role": node.role_of(e, decoders),
            "engine": {"layout": node.config.engine_layout, "pid": e.runner.pid,  # pid: null in the thread layout; a group's rank 0
                       # intra-op threads its steps run with (--cpu-threads, or timed at start-up on a CPU)
                       "threads": getattr(e.runner, "threads", None)},
            "engine_busy_s": round(e.busy_s, 6),  # the engine's own time in steps, summed (wall minus this: waiting)
            "kv_blocks_total": e.batcher.ledger.num_blocks,
            # bytes of the pool allocated (small on a timed device, whose blocks only stand for the geometry's)
            "kv_pool_bytes": _pool_bytes(e.runner.kv_cache),
            "kv_blocks_free": e.batcher.ledger.num_free,
            "kv_blocks_used": e.batcher.ledger.num_used,  # held by live requests (and transfers)
            "kv_blocks_cached": e.batcher.ledger.num_cached,  # findable prefix blocks, held or not
            "kv_blocks_reclaimable": e.batcher.ledger.num_reclaimable,  # cached, unheld: counted as free
            "prefix_cache": {"enabled": e.batcher.ledger.prefix_caching,
                             "query_tokens": e.batcher.prefix_query_tokens,
                             "hit_tokens": e.batcher.prefix_hit_tokens,
                             "evictions": e.batcher.ledger.num_evictions},
            "running": len(e.batcher.running),
            "resident_decoding": e.batcher.num_decoding,
            "waiting": len(e.batcher.waiting),
            "kv_moves_out": e.moves.destinations,  # the destination of each KV move leaving the device, not yet done
            "steps": e.steps,
            "preemptions": e.batcher.num_preemptions,
            "errors": dict(e.errors),  # contained failures by stage; the device kept serving
            # grammars compiled / matchers rebuilt inside steps (0 when every grammar arrival was prepared first)
            "grammar_in_step": e.grammar_in_step,
            "grammar_held": e.grammar_gate.num_held,  # sequences held out of steps while their grammar was prepared
            "failure": e.failure,  # why the device is down, or null
            "restart": node.supervisor.status(e.device_id, now),  # restarts, their limits, the outage (null while up)
            # --compile: the token-count buckets, which run compiled and which are pending (null: eager steps)
            "compile": node.compile_watch.status(e),
        }
        if isinstance(e.runner, TPEngineGroup):  # a group of devices as one (--tensor-parallel-size, --decode-tp)
            d["tensor_parallel"] = {"size": e.runner.degree, "devices": e.runner.devices, "pids": e.runner.pids,
                                    "active_layout": e.runner.active_role}
        if e.role_configs:  # time-shared: what each role runs, and what the device runs now
            d["role_configs"] = {r.value: c.as_dict() for r, c in e.role_configs.items()}
            active = e.active_config
            d["active_config"] = active.as_dict() if active is not None else None
            d["kv_scatter_bytes"] = e.kv_scatter_bytes
        if e.role is not None:
            r = e.role
            d |= {
                "time_in_role_s": round(now - (r.switch_started_s if r.switching_to else r.since_s), 4),
                "switching_to": r.switching_to.value if r.switching_to else None,
                "switch_count": r.count,
                "pause_total_ms": round(r.pause_total_s * 1e3, 3),
                "switches": [x.as_dict() for x in recent(r.records)],
            }
            if node.config.mode == "adaptive":  # prompt tokens each MIXED step may take now
                d["chunk_budget"] = e.chunk_tokens
        if getattr(e, "spec", None) is not None:  # --speculative-config (node.runtime.spec_decode)
            st = e.spec.stats
            d["speculative"] = {"method": e.spec.planner.config.kind, "drafts": st.drafts, "draft_tokens": st.draft_tokens, "accepted_tokens": st.accepted_tokens,
                                "acceptance_rate": round(st.acceptance_rate, 4),
                                "mean_accepted_length": round(st.mean_accepted_length, 4),
                                "rolled_back_blocks": e.spec.rolled_back_blocks,
                                "max_batch": e.spec.planner.config.max_batch}
        devices.append(d)
    return {
        "model": node.config.model_name,
        "benchmark_model": node.config.benchmark_model,  # zero / sleep:MS / timed:PATH: a bench run, outputs meaningless
        # the cost model the time-shared policy started from (--cost-model, or a timed device's), else null
        "cost_model": node.config.policy_cost_model,
        "mode": node.config.mode,
        "max_model_len": node.max_model_len,
        "block_size": node.config.block_size,
        "slo": {"ttft_ms": node.config.ttft_slo_ms, "tpot_ms": node.config.tpot_slo_ms},
        "reconfig_pause_ms": node.config.reconfig_pause_ms,
        "queue_depth": node.num_waiting,
        "request_timeout_s": node.config.request_timeout_s or None,  # the deadline of every request (s); null: none
        "live_requests": len(node.live),
        # --api-processes: the front ends' pids (empty: the API runs in the node's process)
        "api_processes": list(node.api_pids),
        "oldest_request_age_s": round(node.oldest_request_age_s(now), 4),
        "requests_timed_out": node.timed_out,
        "draining": node.draining,
        "clock_s": round(now, 6),
        "started_wall_s": node.started_wall_s,  # changes when the node restarts
        "uptime_s": round(time.time() - node.started_wall_s, 3),
        "devices": devices,
        "kv_transfers": [asdict(m) for m in recent(node.migrations)],
        "latency": node.metrics.latency_histograms(),
        "network": _network_status(node, now),
        "grammar_cache": grammar_cache_status(),  # this process's compiled grammars (structured output)
    }


def _network_status(node: StatusSource, now: float) -> dict:
    """``network`` of ``GET /v1/node``: this node's fingerprint and transfer settings, each peer's
    state (ready / unreachable / refused) and reason, and the inbound connections refused."""
    cfg = node.config
    out: dict = {"node_id": cfg.name, "kv_port": node.receiver.port if node.receiver else None,
                 "fingerprint": msgspec.structs.asdict(node.fingerprint) if node.fingerprint else None,
                 "config": {"kv_connect_timeout_s": cfg.kv_connect_timeout_s,
                            "kv_transfer_timeout_s": cfg.kv_transfer_timeout_s, "peer_stale_s": cfg.peer_stale_s,
                            "max_retries": cfg.max_retries, "link_gbps": cfg.link_gbps,
                            "kv_transport": cfg.kv_transport}}
    if node.nixl:
        out["nixl"] = node.nixl.status()
    if node.receiver:
        out["received_sequences"] = node.receiver.relayed
        out["receiving"] = len(node.receiver.incoming)
        out["receiving_on"] = sorted(e.device_id for e, *_ in list(node.receiver.incoming.values()))
        out["refused_inbound"] = node.receiver.refused.as_list(now)
    if node.peers:
        out["sending_from"] = sorted(node.peers.sending.values())  # the source device of each unsettled hand-off
        out["peers"] = [p.as_dict(now, node.peers.stale_s) for p in list(node.peers.peers.values())]
    if node.membership:
        out["membership"] = node.membership.status()
    return out


def _since(history: int, since_s: float | None):
    """A function giving a record history's last ``history`` entries, or with ``since_s`` all kept
    entries whose ``end_s`` is later (a full scan: of at most 1000 records, and the append order is
    not strictly the end order)."""
    def pick(records) -> list:
        items = list(records)
        return items[-history:] if since_s is None else [x for x in items if x.end_s > since_s]
    return pick


def _pool_bytes(kv_cache) -> int | None:
    """Bytes of a device's KV pool as allocated (None: a tensor-parallel group's, sharded across ranks)."""
    return None if kv_cache is None else kv_cache.numel() * kv_cache.element_size()
