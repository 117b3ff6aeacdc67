"""The engine process's side (see :mod:`node.worker.engine_process` for the layout, the channel and
the lifetime): load the model on its device, report :class:`~node.worker.engine_messages.Ready` with
the KV pool (a memfd on the CPU, a CUDA IPC handle on GPUs), then serve requests until told to stop
or until the node is gone."""

from __future__ import annotations

import ctypes
import mmap
import multiprocessing.forkserver
import os
import signal
import sys
import traceback
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle, send_handle
from typing import Any

import msgspec
import structlog
import torch

from node.config import NodeConfig
from node.worker.background_compile import compile_state
from node.worker.engine_core import EngineCore, StepMsg
from node.worker.grammar_masks import GrammarMasks
from node.worker.engine_messages import (
    TP_TIMEOUT_S, CompileReply, CompileStatus, Failed, FingerprintReply, GrammarPrepare, PeerPools, Prepare, Ready, Reconfigure, Request,
    Shutdown, StepAck, TPRank, Value, answer_grammar,
)

log = structlog.get_logger("shiftnode.engine_process")


def _die_with_parent(parent_pid: int, device_id: str) -> None:
    """SIGKILL this process when its parent dies (Linux), and name it for ``ps``/``top``
    (``shiftnode-cpu:0``); exit now if the node is already gone (:func:`parent_alive`).

    The parent is the node (``parent_pid``), or the fork server the node started
    (:mod:`node.worker.engine_start`), which exits when the node dies."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        libc.prctl(15, f"shiftnode-{device_id}".encode()[:15])  # PR_SET_NAME
    if not parent_alive(parent_pid):
        os._exit(0)


def parent_alive(node_pid: int) -> bool:
    """Whether this process still hangs from the node ``node_pid``: its parent is the node, or (started by
    a fork server) its parent is a process whose parent is the node. Checked after the parent-death
    signal is set, so a node or server that dies later kills this process; one that died before has
    left it with another parent (``init`` or a subreaper, never a child of the node)."""
    parent = os.getppid()
    if parent == node_pid:
        return True
    if multiprocessing.forkserver.get_inherited_fds() is None:  # not started by a fork server
        return False
    try:
        with open(f"/proc/{parent}/stat") as f:
            return int(f.read().rpartition(")")[2].split()[1]) == node_pid
    except (OSError, ValueError, IndexError):
        return not sys.platform.startswith("linux")  # no /proc to ask: trust the server's own watch


def _memfd_kv(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, holder: dict) -> torch.Tensor:
    """A CPU KV pool in an anonymous memfd (zero pages, filled lazily); keeps the fd in ``holder``."""
    nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
    fd = os.memfd_create("shiftnode-kv", 0)
    os.ftruncate(fd, max(nbytes, 1))
    buf = mmap.mmap(fd, max(nbytes, 1))
    holder.update(fd=fd, mmap=buf, nbytes=nbytes)
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)


def _exit_rank(tp: TPRank | None) -> None:
    """A tensor-parallel rank leaves at once: the interpreter's teardown of a process group whose
    peers are gone or leaving can take seconds (nothing is left to flush: replies are sent)."""
    if tp is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def engine_main(conn: Connection, config: NodeConfig, device_id: str, parent_pid: int, threads: tuple[int, int],
                tp: TPRank | None = None) -> None:
    """Entry point of an engine process: load, report :class:`Ready`, then serve requests until told
    to stop or until the node's end of ``conn`` closes.

    ``threads``: ``(reserved, all)`` intra-op thread counts of a CPU engine
    (:func:`~node.worker.engine_process.engine_thread_candidates`); it loads with ``reserved``, then
    keeps the one whose measured decode step serves faster (:mod:`node.worker.cpu_threads`) and
    reports it in :class:`Ready`.

    ``tp``: this engine is one rank of a tensor-parallel group. It joins the group's process group
    (gloo on the CPU, NCCL on CUDA) before loading, loads its shard, and serves the same requests in
    the same order as the other ranks (the node sends each to all); a rank other than 0 answers a
    step with a :class:`StepAck`."""
    _die_with_parent(parent_pid, device_id)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    enc = msgspec.msgpack.Encoder()
    dec = msgspec.msgpack.Decoder(Request)
    try:
        from node.log import configure_logging
        from node.worker.loader import build_runner, load_model_info, select_ops

        configure_logging(config.log_format, config.log_level, config.log_requests)
        if device_id.startswith("cpu"):
            torch.set_num_threads(threads[0])
        info = load_model_info(config)
        # xgrammar's import and the vocabulary's scan (seconds of CPU) start with the first structured
        # request's GrammarPrepare, in a thread, never in a step (node.worker.grammar_masks)
        grammars = GrammarMasks.for_model(info)
        ops = select_ops(config.attention_backend, device_id.partition(":")[0])
        holder: dict = {}
        kv_alloc = (lambda shape, dtype, device: _memfd_kv(shape, dtype, device, holder)) \
            if device_id.startswith("cpu") else None
        group = layouts = None
        if tp is not None:
            from node.worker.loader import torch_device
            from node.worker.role_layouts import GroupLayouts, new_instance_groups
            from node.worker.tensor_parallel import init_distributed, new_tp_group

            init_distributed(tp.rank, tp.degree, tp.init_method, torch_device(device_id), timeout_s=TP_TIMEOUT_S)
            group = new_tp_group(tp.degree)
            if tp.prefill_degree:  # a time-shared group: its prefill instances' groups too, made once, here
                p = tp.prefill_degree
                prefill = group if p == tp.degree else new_instance_groups(tp.degree, p, tp.rank)
                layouts = GroupLayouts(tp.rank, tp.degree, p, group, prefill)
            log.info("tp_rank_joined", group=tp.group, rank=tp.rank, degree=tp.degree, device=device_id,
                     backend=torch.distributed.get_backend(), prefill_degree=tp.prefill_degree or None)
        runner = build_runner(config, info, device_id, ops, kv_alloc=kv_alloc, tp=group,
                              held_degree=(tp.prefill_degree or None) if tp is not None else None, background=True)
        draft = None
        if config.speculative_config is not None and config.speculative_config.uses_draft_model:
            from node.worker.draft_model import build_draft_model

            draft = build_draft_model(config, info, device_id, ops, runner.num_blocks)
        core = EngineCore(runner, layouts, grammars, draft)
        core.warm_up()
        if device_id.startswith("cpu"):
            from node.worker.cpu_threads import settle_threads

            # a benchmark model's steps are paced or empty: nothing to time, the reserved count stays
            candidates = (threads[0], threads[0]) if config.benchmark_model else threads
            chosen, measured = settle_threads(runner, *candidates)
            log.info("engine_threads", device=device_id, threads=chosen, candidates=list(threads),
                     probe_step_ms={n: round(s * 1e3, 3) for n, s in measured.items()})
        if runner.background is not None:  # the buckets compile from now on, while this engine serves
            runner.background.start()
        kv = runner.kv_cache
        conn.send_bytes(enc.encode(Ready(runner.num_blocks, list(kv.shape), str(kv.dtype).removeprefix("torch."),
                                         kv.is_cuda, torch.get_num_threads(), compile_state(runner))))
        if kv.is_cuda:
            from torch.multiprocessing.reductions import reduce_tensor

            conn.send(reduce_tensor(kv))  # (rebuild function, args): a CUDA IPC handle
        else:
            send_handle(conn, holder["fd"], parent_pid)
    except BaseException as e:  # noqa: BLE001 - report any start-up failure, then exit
        conn.send_bytes(enc.encode(Failed(type(e).__name__, str(e), traceback.format_exc())))
        _exit_rank(tp)
        return
    pool_maps: list = []  # mmaps of other ranks' pools (PeerPools), kept open while they are used
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            _exit_rank(tp)
            return  # the node is gone
        msg = dec.decode(data)
        if isinstance(msg, Shutdown):
            _exit_rank(tp)
            return
        try:
            if isinstance(msg, StepMsg):
                reply: Any = core.step(msg)
                # rank 0 answers with the outputs; in a step of several instances, each instance's first rank
                if tp is not None and tp.rank and not (msg.instances and tp.rank < layouts.instances):
                    reply = StepAck([-1 if o.token_id is None else o.token_id for o in reply.outputs], reply.busy_s)
            elif isinstance(msg, GrammarPrepare):
                reply = answer_grammar(grammars, msg)
            elif isinstance(msg, CompileStatus):
                reply = CompileReply(compile_state(runner))
            elif isinstance(msg, Prepare):
                reply = Value(core.prepare_decode())
            elif isinstance(msg, Reconfigure):
                reply = Value(layouts.activate(msg.role, runner))
            elif isinstance(msg, PeerPools):
                reply = Value(_map_pools(conn, msg, tp.rank, runner, layouts, pool_maps))
            else:
                from node.transport.fingerprint import node_fingerprint

                reply = FingerprintReply(node_fingerprint(config, info, runner.model))
        except Exception as e:  # noqa: BLE001 - one failed request is the node's to handle
            reply = Failed(type(e).__name__, str(e), traceback.format_exc())
        try:
            conn.send_bytes(enc.encode(reply))
        except (BrokenPipeError, OSError):
            return


def _map_pools(conn: Connection, msg: PeerPools, rank: int, runner: Any, layouts: Any, keep: list) -> float:
    """Receive the handles of ``msg.ranks``' KV pools (see :class:`PeerPools`) and map them into
    ``layouts.pools`` (same shape and dtype as this rank's pool); the milliseconds it took."""
    import time

    t0 = time.perf_counter()
    own = runner.kv_cache
    nbytes = own.numel() * own.element_size()
    for q in msg.ranks:
        if q == rank:
            layouts.pools[q] = own
        elif own.is_cuda:
            rebuild, args = conn.recv()
            layouts.pools[q] = rebuild(*args)
        else:
            fd = recv_handle(conn)
            buf = mmap.mmap(fd, max(nbytes, 1))
            os.close(fd)
            keep.append(buf)
            layouts.pools[q] = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes).view(own.dtype).view(own.shape)
    return (time.perf_counter() - t0) * 1e3
