"""The node: devices, their engines, and the request entry point used by the API.

One asyncio event loop drives every device's step loop; each device's model runs in its own engine
process (:mod:`node.worker.engine_process`; ``--engine-layout thread`` keeps it in a thread of this
process), whose socket the loop itself writes and reads (no thread hand-off per step). Requests enter
by ``open_request`` (or ``generate``, which wraps it) and leave by ``close_request``, which guarantees
that a request which ends for any reason (finished, failed, client gone) leaves no sequence and no KV
block behind.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
import time
from contextlib import suppress
from typing import AsyncIterator

import msgspec
import structlog

from node.config import NodeConfig, benchmark_cost_path
from node.log import request_lines
from node.core.sequence import SamplingParams
from node.core.pooled import PooledRouter
from node.runtime.admission import EnginesDown, KVCapacityExceeded, NodeDraining, QueueFullError, kv_fit_error
from node.runtime.engine import DeviceEngine
from node.runtime.engine_supervisor import EngineSupervisor
from node.runtime.moves import MigrationRecord
from node.runtime.membership import Membership, join as join_etcd
from node.runtime.kv_receiver import KVReceiver
from node.runtime.peer_links import PeerLinks
from node.runtime.pooled_driver import PooledDriver
from node.runtime.role_driver import RoleDriver
from node.runtime.role_policy import kv_copy_s_per_token, role_scheduler
from node.runtime.metrics import NodeMetrics, request_outcome
from node.runtime.accounting import account
from node.runtime.compile_watch import CompileWatch
from node.runtime.node_status import node_status
from node.runtime.delta_stream import DeltaStream
from node.runtime.output import SeqDelta
from node.runtime.request import RequestState
from node.runtime.resume import Resumer
from node.runtime.startup import load_engines
from node.transport.protocol import Fingerprint
from node.worker.engine_process import EngineProcess
from node.worker.loader import LoadedModel, StartupError

log = structlog.get_logger("shiftnode.node")


class Node:
    """A serving node over one or more devices.

    Use ``await Node.create(config)`` (loads weights in threads), then ``start()``; ``close()`` stops.
    """

    def __init__(self, config: NodeConfig, info: LoadedModel, engines: list[DeviceEngine],
                 fingerprint: Fingerprint | None = None):
        self.config = config
        self.info = info
        self.tokenizer = info.tokenizer
        self.max_model_len = info.max_model_len
        self.engines = engines
        self._by_id = {e.device_id: e for e in engines}
        self._ids = itertools.count()
        self.started_s = time.monotonic()
        self.started_wall_s = time.time()
        self.metrics = NodeMetrics(self)
        self.driver: RoleDriver | PooledDriver | None = None
        self.migrations: deque[MigrationRecord] = deque(maxlen=1000)
        self.draining = False
        self._started = False  # start() ran: a second call must not add a second step loop per device
        self.live: dict[str, RequestState] = {}  # request id → state, from admission until its last delta
        self.timed_out = 0  # requests ended by --request-timeout-s
        self.api_pids: list[int] = []  # --api-processes > 1: the front ends' pids, as they become ready
        self.api_down: dict[int, str] = {}  # --api-processes > 1: front ends that exited, by index → what next
        self.peers: PeerLinks | None = None
        self.receiver: KVReceiver | None = None
        self.membership: Membership | None = None  # --etcd
        self.nixl = None  # --kv-transport nixl: the NixlPlane (node.runtime.kv_plane), from start_network
        self.fingerprint: Fingerprint | None = None
        if self.networked(config):
            from node.transport.tensors import layout_of

            self.fingerprint = fingerprint or engines[0].runner.fingerprint(config, info)
            layout = layout_of(engines[0].runner.kv_cache, config.model_name, self.fingerprint)
            # peers can be added at run time (POST /v1/node/peers) wherever they could be given at start
            self.peers = PeerLinks(self, layout) if config.peers or config.mode != "colocated" else None
            self.receiver = KVReceiver(self, layout) if config.kv_port is not None else None
        timed = benchmark_cost_path(config.benchmark_model) is not None
        if config.role_policy:
            scheduler = role_scheduler(config, kv_copy_s_per_token(config, info.cfg.kv_bytes_per_token(info.dtype)))
            # timed devices take their cost model's time by construction: the policy plans with it unrefitted
            roles = config.role_configs()
            one = (not roles["decode"].cuda_graphs and roles["prefill"].tp_degree == roles["decode"].tp_degree)
            self.driver = RoleDriver(self, scheduler, time.monotonic, refit=not timed, one_configuration=one)
        elif config.mode == "pooled":
            self.driver = PooledDriver(self, PooledRouter(config.max_unsent), config.prefill_group_ids(),
                                       config.decode_group_ids(), time.monotonic)
        elif config.mode != "colocated":
            raise StartupError(f"unknown mode {config.mode!r} (adaptive, time-shared, colocated, pooled)")
        block_layer_bytes = None  # timed devices' transfers are paced and counted at the geometry's KV size
        if timed:
            block_layer_bytes = info.cfg.kv_bytes_per_token(info.dtype) // info.cfg.num_layers * config.block_size
        for e in engines:
            e.down_listeners.append(self._on_engine_down)
            e.migration_listeners.append(self._on_migration)
            e.link_gbps = config.link_gbps
            e.block_layer_bytes = block_layer_bytes
        self.compile_watch = CompileWatch(engines)  # each device's compiled buckets (GET /v1/node), and the idle poll
        self.supervisor = EngineSupervisor(config, engines)  # restarts dead engines (listening after the node)
        self.resumer = Resumer(self, self.supervisor)  # resumes their sequences elsewhere, or after the restart
        if self.driver:
            self.resumer.on_queued = self.driver.kick  # resumed prompt work: the device's role may change
        self.supervisor.left_down_listeners.append(self._on_engine_down)  # what waited for it fails now
        self.supervisor.restart_listeners.append(lambda _e: self.driver.kick() if self.driver else None)

    @classmethod
    async def create(cls, config: NodeConfig, prelaunched: dict[str, EngineProcess] | None = None) -> "Node":
        """Load the model's metadata here and each device's engine (see ``--engine-layout``).

        ``prelaunched``: engine processes already forked by ``shiftnode serve``
        (:func:`~node.worker.engine_group.prelaunch`); the other devices' engines are spawned.

        ``--tensor-parallel-size D`` (> 1): each consecutive group of ``D`` devices is one
        :class:`DeviceEngine` whose device id joins them with ``+`` (``cpu:0+cpu:1``), run by a
        :class:`~node.worker.engine_group.TPEngineGroup` (one engine process per rank).

        Raises:
            StartupError: an engine failed to load (its message), or died while loading; a
                tensor-parallel size the flags or the model cannot run with (:func:`check_tensor_parallel`).
        """
        info, engines, fingerprint = await load_engines(config, prelaunched, cls.networked(config))
        return cls(config, info, engines, fingerprint)

    @staticmethod
    def networked(config: NodeConfig) -> bool:
        """Whether the node talks to peers: ``--peers``, ``--kv-port``, or a ``--peer-secret`` (peers
        may then be added at run time)."""
        return (bool(config.peers) or config.kv_port is not None or bool(config.etcd)
                or bool(config.peer_secret and config.mode != "colocated"))

    def start(self) -> None:
        """Start every device's step loop and the driver. Idempotent."""
        if self._started:
            return
        self._started = True
        for e in self.engines:
            e.start()
        if self.driver:
            self.driver.start()
        self.compile_watch.start()

    async def start_network(self) -> None:
        """Open the KV transfer listener (``--kv-port``), start polling the ``--peers`` and join ``--etcd``
        (with ``--kv-transport nixl``, first start the NIXL agent and register the KV pools)."""
        if self.config.kv_transport == "nixl" and (self.receiver or self.peers):
            from node.runtime.kv_plane import NixlPlane

            self.nixl = await NixlPlane.start(self)
            for side in (self.receiver, self.peers):
                if side is not None:
                    side.nixl = self.nixl
        if self.receiver:
            await self.receiver.start()
        if self.peers:
            self.peers.start()
            if self.config.etcd:
                self.membership = join_etcd(
                    self.config, self.peers, self.receiver.port if self.receiver else None,
                    msgspec.structs.asdict(self.fingerprint), sum(e.batcher.ledger.num_blocks for e in self.engines))

    async def close(self) -> None:
        await self.supervisor.close()  # first: no engine is restarted while the node stops them
        await self.compile_watch.stop()
        if self.membership:  # first: the lease's revocation tells every peer at once
            await self.membership.close()
        if self.receiver:
            await self.receiver.close()
        if self.peers:
            await self.peers.close()
        if self.nixl:
            await self.nixl.close()
        if self.driver:
            await self.driver.stop()
        await asyncio.gather(*(e.stop() for e in self.engines))  # each bounded (a copy in flight: COPY_GRACE_S)

    def drain(self) -> int:
        """Stop taking requests and move every decoding sequence to the ``--peers`` (time-shared mode),
        so the node can be stopped without cutting a stream: prompts already admitted are prefilled
        here and then moved too. Returns the number of sequences still on this node's devices.

        Raises:
            ValueError: the node has no peers or is not in time-shared mode.
        """
        if self.peers is None or not self.peers.peers or not self.config.role_policy:
            raise ValueError("drain needs time-shared mode and --peers to move the sequences to (adaptive mode is "
                             "time-shared too)")
        if not self.draining:
            log.info("node_draining", peers=[p.addr for p in self.peers.peers.values()])
        self.draining = True
        self.driver.kick()
        return sum(len(e.batcher.running) + len(e.batcher.waiting) for e in self.engines) + len(self.driver.pending)

    def engine(self, device_id: str) -> DeviceEngine:
        return self._by_id[device_id]

    def _on_migration(self, src: DeviceEngine, dst: DeviceEngine, seq, record: MigrationRecord) -> None:
        self.record_migration(src.device_id, dst.device_id, record)

    def record_migration(self, src: str, dst: str, record: MigrationRecord) -> None:
        """Count and keep one sequence's KV move (``dst`` is a device id or ``peer:host:port``)."""
        self.metrics.kv_transfers.labels(src=src, dst=dst, reason=record.reason).inc()
        self.metrics.kv_transfer_bytes.inc(record.nbytes)
        self.metrics.kv_transfer_seconds.observe(record.end_s - record.start_s)
        self.migrations.append(record)

    # --- requests ----------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        """Sequences waiting: those of requests not yet placed (``n`` each) plus those placed but not
        yet admitted to a step. ``--max-queue`` bounds this count."""
        pending = sum(len(r.seqs) for r in self.driver.pending) if self.driver else 0
        return pending + sum(len(e.batcher.waiting) for e in self.engines)

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}-{int(time.time() * 1000) % 10**9}"

    def least_loaded(self, device_ids: list[str] | None = None) -> DeviceEngine:
        """The device (of ``device_ids``, default all) with the fewest queued, then resident, sequences."""
        engines = self.engines if device_ids is None else [self.engine(d) for d in device_ids]
        up = [e for e in engines if e.failure is None] or engines  # a down device fails what it is given
        return min(up, key=lambda e: (len(e.batcher.waiting), len(e.batcher.running)))

    def _on_engine_down(self, engine: DeviceEngine) -> None:
        """A device went down (or will not be restarted); once none is left and none will be restarted,
        requests waiting for placement fail (503); while a restart is planned they wait for it."""
        if (all(e.failure for e in self.engines) and self.driver is not None
                and not any(self.supervisor.will_restart(e) for e in self.engines)):
            for req in list(self.driver.pending):
                self.driver.withdraw(req)
                req.fail(f"every device is down ({engine.device_id}: {engine.failure})", status=503,
                         code="engine_down", retry_after_s=1.0)

    def check_admission(self, new: int) -> None:
        """Whether ``new`` more requests may be queued now; every refusal is counted
        (``shiftnode_rejected_requests_total``).

        Raises:
            NodeDraining, EnginesDown, QueueFullError: the node takes no request now (the API's 503).
        """
        refusal: QueueFullError | None = None
        if self.draining:
            refusal = NodeDraining("the node is draining to its peers and takes no new requests")
        elif all(e.failure for e in self.engines):
            refusal = EnginesDown("; ".join(f"{e.device_id} is down: {e.failure}" for e in self.engines))
        elif self.num_waiting + new > self.config.max_queue:
            refusal = QueueFullError(f"{self.num_waiting} sequences are queued (limit {self.config.max_queue})")
        if refusal is not None:
            self.metrics.rejected.inc()
            raise refusal

    def open_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams, n: int = 1, *,
                     stream: DeltaStream | None = None, index0: int = 0, detokenize: bool = True) -> RequestState:
        """Admit one request and hand it to a device or the driver; its deltas go to ``stream`` (a new
        one by default) with choice indexes from ``index0``. The caller takes them, passes each to
        :meth:`account`, and calls :meth:`close_request` in all cases (``finally``). ``detokenize=False``:
        the deltas carry token ids only (an API front end makes the text: :mod:`node.api.frontend`).

        Raises:
            NodeDraining, EnginesDown, QueueFullError: the node takes no request now (the API's 503).
            KVCapacityExceeded: the request can never fit a device's KV cache (the API's 400).
        """
        m = self.metrics
        self.check_admission(1)
        prefillers = self.config.prefill_group_ids() if self.config.mode == "pooled" else None
        problem = kv_fit_error(len(prompt_ids), n, self.config.mode, self.config.block_size,
                               [e.batcher.ledger.num_blocks for e in self.engines
                                if prefillers is None or e.device_id in prefillers])
        if problem:
            raise KVCapacityExceeded(problem)
        req = RequestState(request_id, prompt_ids, params, n, self.tokenizer, self.eos_ids(),
                           self.max_model_len, time.monotonic(), stream=stream, index0=index0, detokenize=detokenize)
        m.prompt_tokens.inc(len(prompt_ids))
        self.live[request_id] = req
        if self.config.request_timeout_s:  # None or 0: no bound
            req.timer = asyncio.get_running_loop().call_later(self.config.request_timeout_s, self._expire, req)
        if self.driver:
            self.driver.submit(req)
        else:
            self.least_loaded().add(req)
        return req

    def account(self, req: RequestState, delta: SeqDelta, now: float) -> None:
        """Count a delta of ``req`` the consumer took at ``now`` (s, monotonic): TTFT, ITL, TPOT,
        tokens, and the choice's end (:func:`~node.runtime.accounting.account`)."""
        account(self.metrics, req, delta, now)

    def close_request(self, req: RequestState) -> None:
        """The consumer is done with ``req`` (every choice ended, or it gave up): cancel what still
        runs, free its state, and record its metrics and log line. Idempotent."""
        if req.request_id not in self.live:
            return
        m = self.metrics
        if req.timer is not None:
            req.timer.cancel()
        self.live.pop(req.request_id, None)
        if not req.done:
            self._cancel(req)
        reasons = [r or "abort" for r in req.reasons]
        if self.peers:
            for seq in req.seqs:
                self.peers.retries.pop(seq.seq_id, None)
        self.resumer.forget(req)
        if self.driver:
            self.driver.finished(req, reasons, sum(req.tokens))
        s = req.stats
        end = time.monotonic()
        m.e2e.observe(end - s.arrival_s)
        for r in reasons:
            m.choices.labels(finish_reason=r).inc()
        m.requests.labels(finish_reason=request_outcome(reasons)).inc()
        first = req.first_s[0]
        with suppress(Exception):
            if not req.log_line or not request_lines():  # a front end logs the requests it owns (frontend_node)
                return
            log.info(
                "request", request_id=req.request_id, device=req.seqs[0].device_id, prompt_tokens=s.prompt_tokens,
                output_tokens=s.output_tokens, n=len(req.seqs), finish_reason=reasons[0] if len(reasons) == 1 else reasons,
                ttft_ms=None if first is None else round((first - s.arrival_s) * 1e3, 2),
                total_ms=round((end - s.arrival_s) * 1e3, 2),
            )

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams, n: int = 1) -> AsyncIterator[tuple[RequestState, SeqDelta]]:
        """Run one request; yield ``(state, delta)`` for every delta of every choice until all end
        (in-process callers; the API takes whole batches from the stream itself).

        Raises:
            NodeDraining, EnginesDown, QueueFullError: see :meth:`open_request`.
        """
        req = self.open_request(request_id, prompt_ids, params, n)
        try:
            while None in req.reasons:  # drain until every choice's last delta was consumed
                batch = await req.stream.take()
                now = time.monotonic()
                for delta in batch:
                    self.account(req, delta, now)
                    yield req, delta
        finally:
            self.close_request(req)

    def _cancel(self, req: RequestState) -> None:
        """Stop all work for a request that will not be consumed further: withdraw it if unplaced,
        else abort it on its devices (its blocks return to the ledgers at their next step boundary)
        and tell the peers to drop their copies."""
        req.cancelled = True
        if self.driver and self.driver.withdraw(req):
            return
        for device_id in dict.fromkeys(s.device_id for s in req.seqs if s.device_id):
            if device_id in self._by_id:
                self.engine(device_id).abort(req.request_id)
        if self.peers:  # hand-offs in flight and relays from peers: the peers drop their copies
            self.peers.cancel(req.request_id)

    def _expire(self, req: RequestState) -> None:
        """``--request-timeout-s`` passed: free the request's work and end its unfinished choices with
        an error (503 ``request_timeout`` for a non-streamed client, an error event in a stream)."""
        if req.done:
            return
        self.timed_out += 1
        self.metrics.request_timeouts.inc()
        log.warning("request_timeout", request_id=req.request_id, timeout_s=self.config.request_timeout_s,
                    output_tokens=req.stats.output_tokens)
        self._cancel(req)
        req.fail(f"request exceeded --request-timeout-s {self.config.request_timeout_s:g} s and was stopped",
                 status=503, code="request_timeout", retry_after_s=1.0)

    def oldest_request_age_s(self, now_s: float) -> float:
        """Age (s) of the oldest request admitted and not yet finished; 0 with none."""
        return max((now_s - r.stats.arrival_s for r in list(self.live.values())), default=0.0)

    def eos_ids(self) -> list[int]:
        return self.tokenizer.eos_token_ids or list(self.info.cfg.eos_token_ids)

    # --- introspection -----------------------------------------------------------------------
    def role_of(self, e: DeviceEngine, decoders: list[str] | None = None) -> str:
        """What device ``e`` does now: its role (``prefill``, ``decode``, or ``switching`` during a
        time-shared switch; a pooled prefill device's is fixed), ``decode`` for a pooled decode group,
        else ``mixed`` (colocated chunked prefill)."""
        if e.role is not None:
            return e.role.role.value
        return "decode" if e.device_id in (decoders if decoders is not None else self.config.decode_group_ids()) else "mixed"

    def status(self, history: int = 200, since_s: float | None = None) -> dict:
        """The node's state for ``GET /v1/node`` (:func:`node.runtime.node_status.node_status`)."""
        return node_status(self, history, since_s)
