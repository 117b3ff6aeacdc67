"""The ``thread`` engine layout (``--engine-layout thread``): the device's :class:`EngineCore` run by a
thread of the node's process, behind the same interface as an engine process
(:class:`~node.worker.engine_process.EngineProcess`). For debugging, and the baseline of
``bench/load/host_overhead.py``."""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

import torch

from node.config import NodeConfig
from node.transport.protocol import Fingerprint
from node.worker.background_compile import compile_state
from node.worker.engine_core import EngineCore, StepMsg
from node.worker.engine_messages import GrammarPrepare, answer_grammar


class LocalEngine:
    """The ``thread`` layout: the same :class:`EngineCore`, run by a thread of the node's process."""

    method = "thread"
    pid = None
    stopping = False

    def __init__(self, core: EngineCore):
        self.core = core
        self.runner = core.runner
        self.kv_cache = core.kv_cache
        self.num_blocks = core.num_blocks
        self.threads = torch.get_num_threads()  # the node process's own (this layout runs its steps there)
        self.compile_state = compile_state(self.runner)  # compiled at load or not at all: never pending here
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")

    def submit(self, msg: StepMsg) -> concurrent.futures.Future:
        return self._pool.submit(self.core.step, msg)

    def async_submit(self, msg: StepMsg | GrammarPrepare) -> asyncio.Future:
        """:meth:`submit` as an asyncio future of the running loop; a :class:`GrammarPrepare` is answered
        in the same thread, between steps, as an engine process answers it."""
        if isinstance(msg, GrammarPrepare):
            if self.core.grammars is None:
                raise RuntimeError("this engine serves no grammar (it was built without GrammarMasks)")
            return asyncio.wrap_future(self._pool.submit(answer_grammar, self.core.grammars, msg))
        return asyncio.wrap_future(self._pool.submit(self.core.step, msg))

    def prepare_decode(self) -> float:
        return self._pool.submit(self.core.prepare_decode).result()

    def fingerprint(self, config: NodeConfig, info: Any) -> Fingerprint:
        from node.transport.fingerprint import node_fingerprint

        return node_fingerprint(config, info, self.runner.model)

    def stop(self, timeout_s: float = 5.0) -> None:
        self._pool.shutdown(wait=True)
