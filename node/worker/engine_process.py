"""One engine process per device: the model runs outside the node's process, the node keeps the loop.

This module is the node's side (:class:`EngineProcess`, the handle, and :class:`LocalEngine`, the
same engine in a thread); the process's own side is :mod:`node.worker.engine_main`, and the messages
they exchange besides steps are :mod:`node.worker.engine_messages`.

Layout. The node process runs the asyncio event loop (API, pure policies, drivers, detokenization);
each device's engine process owns the weights and runs :class:`~node.worker.engine_core.EngineCore`.
A step is one request/reply pair: the node's event loop writes a
:class:`~node.worker.engine_core.StepMsg` to the engine's socket and goes on (several may be
outstanding); the :class:`~node.worker.engine_core.StepReply` is read by the same loop when the socket
becomes readable (:meth:`EngineProcess.attach`). So the node's own Python work (scheduling,
post-processing, SSE) runs in parallel with the forward pass, and no thread of the node has to win
the GIL from a busy event loop to pass a step on (a hand-off between threads can wait the whole
5 ms switch interval).

Channel. A ``multiprocessing.Pipe`` (an ``AF_UNIX`` socket pair) carrying msgspec MessagePack
frames. One producer and one consumer on one host, strictly alternating request and reply: a socket
pair gives ordered, reliable delivery with one system call per direction and no broker or polling;
a peer that dies shows as end-of-file at once, which is how either side learns of the other's death.
ZeroMQ (vLLM, SGLang) adds routing and many-to-many patterns this one-to-one channel does not need,
and shared-memory rings add spinning; msgspec keeps encoding cheap (typed structs, no pickle).

KV cache. The KV pool must be reachable from the node for transfers between devices and to peer
nodes (:mod:`node.transport`), which run in the node process. On the CPU the engine allocates it in
an anonymous ``memfd`` (not bounded by ``/dev/shm``'s size) and hands the file descriptor to the
node over the socket pair (``SCM_RIGHTS``); both map the same pages. On CUDA the engine allocates it
on its device and the node maps it through CUDA IPC (``torch.multiprocessing``'s reductions). The
node writes the pool from the device's worker thread, never on blocks a step in flight uses: peer
gathers and scatters and the imbalance fallback's moves wait until no step is in flight; overlapped
moves (pooled hand-offs) run beside later steps, on blocks of a sequence no step in flight includes,
after the destination's steps that were in flight when its blocks were taken
(:mod:`node.runtime.moves`).

Start. Engines for CPU devices are forked by ``shiftnode serve`` before the event loop starts
(:func:`prelaunch`): the child shares the already imported modules, so it starts in milliseconds,
and the parent has not yet run any parallel torch work that a fork would break; the node imports its
HTTP application only after the fork, so those imports overlap the engines' start-up. A CPU engine
started later (a restart, or a node created inside a process that has already computed, as tests do)
is forked from a fork server that has imported torch and the engine's modules; CUDA devices spawn a
fresh interpreter (:mod:`node.worker.engine_start`).

Tensor-parallel groups (``--tensor-parallel-size D``, ``--decode-tp``/``--prefill-tp``). A group of ``D`` devices is one device of the
node: one engine process per rank, each a full engine (its own socket pair, its own shard of the
weights and of the KV heads), joined in a ``torch.distributed`` group; :class:`TPEngineGroup` is the
node's handle and sends each request to every rank (see there for ordering, replies and failure).

Lifetime. The engine exits when the node says so, when its end of the pipe closes, and (Linux
``PR_SET_PDEATHSIG``) when the node process dies in any way (an engine forked from the fork server
dies with the server, which exits when the node dies: :mod:`node.worker.engine_start`); it ignores
SIGINT, which a terminal sends the whole process group, so a Ctrl-C stops the node, which then stops
its engines. A dead
engine is seen by the node as :class:`EngineDied` (its device is then reported down).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import mmap
import multiprocessing
import os
import threading
from collections import deque
from multiprocessing.reduction import recv_handle, send_handle
from typing import Any

import msgspec
import structlog
import torch

from node.config import NodeConfig, usable_cores
from node.log_native import stderr_uncaptured
from node.transport.protocol import Fingerprint
from node.worker.cpu_threads import thread_candidates
from node.worker.engine_main import engine_main
from node.worker.engine_start import process_target, start_method
from node.worker.engine_messages import (
    EngineDied, EngineError, Failed, GetFingerprint, PeerPools, Prepare, Ready, Reply, Shutdown, TPRank,
)
from node.worker.loop_channel import LoopChannel

log = structlog.get_logger("shiftnode.engine_process")

_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn)}


# --- the node's handle ----------------------------------------------------------------------------------
def _settle(fut: concurrent.futures.Future, result: Any = None, error: BaseException | None = None) -> None:
    """Resolve ``fut`` unless its waiter gave up (a cancelled step: its reply is dropped)."""
    if fut.set_running_or_notify_cancel():
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)


def submit_from_thread(handle: Any, msg: Any) -> concurrent.futures.Future:
    """``handle.async_submit(msg)`` run on ``handle``'s attached loop, for a caller on another thread:
    a future that settles as the loop's does.

    Raises:
        RuntimeError: ``handle`` is not attached to a loop, or the caller is on the loop's thread.
    """
    loop = handle._loop
    if loop is None:
        raise RuntimeError(f"engine of {handle.device_id} is not attached to an event loop")
    if threading.get_ident() == handle._loop_thread:
        raise RuntimeError("on the event loop, use async_submit")
    fut: concurrent.futures.Future = concurrent.futures.Future()

    def go() -> None:
        try:
            inner = handle.async_submit(msg)
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            _settle(fut, error=e)
            return
        inner.add_done_callback(lambda f: _settle(fut, error=f.exception()) if f.exception() else _settle(fut, f.result()))

    loop.call_soon_threadsafe(go)
    return fut


def engine_threads(config: NodeConfig, cores: int) -> int:
    """Intra-op threads of each CPU engine: the ``cores`` this process may use, less one for the node's
    control loop and one per API front end (``--api-processes`` > 1), shared by the devices; at least 1.
    On 2 cores an engine with 2 threads fights the event loop for both, and streamed throughput swings
    between runs by 1.5x (bench/RESULTS.md, 2026-12-03); on the 16-core H200 host an engine of 15
    threads left 8 front ends no core of their own (1,024 streams: no gain past 2 front ends)."""
    frontends = config.api_processes if config.api_processes > 1 else 0
    return max(1, (cores - 1 - frontends) // max(1, len(config.devices)))


def engine_thread_candidates(config: NodeConfig, cores: int, tensor_parallel: bool = False) -> tuple[int, int]:
    """``(reserved, all)`` intra-op threads of each CPU engine (:func:`node.worker.cpu_threads.thread_candidates`):
    ``reserved`` is :func:`engine_threads`, ``all`` gives the engines the loop's core too; both are
    ``--cpu-threads`` when it is given. The engine picks one by timing its steps at start-up."""
    frontends = config.api_processes if config.api_processes > 1 else 0
    return thread_candidates(cores, frontends, len(config.devices), config.cpu_threads, tensor_parallel)


class EngineProcess:
    """The node's handle on one device's engine process; the runner-like surface of a device
    (``submit``, ``prepare_decode``, ``kv_cache``, ``num_blocks``, ``fingerprint``).

    Use :meth:`launch` (starts the process), :meth:`wait_ready` (blocks until loaded; raises what
    loading raised), then :meth:`attach` an event loop, which then does all reading and writing
    (:meth:`async_submit` on the loop; :meth:`submit` from other threads goes through it).

    Errors: :class:`EngineDied` when the process is gone; :class:`EngineError` for an exception the
    engine caught while serving one request (the engine goes on).
    """

    def __init__(self, config: NodeConfig, device_id: str, method: str, tp: TPRank | None = None):
        self.device_id = device_id
        self.method = method
        threads = engine_thread_candidates(config, usable_cores(), tensor_parallel=tp is not None)
        ctx = multiprocessing.get_context(method)
        self._conn, child = ctx.Pipe(duplex=True)
        target, args = process_target(method, engine_main, (child, config, device_id, os.getpid(), threads, tp))
        self.process = ctx.Process(target=target, name=f"shiftnode-engine-{device_id}", args=args, daemon=True)
        self._child_conn = child
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(Reply)
        self._waiting: deque[asyncio.Future] = deque()  # requests sent, oldest first
        self._dead: EngineDied | None = None
        self.kv_cache: torch.Tensor | None = None
        self.num_blocks = 0
        self.threads = 0
        self.compile_state = None  # CompileState from Ready (node.worker.background_compile); None: eager steps
        self._mmap: mmap.mmap | None = None
        self.keep_kv_fd = bool(tp is not None and tp.prefill_degree and tp.prefill_degree < tp.degree)
        self._kv_fd: int | None = None
        self._kv_ipc: tuple | None = None
        self.stopping = False
        # Set by attach: the loop that owns the socket, its thread, and the loop's end of it.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._channel: LoopChannel | None = None

    @classmethod
    def launch(cls, config: NodeConfig, device_id: str, method: str | None = None,
               tp: TPRank | None = None) -> "EngineProcess":
        """Start the engine process of ``device_id`` by ``method``: ``"fork"`` (only safe before the
        caller has run parallel torch work: see the module docstring), ``"forkserver"`` or ``"spawn"``;
        None: :func:`~node.worker.engine_start.start_method`'s choice for the device.
        ``tp``: as one rank of a tensor-parallel group (:class:`TPEngineGroup` launches those)."""
        handle = cls(config, device_id, method or start_method([device_id]), tp)
        with stderr_uncaptured():  # the child's descriptor 2 is the real one (node.log_native)
            handle.process.start()
        handle._child_conn.close()  # the child holds its own copy; ours would hide its death
        return handle

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def wait_ready(self) -> None:
        """Block until the engine has loaded and shared its KV pool.

        Raises:
            EngineError: loading failed in the engine (``kind`` names the exception type, e.g.
                ``StartupError``; the message is the engine's).
            EngineDied: the process ended before it was ready.
        """
        reply = self._recv()
        if isinstance(reply, Failed):
            self.process.join(5)
            raise EngineError(reply.message, reply.kind)
        assert isinstance(reply, Ready), reply
        self.num_blocks, self.threads = reply.num_blocks, reply.threads
        self.compile_state = reply.compile  # the compiled buckets at start (node.runtime.compile_watch follows them)
        try:
            if reply.kv_cuda:
                rebuild, args = self._conn.recv()
                self._kv_ipc = (rebuild, args)  # forwarded to the other ranks of a time-shared group
                self.kv_cache = rebuild(*args)
            else:
                fd = recv_handle(self._conn)
                dtype = _DTYPES[reply.kv_dtype]
                nbytes = int(torch.Size(reply.kv_shape).numel()) * torch.empty((), dtype=dtype).element_size()
                self._mmap = mmap.mmap(fd, max(nbytes, 1))
                if self.keep_kv_fd:
                    self._kv_fd = fd  # passed on to the other ranks of a time-shared group (PeerPools)
                else:
                    os.close(fd)
                self.kv_cache = torch.frombuffer(self._mmap, dtype=torch.uint8, count=nbytes).view(dtype).view(reply.kv_shape)
        except (EOFError, OSError) as e:
            raise EngineDied(f"engine process of {self.device_id} exited while sharing its KV pool") from e

    # --- the event-loop channel ----------------------------------------------------------------
    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Hand the socket to ``loop`` (call on its thread, after :meth:`wait_ready`, before any
        request): a :class:`~node.worker.loop_channel.LoopChannel` writes requests without blocking
        and a reader callback resolves asyncio futures with the replies, in order."""
        self._loop = loop
        self._loop_thread = threading.get_ident()
        self._channel = LoopChannel(loop, self._conn.fileno(), self._on_frame, self._lost)

    def detach(self) -> None:
        """Take the socket back from the loop (call on its thread; before :meth:`stop`): requests
        still waiting fail with :class:`EngineDied`, and the socket blocks again."""
        if self._loop is None:
            return
        self._channel.close()
        if self._dead is None:
            self._dead = EngineDied(f"engine process of {self.device_id} is stopping")
        for fut in self._waiting:
            if not fut.done():
                fut.set_exception(self._dead)
        self._waiting.clear()
        self._loop = None

    def async_submit(self, msg: Any) -> asyncio.Future:
        """Send one request from the attached loop's thread; the future resolves to its reply
        (``EngineError`` or ``EngineDied`` as exceptions). Requests are served in order.

        Raises:
            EngineDied: the engine is already gone.
        """
        return self.async_submit_frame(self._enc.encode(msg))

    def async_submit_frame(self, frame: bytes) -> asyncio.Future:
        """:meth:`async_submit` of a request already encoded (a group encodes a step once for all ranks)."""
        if self._dead is not None:
            raise self._dead
        fut = self._loop.create_future()
        self._waiting.append(fut)
        self._channel.send(frame)
        return fut

    def _on_frame(self, frame: bytes) -> None:
        try:
            reply = self._dec.decode(frame)
        except Exception as e:  # noqa: BLE001 - a reply this side cannot read ends the engine
            log.error("engine_reply_unreadable", device=self.device_id, error=f"{type(e).__name__}: {e}")
            self._channel.close()
            self._lost(e)
            return
        fut = self._waiting.popleft()
        if fut.cancelled():
            return
        if isinstance(reply, Failed):
            log.error("engine_request_failed", device=self.device_id, kind=reply.kind, trace=reply.trace)
            fut.set_exception(EngineError(f"{reply.kind}: {reply.message}", reply.kind))
        else:
            fut.set_result(reply)

    def _lost(self, error: BaseException) -> None:
        """The socket closed or broke: the waiting requests fail with :class:`EngineDied` once the
        exit code is known (read off the loop: it may take a moment)."""
        if self._dead is not None:
            return
        self._dead = EngineDied(f"engine process of {self.device_id} (pid {self.process.pid}): its pipe closed")
        waiting, self._waiting = list(self._waiting), deque()

        def settle(reason: asyncio.Future) -> None:
            if reason.exception() is None:
                self._dead = EngineDied(reason.result())
            for fut in waiting:
                if not fut.done():
                    fut.set_exception(self._dead)

        self._loop.run_in_executor(None, self.death_reason).add_done_callback(settle)

    def _recv(self) -> Any:
        try:
            return self._dec.decode(self._conn.recv_bytes())
        except (EOFError, OSError) as e:
            raise EngineDied(self.death_reason()) from e

    def death_reason(self, process: Any = None) -> str:
        """Why the process is gone, naming the device, pid and exit code or signal (``process``: the
        one that ended, always this engine's own; the argument keeps the surface of :class:`TPEngineGroup`)."""
        self.process.join(2.0)  # its pipe closed: it is exiting; wait for the exit code (returns once reaped)
        code = self.process.exitcode
        how = "is still running but its pipe closed" if code is None else (
            f"was killed by signal {-code}" if code < 0 else f"exited with code {code}")
        return f"engine process of {self.device_id} (pid {self.process.pid}) {how}"

    def submit(self, msg: Any) -> concurrent.futures.Future:
        """Send one request from a thread other than the attached loop's; the returned future
        resolves to its reply (``EngineError`` or ``EngineDied`` as exceptions). The loop writes it,
        in order with the steps.

        Raises:
            RuntimeError: not attached (see :meth:`attach`), or called on the loop's thread.
        """
        return submit_from_thread(self, msg)

    def call(self, msg: Any) -> Any:
        """Send one request and wait for its reply (not on the attached loop's thread)."""
        return self.submit(msg).result()

    def prepare_decode(self) -> float:
        return self.call(Prepare()).value

    def fingerprint(self, config: NodeConfig, info: Any) -> Fingerprint:
        """The handshake fingerprint, computed in the engine from the weights it holds (``config``
        and ``info`` are the engine's own; the arguments keep the surface of :class:`LocalEngine`)."""
        return self.call(GetFingerprint()).fingerprint

    def stop(self, timeout_s: float = 5.0) -> None:
        """Ask the engine to exit; terminate, then kill, what does not within ``timeout_s``."""
        self.stopping = True
        if self.process.is_alive():
            try:
                if self._loop is None:  # (attached and not detached: the loop is gone; terminate)
                    self._conn.send_bytes(self._enc.encode(Shutdown()))
            except OSError:
                pass  # already gone
            self.process.join(timeout_s)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(2.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(2.0)
        self._conn.close()
        if self._kv_fd is not None:
            os.close(self._kv_fd)
            self._kv_fd = None

    def send_pools(self, ranks: list[int], handles: dict[int, "EngineProcess"]) -> float:
        """Map the KV pools of ``ranks`` into this engine (:class:`PeerPools`; before :meth:`attach`):
        ``handles[q]`` is rank ``q``'s engine. Returns the engine's milliseconds.

        Raises:
            EngineError: the engine failed to map them; EngineDied: it is gone.
        """
        self._conn.send_bytes(self._enc.encode(PeerPools(ranks)))
        for q in ranks:
            other = handles[q]
            if other is self:
                continue
            if other._kv_ipc is not None:
                self._conn.send(other._kv_ipc)
            else:
                send_handle(self._conn, other._kv_fd, self.pid)
        return self.recv_value()

    def send_sync(self, msg: Any) -> None:
        """Write ``msg`` now (before :meth:`attach`; read its reply with :meth:`recv_value`)."""
        self._conn.send_bytes(self._enc.encode(msg))

    def recv_value(self) -> float:
        """The :class:`Value` that answers a request sent with :meth:`send_sync` (before :meth:`attach`).

        Raises:
            EngineError: the engine failed the request; EngineDied: it is gone.
        """
        reply = self._recv()
        if isinstance(reply, Failed):
            raise EngineError(reply.message, reply.kind)
        return reply.value

