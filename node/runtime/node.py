"""The node: devices, their engines, and the request entry point used by the API.

One asyncio event loop drives every device's step loop; each device runs its model steps in its own
worker thread. ``generate`` is the only way requests enter, and it guarantees that a request which
ends for any reason (finished, failed, client gone) leaves no sequence and no KV block behind.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from contextlib import suppress
from typing import AsyncIterator

import structlog

from node.config import NodeConfig
from node.core.batcher import BatchConfig, Batcher, StepKind
from node.core.ledger import BlockLedger
from node.core.sequence import SamplingParams
from node.runtime.engine import DeviceEngine
from node.runtime.metrics import NodeMetrics
from node.runtime.output import SeqDelta
from node.runtime.request import RequestState
from node.worker.loader import LoadedModel, build_runner, load_model_info

log = structlog.get_logger("shiftnode.node")


class QueueFullError(RuntimeError):
    """More requests are queued than ``--max-queue`` allows (the API answers 503)."""


def select_ops(backend: str, device_type: str) -> object:
    """The operator set for the model: Triton kernels on CUDA (``auto``), torch references otherwise."""
    try:
        from kernels.ops import get_ops
    except ImportError:  # kernels.ops not present: references only
        import kernels.reference as ref

        return ref
    if backend == "auto":
        backend = "triton" if device_type == "cuda" else "torch"
    return get_ops(backend)


class Node:
    """A serving node over one or more devices.

    Use ``await Node.create(config)`` (loads weights in threads), then ``start()``; ``close()`` stops.
    """

    def __init__(self, config: NodeConfig, info: LoadedModel, engines: list[DeviceEngine]):
        self.config = config
        self.info = info
        self.tokenizer = info.tokenizer
        self.max_model_len = info.max_model_len
        self.engines = engines
        self._ids = itertools.count()
        self.started_s = time.monotonic()
        self.started_wall_s = time.time()
        self.metrics = NodeMetrics(self)

    @classmethod
    async def create(cls, config: NodeConfig) -> "Node":
        info = load_model_info(config)
        loop = asyncio.get_running_loop()
        engines = []
        for device_id in config.devices:
            ops = select_ops(config.attention_backend, device_id.partition(":")[0])
            runner = await loop.run_in_executor(None, build_runner, config, info, device_id, ops)
            ledger = BlockLedger(runner.num_blocks, config.block_size)
            batcher = Batcher(ledger, BatchConfig(
                max_num_seqs=config.max_num_seqs,
                max_batched_tokens=config.max_num_batched_tokens,
            ))
            engines.append(DeviceEngine(device_id, runner, batcher, lambda: StepKind.MIXED, time.monotonic))
        return cls(config, info, engines)

    def start(self) -> None:
        for e in self.engines:
            e.start()

    async def close(self) -> None:
        for e in self.engines:
            await e.stop()

    # --- requests ----------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return sum(len(e.batcher.waiting) for e in self.engines)

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}-{int(time.time() * 1000) % 10**9}"

    def _place(self, req: RequestState) -> DeviceEngine:
        """Least-loaded device by (queued prompts, resident sequences)."""
        return min(self.engines, key=lambda e: (len(e.batcher.waiting), len(e.batcher.running)))

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams, n: int = 1) -> AsyncIterator[tuple[RequestState, SeqDelta]]:
        """Run one request; yield ``(state, delta)`` for every delta of every choice until all end.

        Raises:
            QueueFullError: the node already queues ``max_queue`` prompts.
        """
        m = self.metrics
        if self.num_waiting >= self.config.max_queue:
            m.rejected.inc()
            raise QueueFullError(f"{self.num_waiting} requests are queued (limit {self.config.max_queue})")
        req = RequestState(request_id, prompt_ids, params, n, self.tokenizer, self._eos_ids(),
                           self.max_model_len, time.monotonic())
        m.prompt_tokens.inc(len(prompt_ids))
        engine = self._place(req)
        engine.add(req)
        reasons: list[str | None] = [None] * n
        first_s: list[float | None] = [None] * n  # per choice: first and last token times, tokens
        last_s: list[float] = [0.0] * n
        tokens = [0] * n
        try:
            while None in reasons:  # drain until every choice's last delta was consumed
                delta = await req.queue.get()
                i = delta.index
                if delta.token_ids:
                    now = time.monotonic()
                    if first_s[i] is None:
                        first_s[i] = now
                        if i == 0:
                            m.ttft.observe(now - req.stats.arrival_s)
                    else:
                        m.itl.observe(now - last_s[i])
                    last_s[i] = now
                    tokens[i] += len(delta.token_ids)
                    m.generation_tokens.inc(len(delta.token_ids))
                if delta.finish_reason or delta.error:
                    reasons[i] = delta.finish_reason or "error"
                    if tokens[i] > 1:
                        m.tpot.observe((last_s[i] - first_s[i]) / (tokens[i] - 1))
                req.stats.output_tokens += len(delta.token_ids)
                yield req, delta
        finally:
            if not req.done:
                engine.abort(request_id)
            reasons = [r or "abort" for r in reasons]
            s = req.stats
            end = time.monotonic()
            m.e2e.observe(end - s.arrival_s)
            for r in reasons:
                m.requests.labels(finish_reason=r).inc()
            with suppress(Exception):
                log.info(
                    "request", request_id=request_id, device=engine.device_id, prompt_tokens=s.prompt_tokens,
                    output_tokens=s.output_tokens, n=n, finish_reason=reasons[0] if n == 1 else reasons,
                    ttft_ms=None if first_s[0] is None else round((first_s[0] - s.arrival_s) * 1e3, 2),
                    total_ms=round((end - s.arrival_s) * 1e3, 2),
                )

    def _eos_ids(self) -> list[int]:
        return self.tokenizer.eos_token_ids or list(self.info.cfg.eos_token_ids)

    # --- introspection -----------------------------------------------------------------------
    def status(self) -> dict:
        """The node's state for ``GET /v1/node``: per device KV blocks, resident and queued sequences."""
        return {
            "model": self.config.model_name,
            "max_model_len": self.max_model_len,
            "block_size": self.config.block_size,
            "queue_depth": self.num_waiting,
            "devices": [{
                "device": e.device_id,
                "kv_blocks_total": e.batcher.ledger.num_blocks,
                "kv_blocks_free": e.batcher.ledger.num_free,
                "kv_blocks_used": e.batcher.ledger.num_used,
                "running": len(e.batcher.running),
                "waiting": len(e.batcher.waiting),
                "steps": e.steps,
                "preemptions": e.batcher.num_preemptions,
            } for e in self.engines],
        }
