"""The NIXL data plane's local end: one NIXL agent (UCX backend) per node, on a thread of its own.

Who registers the KV pool. The node process does: it is where KV transfers to peers run (the TCP
channel of :mod:`node.transport`, the receiver's block reservations, the hand-off bookkeeping of
:mod:`node.runtime.handoff`), and it already maps every device's pool (an engine process allocates
its pool in a ``memfd`` the node maps, or on CUDA exports it through CUDA IPC; see
:mod:`node.worker.engine_process`). Registering that mapping lets a remote agent write straight into
the pages the engine computes on, with no message to the engine process per layer and no copy.
Registering in the engine process instead would put the agent beside the compute (which GPUDirect
RDMA of an IPC-imported CUDA pointer may need; not tried here: this was built and measured on CPU
hosts) but every transfer would then need a second control channel from the node to its engines.
Tensor-parallel groups (a pool sharded across ranks) are not registered: they take no peer KV.

Threading. A NIXL agent is not thread-safe in the mode used here (no listener thread:
``NIXL_THREAD_SYNC_NONE``) and each of its calls is synchronous, so one thread (``nixl-agent``) owns
the agent: every call runs there, submitted from the event loop through :meth:`NixlAgent._call`.
The agent's own progress thread is off (``enable_prog_thread=False``: it spins a core even when
idle); instead the thread polls (``check_xfer_state``, ``get_new_notifs``, which drive UCX's
progress) only while a transfer of ours is in flight or a notification is awaited, sleeping
``poll_s`` between polls that found nothing, and blocks on its job queue otherwise. A receiver must
poll while it awaits a transfer: on transports without one-sided hardware (``UCX_TLS=tcp``) UCX
emulates a remote write with messages that the target's progress handles.

Transfers are WRITEs by the sender (the node that holds the sequence), one NIXL request per layer,
whose notification (``{transfer_id}|{layer}``) tells the receiver that layer landed: NIXL delivers a
request's notification only after its data. A layer's descriptors (:mod:`node.transport.nixl_descriptors`)
are the K and V halves of runs of blocks consecutive on both sides. The remote pool's address comes
from the peer in a :class:`~node.transport.protocol.NixlPool` over the authenticated TCP channel.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import queue
import threading
import time
import uuid
from typing import Any, Callable

import numpy as np
import structlog

from node.transport.errors import TransferAborted, TransportError, TransportTimeout
from node.transport.nixl_descriptors import block_runs, layer_descs
from node.transport.protocol import Layout, NixlPool

_log = structlog.get_logger("node.transport")

_MODULES = ("nixl_cu12._api", "nixl_cu13._api", "nixl._api")  # the wheels on PyPI, newest packaging first
INSTALL_HINT = "install it with `pip install 'shiftnode[nixl]'` (the nixl-cu12 wheel, Linux x86_64)"


class NixlUnavailable(TransportError):
    """NIXL cannot be used here: the package is missing or its UCX backend did not load."""


def load_nixl() -> Any:
    """The NIXL Python API module (``nixl_agent``, ``nixl_agent_config``). Raises :class:`NixlUnavailable`."""
    errors = []
    for name in _MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as e:
            errors.append(f"{name}: {e}")
    raise NixlUnavailable(f"--kv-transport nixl needs the NIXL package, which is not importable "
                          f"({'; '.join(errors)}); {INSTALL_HINT}")


def nixl_available() -> bool:
    """Whether :func:`load_nixl` would succeed (imports the package)."""
    try:
        load_nixl()
    except NixlUnavailable:
        return False
    return True


class _Expect:
    """Layer notifications awaited for one inbound transfer (filled by the agent's thread)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue[int] = asyncio.Queue()


class NixlAgent:
    """This node's NIXL agent: registered KV pools, peers' metadata, layer WRITEs, notifications.

    Create with :meth:`create` (about 0.5 s: UCX's start-up, on the agent's thread). ``poll_s``:
    the pause (s) after a poll that found nothing while something is in flight.
    """

    def __init__(self, name: str, poll_s: float = 50e-6):
        self.name = name
        self.poll_s = poll_s
        self.pools: list[NixlPool] = []
        self._regs: list[Any] = []
        self._nixl: Any = None
        self._agent: Any = None
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._xfers: list[tuple[Any, asyncio.Future, float, str]] = []  # (handle, future, deadline, what): thread only
        self._expect: dict[str, _Expect] = {}  # transfer id → its awaited notifications (thread reads, loop writes)
        self._remotes: dict[str, tuple[str, bytes]] = {}  # peer key (node id) → (agent name, metadata) loaded
        self._closed = False
        self.layers_written = 0  # layer WRITEs completed by us
        self.layers_received = 0  # layer notifications received for transfers we awaited
        self._thread = threading.Thread(target=self._run, name="nixl-agent", daemon=True)

    @classmethod
    async def create(cls, node_id: str, poll_s: float = 50e-6) -> "NixlAgent":
        """Load NIXL and start an agent named after ``node_id`` (plus the process id and a random part,
        so a restarted node is a new agent to its peers). Raises :class:`NixlUnavailable`."""
        self = cls(f"{node_id}/{os.getpid()}/{uuid.uuid4().hex[:8]}", poll_s)
        self._nixl = load_nixl()
        self._thread.start()
        try:
            await self._call(self._start_agent)
        except Exception as e:
            self._closed = True
            self._jobs.put(None)
            raise NixlUnavailable(f"the NIXL agent did not start: {type(e).__name__}: {e}") from e
        return self

    def _start_agent(self) -> None:
        cfg = self._nixl.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        self._agent = self._nixl.nixl_agent(self.name, cfg)
        if "UCX" not in self._agent.backends:
            raise NixlUnavailable(f"the UCX backend is not available (plugins: {self._agent.get_plugin_list()})")

    # --- the agent's thread ---------------------------------------------------------------------
    def _call(self, fn: Callable, *args) -> asyncio.Future:
        """Run ``fn(*args)`` on the agent's thread; the future (of the running loop) gets its result."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        if self._closed:
            fut.set_exception(TransportError("the NIXL agent is closed"))
            return fut
        self._jobs.put((fn, args, fut, loop))
        return fut

    @staticmethod
    def _resolve(fut: asyncio.Future, loop: asyncio.AbstractEventLoop, value: Any = None,
                 error: BaseException | None = None) -> None:
        def set_() -> None:
            if fut.done():
                return
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(value)
        try:
            loop.call_soon_threadsafe(set_)
        except RuntimeError:  # the loop is closed: nobody waits
            pass

    def _run(self) -> None:
        while True:
            busy = bool(self._xfers or self._expect)
            try:
                job = self._jobs.get(timeout=self.poll_s) if busy else self._jobs.get()
            except queue.Empty:
                job = ()
            if job is None:
                break
            if job:
                fn, args, fut, loop = job
                try:
                    value = fn(*args)
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    self._resolve(fut, loop, error=e)
                else:
                    self._resolve(fut, loop, value)
            if self._agent is not None and (self._xfers or self._expect):
                try:
                    self._poll()
                except Exception as e:  # noqa: BLE001 - the thread must outlive a failing poll (waits time out)
                    _log.warning("nixl_poll_failed", error=f"{type(e).__name__}: {e}")
        for handle, fut, _, _ in self._xfers:  # closing: whoever waits learns it
            self._resolve(fut, fut.get_loop(), error=TransportError("the NIXL agent closed"))
            self._release(handle)
        self._xfers.clear()

    def _poll(self) -> None:
        """One round of progress: finished or failed writes resolve; notifications are dispatched."""
        now = time.monotonic()
        still = []
        for handle, fut, deadline, what in self._xfers:
            try:
                state = self._agent.check_xfer_state(handle)
            except Exception as e:  # noqa: BLE001 - e.g. the peer disconnected: this write failed
                state = f"{type(e).__name__}: {e}"
            if state == "DONE":
                self.layers_written += 1
                self._release(handle)
                self._resolve(fut, fut.get_loop())
            elif state != "PROC":
                self._release(handle)
                self._resolve(fut, fut.get_loop(), error=TransferAborted(f"NIXL write of {what} failed ({state})"))
            elif now > deadline or fut.cancelled():
                self._release(handle)  # cancels the request where the backend can
                self._resolve(fut, fut.get_loop(), error=TransportTimeout(f"NIXL write of {what} not done in time",
                                                                          "stall"))
            else:
                still.append((handle, fut, deadline, what))
        self._xfers = still
        for msgs in self._agent.get_new_notifs().values():
            for msg in msgs:
                tid, _, layer = bytes(msg).decode(errors="replace").rpartition("|")
                exp = self._expect.get(tid)
                if exp is None or not layer.isdigit():
                    _log.debug("nixl_notification_dropped", notif=bytes(msg)[:200])
                    continue
                self.layers_received += 1
                try:
                    exp.loop.call_soon_threadsafe(exp.queue.put_nowait, int(layer))
                except RuntimeError:
                    pass

    @staticmethod
    def _release(handle: Any) -> None:
        try:
            handle.release()
        except Exception as e:  # noqa: BLE001 - a request that could not be cancelled is logged, kept by NIXL
            _log.warning("nixl_release_failed", error=f"{type(e).__name__}: {e}")

    # --- memory and peers -----------------------------------------------------------------------
    async def register(self, kv_cache: Any, index: int | None = None) -> NixlPool:
        """Register a device's KV pool ``[num_layers, 2, num_blocks, block_size, Hkv, D]`` (contiguous
        torch tensor, host or CUDA) and return how peers address it (its index is its place in
        :attr:`pools`). ``index``: replace that pool (a restarted engine's new one; its old registration
        is dropped first; peers learn the new address from :meth:`metadata` and :attr:`pools` on their
        next connection). Raises ValueError (not contiguous), NIXL's errors."""
        if not kv_cache.is_contiguous():
            raise ValueError("a KV pool must be contiguous to be registered with NIXL")
        dev = kv_cache.get_device()
        pool = NixlPool(addr=kv_cache.data_ptr(), num_blocks=int(kv_cache.shape[2]),
                        mem="DRAM" if dev < 0 else "VRAM", dev=max(dev, 0))
        if index is None:  # a new pool: its slot first
            index = len(self.pools)
            self._regs.append(None)
            self.pools.append(pool)
        else:
            await self.deregister(index)

        def reg() -> None:
            self._regs[index] = self._agent.register_memory(kv_cache)
        await self._call(reg)
        self.pools[index] = pool
        return pool

    async def deregister(self, index: int) -> None:
        """Drop pool ``index``'s registration (its engine died): peers' writes to it fail from now on."""
        def dereg() -> None:
            handle, self._regs[index] = self._regs[index], None
            if handle is not None:
                self._agent.deregister_memory(handle)
        await self._call(dereg)

    async def metadata(self) -> bytes:
        """This agent's metadata (connection info and registered memory) for a peer's :meth:`add_remote`."""
        return await self._call(lambda: bytes(self._agent.get_agent_metadata()))

    async def add_remote(self, peer: str, metadata: bytes) -> str:
        """Load a peer agent's metadata (parsed by NIXL: call this only for a peer that proved the shared
        secret). ``peer`` keys it (the ``host:port`` the authenticated connection dialed, not the node id
        the peer claims, which two misconfigured nodes may share): the same metadata again is not parsed again (a
        hand-off opens a connection each time), and a peer that restarted with a new agent replaces
        its old one. Returns the agent name to write to."""
        def load() -> str:
            known = self._remotes.get(peer)
            if known is not None and known[1] == metadata:
                return known[0]
            if known is not None:  # the peer restarted, or re-registered a pool: its old view goes first
                self._forget(known[0])
            name = self._agent.add_remote_agent(metadata)
            name = name.decode() if isinstance(name, bytes) else str(name)
            self._remotes[peer] = (name, metadata)
            return name
        return await self._call(load)

    def _forget(self, name: str) -> None:
        try:
            self._agent.remove_remote_agent(name)
        except Exception as e:  # noqa: BLE001 - already gone
            _log.debug("nixl_remove_remote_failed", agent=name, error=str(e))

    # --- transfers ------------------------------------------------------------------------------
    async def write_layers(self, remote: str, layout: Layout, local_pool: int, local_blocks: list[int],
                           remote_pool: NixlPool, remote_blocks: list[int], transfer_id: str,
                           stall_timeout_s: float, before_layer: Callable[[int, int], Any] | None = None,
                           on_layer: Callable[[int], None] | None = None) -> int:
        """WRITE one sequence's blocks ``local_blocks`` (of our pool ``local_pool``) into
        ``remote_blocks`` of the peer agent ``remote``, one request per layer in order, each notifying
        ``{transfer_id}|{layer}``. Up to every layer is in flight at once; each must finish within
        ``stall_timeout_s`` of being posted. ``before_layer(layer, nbytes)``: awaited before a layer is
        posted (a link throttle); ``on_layer(layer)``: called as each finishes. Returns the bytes
        written. Raises ``TransportTimeout`` (stage ``stall``), ``TransferAborted`` (NIXL reported an
        error), ``TransportError``."""
        half = layout.block_bytes // 2
        lstart, rstart, lengths = block_runs(np.asarray(local_blocks, np.int64), np.asarray(remote_blocks, np.int64))
        pool = self.pools[local_pool]
        nbytes = layout.layer_bytes(len(local_blocks))
        pending: list[asyncio.Future] = []
        try:
            for layer in range(layout.num_layers):
                if before_layer is not None:
                    await before_layer(layer, nbytes)
                local = layer_descs(pool, half, layer, lstart, lengths)
                rem = layer_descs(remote_pool, half, layer, rstart, lengths)
                done = asyncio.get_running_loop().create_future()
                pending.append(done)
                await self._call(self._post, remote, local, rem, pool.mem, remote_pool.mem,
                                 f"{transfer_id}|{layer}".encode(), stall_timeout_s, done)
            for layer, fut in enumerate(pending):
                await fut
                if on_layer is not None:
                    on_layer(layer)
        except BaseException:
            for fut in pending:
                fut.cancel()  # the thread releases (cancels) each request still in flight
            raise
        return nbytes * layout.num_layers

    def _post(self, remote: str, local: np.ndarray, rem: np.ndarray, local_mem: str, remote_mem: str,
              notif: bytes, stall_timeout_s: float, done: asyncio.Future) -> None:
        """(agent thread) Create and post one WRITE; ``done`` (a future of the loop) resolves when it finishes."""
        a = self._agent
        try:
            handle = a.initialize_xfer("WRITE", a.get_xfer_descs(local, local_mem),
                                       a.get_xfer_descs(rem, remote_mem), remote, notif)
        except Exception as e:  # e.g. nixlNotFoundError: the peer's agent was dropped
            raise TransferAborted(f"NIXL write of {notif.decode()} not created: {type(e).__name__}: {e}") from e
        try:
            state = a.transfer(handle)
        except Exception as e:  # e.g. nixlRemoteDisconnectError: the peer died
            self._release(handle)
            raise TransferAborted(f"NIXL write of {notif.decode()} failed: {type(e).__name__}: {e}") from e
        if state == "ERR":
            self._release(handle)
            raise TransferAborted(f"NIXL could not post the write of {notif.decode()}")
        self._xfers.append((handle, done, time.monotonic() + stall_timeout_s, notif.decode()))

    def expect(self, transfer_id: str) -> asyncio.Queue:
        """Start awaiting the layer notifications of an inbound transfer (before the sender may write):
        the queue receives each layer number as its notification arrives. End with :meth:`unexpect`."""
        exp = _Expect(asyncio.get_running_loop())
        self._expect[transfer_id] = exp
        self._jobs.put(())  # wake the thread: it polls while something is awaited
        return exp.queue

    def unexpect(self, transfer_id: str) -> None:
        self._expect.pop(transfer_id, None)

    async def close(self) -> None:
        """Stop the thread (writes in flight fail) and release the agent's memory registrations."""
        if self._closed:
            return
        if self._agent is not None:
            def dereg() -> None:
                for reg in filter(None, self._regs):
                    try:
                        self._agent.deregister_memory(reg)
                    except Exception as e:  # noqa: BLE001
                        _log.debug("nixl_deregister_failed", error=str(e))
                self._regs.clear()
            try:
                await self._call(dereg)
            except TransportError:
                pass
        self._closed = True
        self._jobs.put(None)
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 5.0)
