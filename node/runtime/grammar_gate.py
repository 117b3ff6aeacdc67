"""A grammar sequence joins its device's steps only once the device's engine has its grammar ready.

An engine compiles a grammar (and builds the vocabulary's tables, on its first) in its one grammar
thread, answering :class:`~node.worker.engine_messages.GrammarPrepare` between steps without waiting
(:meth:`~node.worker.grammar_masks.GrammarMasks.prepare`). A fresh request is prepared on every engine
before it is queued (:func:`node.api.structured.prepare_on_engines`); this part does the same for every
sequence that is placed on a device any other way, or that arrives with output already emitted:

* a KV move between devices and an adaptive hand-off (``Residents.adopt``);
* a pooled hand-off inside the node or from a peer node, over TCP or NIXL (``Residents.adopt``);
* a resume after an engine death (``Residents.add_seq``), on a survivor or on the revived engine;
* a request admitted through ``--api-processes`` front ends, whose own process compiled only its copy.

Such a sequence is held (``Sequence.grammar_wait``: the batcher leaves it out of steps) while a task of
the event loop asks the engine, polling, until its grammar is compiled and, for a sequence with
output, its matcher rebuilt from those tokens in the grammar thread; the other sequences keep stepping
meanwhile. Then the sequence is released. A grammar that does not compile there, or does not compile
in time, ends the request with an error event (its blocks freed); an engine that dies meanwhile
leaves the sequence to its revival (resumed and held again where it lands).
"""

from __future__ import annotations

import asyncio
import weakref
from collections import OrderedDict
from typing import Any, Callable

import structlog

from node.core.grammar_spec import GrammarSpec
from node.core.sequence import PENDING, Sequence
from node.worker.engine_messages import GrammarPrepare, GrammarReady

log = structlog.get_logger("shiftnode.grammar")

COMPILE_TIMEOUT_S = 10.0  # an engine's compile (and a matcher's replay) longer than this fails the request
GRAMMAR_START_TIMEOUT_S = 120.0  # an engine's grammar cache not built by then (xgrammar's import): 503

_PREPARED_PER_ENGINE = 512  # specs remembered as compiled on one engine (its cache keeps as many)
_prepared: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine handle -> OrderedDict of specs


def is_prepared(handle: Any, spec: GrammarSpec) -> bool:
    """Whether ``handle``'s engine said ``spec`` was compiled (remembered per engine, bounded)."""
    return spec in _prepared.get(handle, ())


def mark_prepared(handle: Any, spec: GrammarSpec) -> None:
    """Remember that ``handle``'s engine has ``spec`` compiled (the oldest of its specs forgotten past
    :data:`_PREPARED_PER_ENGINE`; the engine's cache may have evicted it: its step then compiles it, counted)."""
    done = _prepared.setdefault(handle, OrderedDict())
    done[spec] = None
    done.move_to_end(spec)
    if len(done) > _PREPARED_PER_ENGINE:
        done.popitem(last=False)


