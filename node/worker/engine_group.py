"""A tensor-parallel group of engine processes run as one device, and how a node launches its engines.

See :class:`TPEngineGroup`; the single-device engine is :class:`~node.worker.engine_process.EngineProcess`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import shutil
import threading
from typing import Any

import msgspec
import structlog

from node.config import NodeConfig
from node.log_native import stderr_uncaptured
from node.core.role_config import column_ranks
from node.transport.protocol import Fingerprint
from node.worker.engine_core import StepMsg, StepReply
from node.worker.engine_messages import EngineDied, EngineError, Prepare, Reconfigure, StepAck, TPRank
from node.worker.engine_messages import retrieved as _retrieved
from node.worker.engine_process import EngineProcess, submit_from_thread
from node.worker.engine_start import start_method

log = structlog.get_logger("shiftnode.engine_group")


class TPEngineGroup:
    """The node's handle on a tensor-parallel group: ``D`` engine processes, one rank each, run as
    one device (the surface of :class:`EngineProcess`).

    Launching. Each device of the group gets its own engine process (rank ``r`` on ``devices[r]``);
    the ranks form their own ``torch.distributed`` world of size ``D`` (gloo on the CPU, NCCL on
    CUDA) through a ``file://`` rendezvous in a fresh temporary folder, removed at :meth:`stop`, so
    groups are independent of each other.

    Steps. :meth:`async_submit` encodes a request once and writes it to every rank in the same order
    (the order of the ranks' collectives is the order of the requests, so they always match); the
    future resolves once every rank has answered, to rank 0's reply. Ranks other than 0 answer a
    step with a :class:`StepAck` of their sampled token ids, checked against rank 0's (every rank
    samples from the same gathered logits with the same seeded generator, so they agree; a
    disagreement is a group that can no longer be trusted). An exception that every rank raised the
    same way (a ``KeyError`` of a diff, before any collective) is an :class:`EngineError` and the
    group goes on.

    Failure. A rank that dies, whose pipe closes, that fails while another succeeds, or that
    disagrees with rank 0 makes the whole group down: the future fails with :class:`EngineDied`
    naming the group, the rank and its device and the reason, and the surviving ranks are
    terminated (a rank waiting in a collective for a dead peer would otherwise wait
    :data:`~node.worker.engine_process.TP_TIMEOUT_S`). A rank that hangs without dying delays the step until the collective
    timeout ends it.

    KV pool. Each rank's pool holds its ``K/D`` KV heads, all with the same ``num_blocks``; there is
    no node-side view of the group's whole pool (``kv_cache`` is None, the ranks' shards are in
    ``kv_caches``): in-node moves copy rank by rank, re-sharding the heads between groups of different
    degrees (:func:`~node.transport.local.copy_sharded_blocks`); KV transfers to peers are refused.

    Time-shared groups (``--decode-tp D --prefill-tp P``, :mod:`node.worker.role_layouts`): at start
    each rank gets its column's pools mapped (:class:`PeerPools`) and the prefill layout made active;
    :meth:`set_role` switches the layout of every rank. A step of several prefill instances
    (``StepMsg.instances``) is answered by each instance's first rank (ranks ``0 .. D/P - 1``) with
    its items' outputs, merged here item by item; the other ranks' sampled ids must equal the merge.
    """

    method = "process"

    def __init__(self, config: NodeConfig, devices: list[str], method: str):
        import tempfile

        from node.config import group_id

        self.devices = list(devices)
        self.device_id = group_id(devices)
        self.degree = len(devices)
        # a time-shared group: decode at the group's degree, prefill as instances of --prefill-tp
        self.prefill_degree = config.prefill_tp if config.role_policy else 0
        self.instances = self.degree // self.prefill_degree if self.prefill_degree else 1
        self.active_role: str | None = None  # the layout the ranks run (time-shared groups)
        self._dir = tempfile.mkdtemp(prefix="shiftnode-tp-")
        init = f"file://{self._dir}/rendezvous"
        self.ranks = [EngineProcess(config, d, method, TPRank(r, self.degree, init, self.device_id, self.prefill_degree))
                      for r, d in enumerate(devices)]
        self._enc = msgspec.msgpack.Encoder()
        self._dead: EngineDied | None = None
        self._reason: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self.kv_cache = None  # no node-side view of the whole (sharded) pool: see the class docstring
        self.num_blocks = 0
        self.threads = 0

    @classmethod
    def launch(cls, config: NodeConfig, devices: list[str], method: str | None = None) -> "TPEngineGroup":
        """Start the group's ``len(devices)`` engine processes (started by ``method`` as
        :meth:`EngineProcess.launch`; None: :func:`~node.worker.engine_start.start_method`'s choice)."""
        group = cls(config, devices, method or start_method(devices))
        for rank in group.ranks:
            with stderr_uncaptured():  # the child's descriptor 2 is the real one (node.log_native)
                rank.process.start()
            rank._child_conn.close()
        return group

    @property
    def processes(self) -> list:
        return [r.process for r in self.ranks]

    @property
    def process(self):
        """Rank 0's process (the group's ``pid``); all of them are in :attr:`processes`."""
        return self.ranks[0].process

    @property
    def pid(self) -> int | None:
        return self.ranks[0].pid

    @property
    def pids(self) -> list[int | None]:
        return [r.pid for r in self.ranks]

    @property
    def kv_caches(self) -> list:
        """Each rank's KV pool ``[layers, 2, num_blocks, block_size, K/D, head_dim]`` (its KV heads)."""
        return [r.kv_cache for r in self.ranks]

    @property
    def stopping(self) -> bool:
        return self.ranks[0].stopping

    @stopping.setter
    def stopping(self, value: bool) -> None:
        for r in self.ranks:
            r.stopping = value

    def wait_ready(self) -> None:
        """Block until every rank has loaded and shared its KV pool.

        Raises:
            EngineError: a rank's loading failed (the first failure, naming its rank and device).
            EngineDied: a rank ended before it was ready.
            StartupError: the ranks report different ``num_blocks`` (they agree by construction).
        """
        errors: list[tuple[int, BaseException]] = []
        threads = [threading.Thread(target=lambda i=i: self._wait_rank(i, errors)) for i in range(self.degree)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            # a rank that failed on its own is the cause; the others then fail in the rendezvous or die with it
            i, e = min(errors, key=lambda x: (not isinstance(x[1], EngineError), x[0]))
            message = f"tensor-parallel group {self.device_id}: rank {i} ({self.devices[i]}): {e}"
            raise (EngineError(message, e.kind) if isinstance(e, EngineError) else EngineDied(message)) from e
        blocks = {r.num_blocks for r in self.ranks}
        if len(blocks) != 1:
            from node.worker.loader import StartupError

            raise StartupError(f"tensor-parallel group {self.device_id}: ranks disagree on num_blocks {sorted(blocks)}")
        self.num_blocks, self.threads = self.ranks[0].num_blocks, self.ranks[0].threads
        if self.prefill_degree:
            self._start_layouts()

    def _start_layouts(self) -> None:
        """A time-shared group: map each rank's column of pools into it (several prefill instances),
        then make the prefill layout active (devices start in the prefill role). Before :meth:`attach`.

        Raises:
            EngineError, EngineDied: a rank failed or died (named with its device).
        """
        handles = dict(enumerate(self.ranks))
        for i, r in enumerate(self.ranks):
            if self.instances > 1:
                column = column_ranks(i, self.degree, self.prefill_degree)
                self._named(i, lambda r=r, column=column: r.send_pools(column, handles))
        for r in self.ranks:  # every rank first: the switch ends in a barrier of the whole group
            r.send_sync(Reconfigure("prefill"))
        for i, r in enumerate(self.ranks):
            self._named(i, r.recv_value)
        self.active_role = "prefill"

    def _named(self, i: int, fn) -> Any:
        try:
            return fn()
        except (EngineError, EngineDied) as e:
            for other in self.ranks:
                if other.process.is_alive():
                    other.process.terminate()
            message = f"tensor-parallel group {self.device_id}: rank {i} ({self.devices[i]}): {e}"
            raise (EngineError(message, e.kind) if isinstance(e, EngineError) else EngineDied(message)) from e

    def _wait_rank(self, i: int, errors: list) -> None:
        try:
            self.ranks[i].wait_ready()
        except BaseException as e:  # noqa: BLE001 - collected; wait_ready raises the first cause
            errors.append((i, e))
            for other in self.ranks:  # the others would wait TP_TIMEOUT_S in the rendezvous for it
                if other.process.is_alive():
                    other.process.terminate()

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Attach every rank's socket to ``loop`` (see :meth:`EngineProcess.attach`)."""
        self._loop = loop
        self._loop_thread = threading.get_ident()
        for r in self.ranks:
            r.attach(loop)

    def detach(self) -> None:
        for r in self.ranks:
            r.detach()
        self._loop = None

    def async_submit(self, msg: Any) -> asyncio.Future:
        """Send ``msg`` to every rank, in order with the earlier ones; the future resolves to rank 0's
        reply once all ranks answered (see the class docstring for errors).

        Raises:
            EngineDied: the group is already down.
        """
        if self._dead is not None:
            raise self._dead
        frame = self._enc.encode(msg)
        futs = []
        for i, r in enumerate(self.ranks):
            try:
                futs.append(r.async_submit_frame(frame))
            except EngineDied as e:
                self._down(f"rank {i} ({self.devices[i]}): {e}")
                raise self._dead from e
        out = self._loop.create_future()
        out.add_done_callback(_retrieved)  # a group that went down may leave it unread
        instances = msg.instances if isinstance(msg, StepMsg) else []
        for f in futs:
            f.add_done_callback(_retrieved)  # read by _settle, or moot once the group's reply is settled
            f.add_done_callback(lambda _f: self._settle(futs, out, instances))
        return out

    def _settle(self, futs: list[asyncio.Future], out: asyncio.Future, instances: list[int] = ()) -> None:
        if out.done():
            return
        for i, f in enumerate(futs):
            if f.done() and not f.cancelled() and isinstance(f.exception(), EngineDied):
                self._down(f"rank {i} ({self.devices[i]}): {f.exception()}")
                out.set_exception(self._dead)
                return
        if not all(f.done() for f in futs):
            return
        errors = [f.exception() for f in futs]
        if all(e is None for e in errors):
            first = futs[0].result()
            if isinstance(first, StepReply) and instances:  # each item's outputs from its instance's first rank
                leaders = [futs[s].result() for s in range(self.instances)]
                if all(isinstance(r, StepReply) for r in leaders):
                    first = StepReply([leaders[s].outputs[i] for i, s in enumerate(instances)],
                                      max(r.busy_s for r in leaders))
            if isinstance(first, StepReply):
                want = [-1 if o.token_id is None else o.token_id for o in first.outputs]
                for i, f in enumerate(futs[1:], 1):
                    ack = f.result()
                    if isinstance(ack, StepReply):  # another instance's first rank: all tokens, merged
                        ack = StepAck([-1 if o.token_id is None else o.token_id for o in ack.outputs])
                    if not isinstance(ack, StepAck) or ack.tokens != want:
                        got = ack.tokens if isinstance(ack, StepAck) else type(ack).__name__
                        self._down(f"rank {i} ({self.devices[i]}) sampled {got} where rank 0 sampled {want}: "
                                   f"the ranks diverged")
                        out.set_exception(self._dead)
                        return
            out.set_result(first)
            return
        kinds = {getattr(e, "kind", type(e).__name__) if e is not None else None for e in errors}
        if len(kinds) == 1:  # every rank raised the same: a request's failure, contained
            out.set_exception(errors[0])
            return
        i = next(i for i, e in enumerate(errors) if e is not None)
        self._down(f"rank {i} ({self.devices[i]}) failed ({errors[i]}) while another rank did not: "
                   f"the ranks' collectives are out of step")
        out.set_exception(self._dead)

    def _down(self, why: str) -> None:
        """The group cannot serve any more: record the first reason, end the surviving ranks."""
        if self._reason is None:
            self._reason = f"tensor-parallel group {self.device_id} is down: {why}"
            (log.info if self.stopping else log.error)("tp_group_down", device=self.device_id, reason=self._reason)
        self._dead = EngineDied(self._reason)
        for r in self.ranks:
            if r.process.is_alive():
                r.process.terminate()

    def death_reason(self, process: Any = None) -> str:
        """Why the group is down: the first rank seen gone (its device, pid, exit code or signal).

        ``process``: the rank process whose end was just seen (its sentinel); without it, the first
        rank already reaped (a process's sentinel can be readable a moment before it is reapable)."""
        if self._reason is None:
            procs = self.processes
            if process in procs:
                i = procs.index(process)
            else:
                gone = [i for i, p in enumerate(procs) if p.exitcode is not None]
                i = gone[0] if gone else 0
            self._down(f"rank {i} ({self.devices[i]}): {self.ranks[i].death_reason()}")
        return self._reason

    def submit(self, msg: Any) -> concurrent.futures.Future:
        """:meth:`async_submit` from a thread other than the attached loop's (see :meth:`EngineProcess.submit`)."""
        return submit_from_thread(self, msg)

    def call(self, msg: Any) -> Any:
        return self.submit(msg).result()

    def prepare_decode(self) -> float:
        return self.call(Prepare()).value

    def set_role(self, role: str) -> float:
        """Switch every rank to ``role``'s layout (a time-shared group; :class:`Reconfigure`); the
        slowest rank's milliseconds are not known here: returns rank 0's, barrier included. Call from a
        thread other than the loop's, with no step in flight."""
        ms = self.call(Reconfigure(role)).value
        self.active_role = role
        return ms

    def fingerprint(self, config: NodeConfig, info: Any) -> Fingerprint:
        """Refused: peers (which need the fingerprint) are not supported for tensor-parallel groups yet."""
        raise EngineError(f"tensor-parallel group {self.device_id}: no handshake fingerprint (KV transfers to "
                          f"peers are not supported with --tensor-parallel-size > 1 yet)", "TensorParallelError")

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop every rank (see :meth:`EngineProcess.stop`), then remove the rendezvous folder."""

        self.stopping = True
        for r in self.ranks:
            r.stop(timeout_s)
        shutil.rmtree(self._dir, ignore_errors=True)


def launch_engine(config: NodeConfig, devices: list[str], method: str | None = None) -> "EngineProcess | TPEngineGroup":
    """The engine of one group of ``config.device_groups()``: an :class:`EngineProcess` for a single
    device, a :class:`TPEngineGroup` for ``tensor_parallel_size > 1``; started by ``method`` (None: a fork
    server's fork for CPU devices, a spawn for others: :func:`~node.worker.engine_start.start_method`)."""
    if len(devices) == 1:
        return EngineProcess.launch(config, devices[0], method)
    return TPEngineGroup.launch(config, devices, method)


def prelaunch(config: NodeConfig) -> dict[str, "EngineProcess | TPEngineGroup"]:
    """Fork the engines of ``config``'s CPU devices (groups, at ``--tensor-parallel-size`` > 1) now
    (call before the event loop starts and before any parallel torch work in this process), keyed by
    the group's device id. CUDA devices are spawned later. With two or more CPU engines the CPU
    kernels are built first, here, for all of them (:mod:`node.worker.engine_preload`)."""
    if config.engine_layout != "process" or config.tensor_parallel_error() is not None:
        return {}  # (a refused configuration is reported by Node.create)
    from node.config import group_id

    groups = [g for g in config.device_groups() if g[0].startswith("cpu")]
    if sum(len(g) for g in groups) > 1:  # built once here, not once per engine (node.worker.engine_preload)
        from node.worker.engine_preload import warm_cpu_kernels

        warm_cpu_kernels()
    return {group_id(g): launch_engine(config, g, "fork") for g in groups}
