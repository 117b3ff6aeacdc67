"""What the API handlers call in a front-end process: the node's request interface, over the link.

A :class:`FrontNode` stands where :class:`~node.runtime.node.Node` stands for the handlers of
:mod:`node.api.openai` (``config``, ``tokenizer``, ``account``, ``close_request``...), but requests
are admitted by the control process (:meth:`FrontNode.open_requests` awaits its
:class:`~node.api.link_protocol.Admitted`), and their tokens arrive as one
:class:`~node.api.link_protocol.Step` per engine step. Each choice's text is made here by the same
:class:`~node.runtime.output.OutputState` the single-process node runs (detokenization, stop strings
and their hold-back), on the token ids the control loop sent, so the text is the same.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from contextlib import suppress

import structlog

from node.api.frontend_metrics import REPORT_S, FrontendMetrics
from node.api.link_protocol import Admitted, Close, Job, Open, Step, frame
from node.config import NodeConfig
from node.log import request_lines
from node.core.sequence import SamplingParams, Sequence
from node.runtime.accounting import account
from node.runtime.admission import EnginesDown, KVCapacityExceeded, NodeDraining, QueueFullError
from node.runtime.output import OutputState, SeqDelta
from node.runtime.request import RequestStats
from node.runtime.token_output import TokenDelta
from node.worker.loader import LoadedModel

log = structlog.get_logger("shiftnode.frontend")

# An admission the control process has not answered after this long (s) fails the request with a 503: it
# answers each Open on its loop at once, so this long means its loop is stuck (and the client would wait for good).
ADMIT_TIMEOUT_S = 30.0

_REFUSALS = {"draining": NodeDraining, "engine_down": EnginesDown, "overloaded": QueueFullError,
             "kv_capacity": KVCapacityExceeded}


class FrontRequest:
    """One engine request (a prompt with ``n`` choices) as its front end sees it: the consumer-side
    fields :func:`~node.runtime.accounting.account` keeps, and per choice the text state."""

    __slots__ = ("key", "request_id", "stream", "index0", "seqs", "outputs", "ended", "reasons", "first_s",
                 "last_s", "tokens", "stats", "device")

    def __init__(self, key: int, request_id: str, prompt_ids: list[int], params: SamplingParams, n: int,
                 stream, index0: int, eos: list[int], tokenizer, max_model_len: int, now_s: float):
        self.key = key
        self.request_id = request_id
        self.stream = stream
        self.index0 = index0
        self.seqs = [Sequence(f"{request_id}-{i}", request_id, i, now_s, prompt_ids, params, max_model_len)
                     for i in range(n)]
        self.outputs = [OutputState(s, tokenizer, eos) for s in self.seqs]
        self.ended = [False] * n  # the client got the choice's last delta (later ones are dropped)
        self.reasons: list[str | None] = [None] * n
        self.first_s: list[float | None] = [None] * n
        self.last_s = [0.0] * n
        self.tokens = [0] * n
        self.stats = RequestStats(arrival_s=now_s, prompt_tokens=len(prompt_ids))
        self.device: str | None = None  # where choice 0 runs, as its first token says

    def on_plain(self, index: int, token_id: int) -> None:
        """:meth:`on_wire` of a plain token (a run's entry in a :class:`Step`): what a
        ``TokenDelta(key, index, [token_id])`` gives, without making one."""
        i = index - self.index0
        if self.ended[i]:
            return
        self.seqs[i].token_ids.append(token_id)
        out = self.outputs[i]
        d = out.on_token(token_id, None)
        d.index = index
        if out.finish_reason is not None:  # a stop string (on_token set the delta's finish_reason)
            self.ended[i] = True
        self.stream.push(d)

    def on_wire(self, wd: TokenDelta) -> None:
        """Turn the control loop's delta into the client's (text added, a stop string's end applied)
        and push it to the request's stream."""
        i = wd.index - self.index0
        if self.ended[i]:
            return  # tokens the control loop made before this choice's stop-string end reached it
        if wd.error is not None:
            self.ended[i] = True
            self.stream.push(SeqDelta(wd.index, error=wd.error, error_status=wd.error_status,
                                      error_code=wd.error_code, retry_after_s=wd.retry_after_s))
            return
        if wd.device is not None and i == 0:
            self.device = wd.device
        seq, out = self.seqs[i], self.outputs[i]
        d = None
        for t in wd.token_ids:  # one token from the control loop; several are joined (as --stream-interval does)
            seq.token_ids.append(t)
            step = out.on_token(t, None)
            d = step if d is None else d.then(step)
            if out.finish_reason is not None:
                break  # a stop string: what follows it is never sent
        if d is None:
            d = SeqDelta(wd.index)
        n = len(d.token_ids)
        d.index, d.logprobs = wd.index, wd.logprobs[:n] if len(wd.logprobs) > n else wd.logprobs
        d.finish_reason = out.finish_reason or wd.finish_reason  # (both sides end on tokens by the same rules)
        d.prompt_logprobs, d.cached_tokens = wd.prompt_logprobs, wd.cached_tokens
        if d.finish_reason is not None:
            self.ended[i] = True
        self.stream.push(d)


class FrontNode:
    """The node as the handlers of one front-end process see it.

    Args:
        config: the node's configuration (the same as the control process's).
        info: the model's config and tokenizer (no weights).
        index: this front end's number (0..N-1), part of its request ids.
        send: writes one frame to the control process.
    """

    def __init__(self, config: NodeConfig, info: LoadedModel, index: int, send):
        self.config = config
        self.info = info
        self.tokenizer = info.tokenizer
        self.max_model_len = info.max_model_len
        self.index = index
        self._send = send
        self.metrics = FrontendMetrics()
        self.requests: dict[int, FrontRequest] = {}
        self._ids = itertools.count()
        self._keys = itertools.count()
        self._tickets = itertools.count()
        self._waiting: dict[int, asyncio.Future] = {}
        self._eos = self.tokenizer.eos_token_ids or list(info.cfg.eos_token_ids)
        self._report: asyncio.TimerHandle | None = None
        self.gone: str | None = None  # why the control process is unreachable, once it is

    def new_request_id(self, prefix: str) -> str:
        """Unique across the node's front ends (``a<index>`` names this one)."""
        return f"{prefix}-a{self.index}-{next(self._ids)}-{int(time.time() * 1000) % 10**9}"

    async def open_requests(self, request_id: str, jobs, n: int, stream) -> list[FrontRequest]:
        """Admit all of ``jobs`` (``prompt_ids``, ``params``, ``index0`` each) or none, their deltas to
        ``stream``; the caller accounts each delta and calls :meth:`close_request` for each request.

        Raises:
            NodeDraining, EnginesDown, QueueFullError: the control process refused them (the API's 503).
            EnginesDown: it did not answer within :data:`ADMIT_TIMEOUT_S` (the requests are closed, so
                an admission that comes later is undone).
        """
        if self.gone:
            raise EnginesDown(self.gone)
        now = time.monotonic()
        reqs = []
        for p, job in enumerate(jobs):
            key = next(self._keys)
            reqs.append(FrontRequest(key, f"{request_id}-p{p}", job.prompt_ids, job.params, n, stream, job.index0,
                                     self._eos, self.tokenizer, self.max_model_len, now))
        ticket = next(self._tickets)
        fut = self._waiting[ticket] = asyncio.get_running_loop().create_future()
        for r in reqs:  # registered first: a step's deltas may follow the admission at once
            self.requests[r.key] = r
        self._send(frame(Open(ticket, [Job(r.key, r.request_id, j.prompt_ids, j.params, n, j.index0)
                                       for r, j in zip(reqs, jobs)])))
        try:
            answer: Admitted = await asyncio.wait_for(fut, ADMIT_TIMEOUT_S)
        except TimeoutError:
            for r in reqs:
                self.close_request(r)
            log.error("admission_unanswered", request_id=request_id, timeout_s=ADMIT_TIMEOUT_S)
            raise EnginesDown(f"the node's control process did not answer the admission within {ADMIT_TIMEOUT_S:g} s") from None
        except BaseException:  # cancelled (the client left): whatever was admitted is closed at once
            for r in reqs:
                self.close_request(r)
            raise
        finally:
            self._waiting.pop(ticket, None)
        if answer.refusal is not None:
            for r in reqs:
                self.requests.pop(r.key, None)
            raise _REFUSALS.get(answer.refusal, QueueFullError)(answer.message)
        return reqs

    def account(self, req: FrontRequest, delta: SeqDelta, now: float) -> None:
        """TTFT, ITL, TPOT and tokens of ``delta`` (see :func:`~node.runtime.accounting.account`)."""
        account(self.metrics, req, delta, now)
        if self._report is None:
            self._report = asyncio.get_running_loop().call_later(REPORT_S, self.report)

    def close_request(self, req: FrontRequest) -> None:
        """Done with ``req``: the control process ends what still runs and frees its KV. Idempotent."""
        if self.requests.pop(req.key, None) is None:
            return
        self.report()
        first = req.first_s[0]
        self._send(frame(Close(req.key, req.reasons, req.tokens,
                               None if first is None else first - req.stats.arrival_s)))
        if not request_lines():  # --log-requests (node.log)
            return
        s = req.stats
        reasons = [r or "abort" for r in req.reasons]
        with suppress(Exception):  # the line Node.close_request writes in the one-process layout
            log.info("request", request_id=req.request_id, device=req.device, prompt_tokens=s.prompt_tokens,
                     output_tokens=s.output_tokens, n=len(reasons), finish_reason=reasons[0] if len(reasons) == 1 else reasons,
                     ttft_ms=None if first is None else round((first - s.arrival_s) * 1e3, 2),
                     total_ms=round((time.monotonic() - s.arrival_s) * 1e3, 2))

    def report(self) -> None:
        """Send the metrics accrued since the last report (nothing if none)."""
        if self._report is not None:
            self._report.cancel()
            self._report = None
        if self.metrics.pending:
            self._send(frame(self.metrics.take()))

    # --- from the control process ---------------------------------------------------------------
    def on_admitted(self, m: Admitted) -> None:
        fut = self._waiting.get(m.ticket)
        if fut is not None and not fut.done():
            fut.set_result(m)

    def on_step(self, m: Step) -> None:
        """One step's deltas, to their requests. A request whose output processing raises (a
        detokenizer or stop-string bug on its tokens) fails alone (:meth:`fail`): the exception must
        not reach the link's ``data_received``, whose transport would close and fail every stream here."""
        requests = self.requests
        for wd in m.deltas:
            if type(wd) is list:  # a run of plain tokens: key, index, token id, ...
                for j in range(0, len(wd), 3):
                    r = requests.get(wd[j])
                    if r is not None:
                        try:  # (free in CPython 3.11+ while nothing raises)
                            r.on_plain(wd[j + 1], wd[j + 2])
                        except Exception as e:  # noqa: BLE001 - this request's fault: it alone fails
                            self.fail(r, e)
                continue
            r = requests.get(wd.key)
            if r is not None:
                try:
                    r.on_wire(wd)
                except Exception as e:  # noqa: BLE001 - as above
                    self.fail(r, e)

    def fail(self, req: FrontRequest, e: Exception) -> None:
        """``req``'s output processing raised ``e``: each of its open choices ends with a 500
        ``internal_error`` event, and the control process is told at once to end it (its KV freed);
        the other requests of this front end go on."""
        log.error("request_output_failed", request_id=req.request_id, error=f"{type(e).__name__}: {e}",
                  exc_info=e)
        why = f"internal server error: the request's output processing failed ({type(e).__name__}: {e})"
        for i, ended in enumerate(req.ended):
            if not ended:
                req.ended[i] = True
                req.stream.push(SeqDelta(i + req.index0, error=why, error_status=500, error_code="internal_error"))
        self.close_request(req)

    def on_lost(self, why: str) -> None:
        """The control process is gone: every open choice ends with an error (503), new requests are refused."""
        self.gone = why
        (log.error if self.requests or self._waiting else log.info)("control_link_closed", pid=os.getpid(), reason=why,
                                                                  open_requests=len(self.requests))
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_result(Admitted(-1, "engine_down", why))
        for r in list(self.requests.values()):
            for i, ended in enumerate(r.ended):
                if not ended:
                    r.on_wire(TokenDelta(r.key, i + r.index0, [], error=why, error_status=503, error_code="engine_down",
                                        retry_after_s=1.0))