class GrammarFailed(Exception):
    """An engine cannot make a grammar ready: ``status`` 400 (it does not compile there, or not in
    time) or 503 (its grammar engine did not start in time)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


async def until_ready(handle: Any, msg: GrammarPrepare, timeout_s: float = COMPILE_TIMEOUT_S) -> GrammarReady:
    """Ask ``handle``'s engine ``msg`` until it answers ready (its last :class:`GrammarReady`), polling
    with a growing pause (2 to 50 ms); the compile's bound ``timeout_s`` counts from when the engine's
    grammar cache is built.

    Raises:
        GrammarFailed: it does not compile there (400), not within ``timeout_s`` (400), or the grammar
            cache is not built within :data:`GRAMMAR_START_TIMEOUT_S` (503).
        EngineDied: the engine is gone (and anything else the engine's answer raises).
    """
    loop = asyncio.get_running_loop()
    start_limit = loop.time() + GRAMMAR_START_TIMEOUT_S
    deadline = loop.time() + timeout_s
    pause = 0.002
    while True:
        reply = await handle.async_submit(msg)
        if reply.ready:
            mark_prepared(handle, msg.spec)
            return reply
        if reply.error:
            raise GrammarFailed(reply.error, 400)
        if reply.starting:
            if loop.time() > start_limit:
                raise GrammarFailed(f"the grammar engine did not start within {GRAMMAR_START_TIMEOUT_S:g} s", 503)
            deadline = max(deadline, loop.time() + timeout_s)
        if loop.time() + pause > deadline:
            raise GrammarFailed(f"the {msg.spec.kind} did not compile within {timeout_s:g} s", 400)
        await asyncio.sleep(pause)
        pause = min(pause * 2, 0.05)


class GrammarGate:
    """Holds a device's arriving grammar sequences out of its steps until its engine has them ready.

    Args:
        device_id: the device (log lines).
        handle: returns the device's engine now (``DeviceEngine.runner``: it changes with a revive).
        resident: whether a sequence is still held on this device (it may have finished, been aborted or
            moved on while its grammar was prepared).
        fail: ``(sequence, message, status)``: end the sequence's request with an error event, its blocks freed.
        wake: wakes the device's step loop (a released sequence can run).
    """

    def __init__(self, device_id: str, handle: Callable[[], Any], resident: Callable[[Sequence], bool],
                 fail: Callable[[Sequence, str, int], None], wake: Callable[[], None]):
        self._device_id, self._handle, self._resident, self._fail, self._wake = device_id, handle, resident, fail, wake
        self._holds: dict[str, int] = {}  # seq id -> the number of its latest hold here (an older one is moot)
        self._count = 0
        self._tasks: set[asyncio.Task] = set()
        self.num_held = 0  # sequences held here so far (status and tests)

    def hold(self, seq: Sequence) -> None:
        """Called as ``seq`` is placed on this device: hold it (``grammar_wait``) unless its grammar needs
        nothing from the engine (no grammar; or a fresh sequence whose grammar the engine has compiled)."""
        spec = seq.params.grammar
        emitted = seq.output_ids
        while emitted and emitted[-1] == PENDING:  # (never for an arrival: nothing of it is in flight)
            emitted.pop()
        handle = self._handle()
        if spec is None or handle is None or (not emitted and is_prepared(handle, spec)):
            seq.grammar_wait = False
            self._holds.pop(seq.seq_id, None)
            return
        seq.grammar_wait = True
        self._count += 1
        self.num_held += 1
        self._holds[seq.seq_id] = self._count
        msg = GrammarPrepare(spec, seq.seq_id if emitted else "", emitted)
        task = asyncio.get_running_loop().create_task(self._prepare(seq, handle, msg, self._count))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _prepare(self, seq: Sequence, handle: Any, msg: GrammarPrepare, number: int) -> None:
        error = None
        try:
            await until_ready(handle, msg)
        except GrammarFailed as e:
            error = e
        except Exception as e:  # noqa: BLE001 - the engine died or failed: its revival owns the sequence
            log.info("grammar_prepare_interrupted", device=self._device_id, seq=seq.seq_id, error=f"{type(e).__name__}: {e}")
            return
        if self._holds.get(seq.seq_id) != number or not self._resident(seq):
            return  # it left (finished, aborted, moved on) or was placed here again since
        del self._holds[seq.seq_id]
        if error is not None:
            log.warning("grammar_failed_on_arrival", device=self._device_id, seq=seq.seq_id, error=str(error))
            self._fail(seq, f"the {msg.spec.kind} could not be prepared on {self._device_id}: {error}", error.status)
            return
        seq.grammar_wait = False
        self._wake()

    def cancel(self) -> None:
        """Stop every preparation in progress (the device stops)."""
        for task in list(self._tasks):
            task.cancel()
