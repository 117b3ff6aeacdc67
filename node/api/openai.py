"""Handlers of ``/v1/completions`` and ``/v1/chat/completions``, streaming (SSE) or whole.

A request becomes one engine request per prompt (``n`` choices each). They push their deltas to one
stream; choice ``i`` of prompt ``p`` has index ``p * n + i``. When the client goes away the
handler is cancelled and every engine request is aborted, so its KV blocks return at once.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Callable

import msgspec
import structlog
from aiohttp import web

from node.api.errors import APIError, bad_request, delta_error, error_body
from node.api.chat_content import ChatContent
from node.api.fields import reject_refused
from node.api.frontend_node import FrontNode
from node.api.request_body import NODE_KEY, off_loop, read_json  # noqa: F401 - NODE_KEY: imported from here by the apps
from node.api.request_ids import public_id
from node.api.request_options import (prompt_logprobs_count, reject_masks_beside_grammar, truncate_prompt,
                                      with_request_options)
from node.api.responses import (ChoiceState, RequestEcho, chat_logprobs, completion_logprobs, envelope, prompt_logprobs_body,
                                usage)
from node.api.sse import Backlog, SSEWriter, StreamLimits
from node.api.structured import structured
from node.api.tool_calls import ChatToolOutput, plan_tools
from node.api.validate import chat_prompt, check_model, completion_prompts, reject_unsupported, sampling_params
from node.core.sequence import SamplingParams
from node.log import request_lines
from node.protocol import ChatCompletionRequest, CompletionRequest
from node.runtime.delta_stream import DeltaStream
from node.runtime.admission import EnginesDown, KVCapacityExceeded, NodeDraining, QueueFullError
from node.runtime.output import SeqDelta
from node.runtime.request import RequestState
from node.worker.sample_request import TokenLogprobs
from node.worker.tokenizer import IncrementalDetokenizer

log = structlog.get_logger("shiftnode.api")


@dataclass
class Job:
    """One prompt of a request: its ids, sampling parameters and first choice index."""

    prompt_ids: list[int]
    params: SamplingParams
    index0: int


def _queue_full(e: QueueFullError) -> APIError:
    if isinstance(e, KVCapacityExceeded):
        return APIError(400, str(e), code="kv_capacity_exceeded")
    if isinstance(e, NodeDraining):
        return APIError(503, str(e), code="draining", headers={"Retry-After": "1"})
    if isinstance(e, EnginesDown):
        return APIError(503, f"no device can serve: {e}", code="engine_down", headers={"Retry-After": "1"})
    return APIError(503, f"server is overloaded: {e}", code="overloaded", headers={"Retry-After": "1"})


async def run_request(request: web.Request, *, request_id: str, jobs: list[Job], n: int, stream: bool,
                      include_usage: bool, on_delta: Callable[[ChoiceState, SeqDelta], dict | None],
                      first_chunks: Callable[[list[ChoiceState]], list[dict]], final_body: Callable[[list[ChoiceState], dict], dict],
                      chunk_envelope: dict, continuous_usage: bool = False) -> web.StreamResponse:
    """Drive a request to its end, as SSE chunks or one JSON body.

    Each prompt becomes one engine request; all of them push to one :class:`DeltaStream`. A stream's
    events are written by a callback of that stream, synchronously, once per step with every delta
    since the last call, in one write (no task wakes per token); a non-streamed request's handler
    awaits the deltas instead. A client that leaves mid-stream ends its requests. ``on_delta``
    folds a delta into its choice and returns the stream chunk's choice entry (or None to send
    nothing); ``first_chunks`` gives chunks sent before any token (e.g. the chat role);
    ``final_body`` builds the non-streamed body. ``continuous_usage`` (with ``include_usage``): every
    chunk carries the usage so far (vLLM's ``stream_options.continuous_usage_stats``).

    Raises:
        APIError: 503 (``Retry-After``) when the node takes no request now, before anything is sent;
            a non-streamed request's error delta as its status.
    """
    node = request.app[NODE_KEY]
    choices = [ChoiceState(i) for i in range(len(jobs) * n)]
    prompt_tokens = sum(len(j.prompt_ids) for j in jobs)
    cached = [0] * len(jobs)  # per prompt: its tokens found in the prefix cache (choice 0's first token says)
    deltas = DeltaStream(node.config.sse_keepalive_s if stream else None)
    reqs: list[RequestState] = []
    try:
        try:  # admission first, so overload is a proper 503 before a stream's 200 goes out
            if isinstance(node, FrontNode):  # an API front end: the control process admits them
                reqs += await node.open_requests(request_id, jobs, n, deltas)
            else:
                node.check_admission(len(jobs))  # all the prompts, or none of them
                for p, job in enumerate(jobs):
                    reqs.append(node.open_request(f"{request_id}-p{p}", job.prompt_ids, job.params, n,
                                                  stream=deltas, index0=job.index0))
        except QueueFullError as e:
            raise _queue_full(e) from e

        def open_choices() -> bool:
            return any(None in r.reasons for r in reqs)

        def note_cached(d: SeqDelta) -> None:
            if d.cached_tokens is not None and d.index % n == 0:
                cached[d.index // n] = d.cached_tokens

        def fold(d: SeqDelta) -> dict | None:  # the caller accounted each delta it joins (node.account)
            note_cached(d)
            return on_delta(choices[d.index], d)

        if not stream:
            while open_choices():
                batch = await deltas.take()
                now = time.monotonic()
                for d in batch:
                    node.account(reqs[d.index // n], d, now)
                    if d.error:
                        raise delta_error(d)
                    fold(d)
            completion = sum(len(c.token_ids) for c in choices)
            return web.json_response(final_body(choices, usage(prompt_tokens, completion, sum(cached))))
        sse = SSEWriter(request, StreamLimits.of(node.config), node.metrics.stalled_clients.inc)
        extra = {"usage": None} if include_usage else {}

        def usage_now() -> dict:  # continuous_usage: each chunk's usage, counted when it is built
            return {"usage": usage(prompt_tokens, sum(len(c.token_ids) for c in choices), sum(cached))}
        ended = asyncio.get_running_loop().create_future()  # done: every choice ended, or one failed
        interval = node.config.stream_interval
        held: dict[int, SeqDelta] = {}  # choice → tokens not yet sent (--stream-interval > 1)
        sent_first: set[int] = set()  # choices whose first token went out (it is never held: TTFT)
        backlog = Backlog(sse)  # deltas held while the client is congested (sse.py)

        def due(d: SeqDelta) -> SeqDelta | None:
            """``d`` joined to what its choice holds; returned when an event is due, else held."""
            if interval == 1:
                return d
            if d.index in held:
                d = held.pop(d.index).then(d)
            if d.finish_reason is not None or len(d.token_ids) >= interval or (d.token_ids and d.index not in sent_first):
                sent_first.add(d.index)
                return d
            held[d.index] = d
            return None

        def emit(d: SeqDelta, chunks: list) -> None:  # ``d``'s event, if one is due now
            if (d := due(d)) is not None and (entry := fold(d)) is not None:
                chunks.append({**chunk_envelope, "choices": [entry], **(usage_now() if continuous_usage else extra)})

        def flush(chunks: list) -> list:  # the deltas held for a congested client, each choice's joined
            for d in backlog.take():
                emit(d, chunks)
            return chunks

        def write_step(batch: list[SeqDelta]) -> None:  # a DeltaStream callback: must not raise
            try:
                congested = sse.congested()  # the client reads slower than this writes: hold (sse.py)
                if not batch:
                    if not congested:
                        sse.comment("keep-alive")
                    return
                now = time.monotonic()
                chunks = []
                failed = ending = False
                try:
                    if first:  # continuous usage: the role chunks wait for the prefill's cached count (as vLLM's)
                        for d in batch:
                            note_cached(d)
                        chunks += [{**c, **usage_now()} for c in first]
                        first.clear()
                    if backlog and not congested:
                        flush(chunks)
                    for d in batch:
                        node.account(reqs[d.index // n], d, now)  # TTFT/ITL per step, whatever is sent
                        if d.error:
                            flush(chunks)
                            chunks.append(delta_error(d).body())
                            failed = True
                            break
                        ending = ending or d.finish_reason is not None
                        if congested:
                            backlog.add(d)  # past --sse-stall-bytes: the client is aborted
                            continue
                        emit(d, chunks)
                finally:  # a failure part-way through a step still sends the tokens before it, then the error
                    sse.send_many(chunks)
                if failed or (ending and not open_choices()):
                    deltas.close()
                    if not ended.done():
                        ended.set_result(None)
            except Exception as e:  # noqa: BLE001 - the client left (ConnectionResetError) or a bug: the handler raises it
                deltas.close()
                if not ended.done():
                    ended.set_exception(e)

        try:
            await sse.prepare()
            first = [{**chunk_envelope, **c} for c in first_chunks(choices)]
            if not continuous_usage:
                sse.send_many(first)
                first.clear()
            if open_choices():
                deltas.consume(write_step)  # each step's deltas are written from here on, in one call per step
                await ended
            sse.send_many([{**c, **usage_now()} for c in first])  # no step came (every choice ended at once)
            if backlog:  # the ends were held for a congested client: once it catches up (or is stalled)
                await sse.drained()
                sse.send_many(flush([]))
            if include_usage:
                completion = sum(len(c.token_ids) for c in choices)
                sse.send({**chunk_envelope, "choices": [], "usage": usage(prompt_tokens, completion, sum(cached))})
            await sse.done()
        except ConnectionResetError:  # the client left mid-stream: nothing to answer; its requests end below
            if request_lines():
                log.info("client_gone", request_id=request_id)
        except Exception as e:  # noqa: BLE001 - a bug once the 200 went out: end the stream, not a second response
            if not sse.response.prepared:
                raise  # nothing sent yet: errors_middleware answers it as usual
            log.exception("stream_failed", request_id=request_id, error=str(e))
            try:
                sse.send(error_body(500, f"internal server error: {type(e).__name__}", code="internal_error"))
                await sse.done()
            except ConnectionResetError:
                pass
        return sse.response
    finally:
        deltas.close()
        for r in reqs:
            node.close_request(r)


# --- /v1/completions --------------------------------------------------------------------------------
async def completions(request: web.Request) -> web.StreamResponse:
    node = request.app[NODE_KEY]
    req: CompletionRequest = await read_json(request, CompletionRequest)  # type: ignore[assignment]
    check_model(req, node.config.model_name)
    reject_unsupported(req)
    reject_refused(req)
    tok = node.tokenizer
    vocab = node.info.cfg.vocab_size
    prompts = await off_loop(completion_prompts, req, tok, vocab, node.max_model_len)
    prompts = [truncate_prompt(ids, req.truncate_prompt_tokens, node.max_model_len) for ids in prompts]
    if len(prompts) * req.n > node.config.max_queue:
        raise bad_request(f"{len(prompts)} prompts x n={req.n} = {len(prompts) * req.n} sequences in one request exceed "
                          f"the queue limit of {node.config.max_queue} (--max-queue)", param="prompt")
    echo_lp = req.logprobs if req.echo else None
    grammar = reject_masks_beside_grammar(req, await structured(node, req))
    want_plp = prompt_logprobs_count(req)
    prompt_lp = max((k for k in (echo_lp, want_plp) if k is not None), default=None)
    jobs = []
    for p, ids in enumerate(prompts):
        params = sampling_params(req, prompt_len=len(ids), max_model_len=node.max_model_len, max_tokens=req.max_tokens,
                                 default_max_tokens=16, vocab_size=vocab, logprobs=req.logprobs, prompt_logprobs=prompt_lp,
                                 max_n=node.config.max_num_seqs)
        params = with_request_options(params, req, tok, vocab, priority_policy=node.config.serving.scheduling_policy == "priority")
        jobs.append(Job(ids, msgspec.structs.replace(params, grammar=grammar), p * req.n))
    request_id = node.new_request_id("cmpl")
    env = envelope("text_completion", public_id(request, "cmpl", req.request_id, request_id), node.config.model_name)
    n = req.n
    states: dict[int, RequestEcho] = {}
    prompt_lps: dict[int, list] = {}  # prompt → its tokens' logprobs (prompt_logprobs), from its choice 0
    as_ids = req.return_tokens_as_token_ids

    def echo_for(c: ChoiceState) -> RequestEcho:
        if c.index not in states:
            job = jobs[c.index // n]
            states[c.index] = RequestEcho(job.prompt_ids, tok.decode(job.prompt_ids))
        return states[c.index]

    def on_delta(c: ChoiceState, d: SeqDelta) -> dict | None:
        text, ids, lps = d.text, list(d.token_ids), list(d.logprobs)
        if d.prompt_logprobs is not None:
            prompt_lps[c.index // n] = d.prompt_logprobs
        if req.echo and not c.token_ids and not c.parts:
            e = echo_for(c)
            text = e.text + text
            if req.logprobs is not None:
                ids = e.prompt_ids + ids
                k = req.logprobs  # prompt_logprobs may have asked for more alternatives than the echo lists
                lps = [None, *(x if x is None or len(x.top) <= k else TokenLogprobs(x.token_id, x.logprob, x.top[:k])
                               for x in d.prompt_logprobs or [])] + lps
        c.add_text(text)
        c.token_ids += d.token_ids
        c.finish_reason = d.finish_reason
        lp_body = None
        if req.logprobs is not None:
            if c.detok is None:
                c.detok = IncrementalDetokenizer(tok, [] if req.echo else jobs[c.index // n].prompt_ids)
            lp_body, c.text_offset = completion_logprobs(tok, lps, ids, c.detok, c.text_offset, as_ids)
            c.logprobs += lps
        if not text and d.finish_reason is None and lp_body is None and not req.return_token_ids:
            return None
        entry = {"index": c.index, "text": text, "logprobs": lp_body, "finish_reason": d.finish_reason}
        if req.return_token_ids:
            entry["token_ids"] = list(d.token_ids)
        return entry

    def final_body(choices: list[ChoiceState], use: dict) -> dict:
        out = []
        for c in choices:
            lp = None
            if req.logprobs is not None:
                prompt = echo_for(c).prompt_ids
                ids = (prompt if req.echo else []) + c.token_ids
                lp = completion_logprobs(tok, c.logprobs, ids, IncrementalDetokenizer(tok, [] if req.echo else prompt), 0,
                                         as_ids)[0]
            entry = {"index": c.index, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason}
            if want_plp is not None:
                job = jobs[c.index // n]
                entry["prompt_logprobs"] = prompt_logprobs_body(tok, job.prompt_ids, prompt_lps.get(c.index // n, []), as_ids)
            if req.return_token_ids:
                entry |= {"token_ids": c.token_ids, "prompt_token_ids": jobs[c.index // n].prompt_ids}
            out.append(entry)
        return {**env, "choices": out, "usage": use}

    return await run_request(
        request, request_id=request_id, jobs=jobs, n=n, stream=req.stream,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        continuous_usage=bool(req.stream_options and req.stream_options.continuous_usage_stats),
        on_delta=on_delta, first_chunks=lambda _: [], final_body=final_body, chunk_envelope=env,
    )


# --- /v1/chat/completions ------------------------------------------------------------------------
async def chat_completions(request: web.Request) -> web.StreamResponse:
    node = request.app[NODE_KEY]
    req: ChatCompletionRequest = await read_json(request, ChatCompletionRequest)  # type: ignore[assignment]
    check_model(req, node.config.model_name)
    reject_unsupported(req)
    reject_refused(req)
    plan = plan_tools(req, node.config.tool_call_parser, node.tokenizer.chat_template)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs=true", param="top_logprobs")
    tok = node.tokenizer
    ids = await off_loop(chat_prompt, req, tok, node.max_model_len, plan.tools)
    ids = truncate_prompt(ids, req.truncate_prompt_tokens, node.max_model_len)
    want_plp = prompt_logprobs_count(req)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = sampling_params(req, prompt_len=len(ids), max_model_len=node.max_model_len, max_tokens=max_tokens,
                             default_max_tokens=None, vocab_size=node.info.cfg.vocab_size,
                             logprobs=(req.top_logprobs or 0) if req.logprobs else None, prompt_logprobs=want_plp,
                             max_n=node.config.max_num_seqs, logprobs_param="top_logprobs", prompt_param="messages")
    params = with_request_options(params, req, tok, node.info.cfg.vocab_size, priority_policy=node.config.serving.scheduling_policy == "priority")
    params = msgspec.structs.replace(params, grammar=reject_masks_beside_grammar(req, await structured(node, req, plan.grammar)))
    tool_out = ChatToolOutput(plan)
    request_id = node.new_request_id("chatcmpl")
    env = envelope("chat.completion.chunk", public_id(request, "chatcmpl", req.request_id, request_id),
                   node.config.model_name)
    text = ChatContent(req, node.config.serving.reasoning_parser, tok, ids)
    as_ids = req.return_tokens_as_token_ids
    prompt_lps: list = []

    def on_delta(c: ChoiceState, d: SeqDelta) -> dict | None:
        c.add_text(d.text)
        c.token_ids += d.token_ids
        c.logprobs += d.logprobs
        c.finish_reason = d.finish_reason
        if d.prompt_logprobs is not None:
            prompt_lps[:] = d.prompt_logprobs
        reasoning, content = text.split(c.index, d.text, d.finish_reason is not None)  # --reasoning-parser
        delta, finish = tool_out.delta(c.index, content, d.finish_reason)  # content, and tool calls once known
        delta = text.with_reasoning(delta, reasoning)
        if not any(delta.values()) and finish is None and not (req.logprobs and d.logprobs) and not req.return_token_ids:
            return None  # nothing new (or text held back: it may begin a tool call or a tag)
        entry = {"index": c.index, "delta": delta,
                 "logprobs": chat_logprobs(tok, d.logprobs, as_ids) if req.logprobs else None, "finish_reason": finish}
        if req.return_token_ids:
            entry["token_ids"] = list(d.token_ids)
        return entry

    def first_chunks(choices: list[ChoiceState]) -> list[dict]:
        return [{"choices": [{"index": c.index, "delta": delta, "logprobs": None, "finish_reason": None}]}
                for c in choices for delta in text.first_deltas()]

    def final_body(choices: list[ChoiceState], use: dict) -> dict:
        out = []
        for c in choices:
            reasoning, content = text.split_whole(c.text)
            msg, finish = tool_out.message(c.index, content, c.finish_reason)
            entry = {"index": c.index, "message": text.finish_message(msg, reasoning), "finish_reason": finish,
                     "logprobs": chat_logprobs(tok, [e for e in c.logprobs if e is not None], as_ids) if req.logprobs else None}
            if req.return_token_ids:
                entry |= {"token_ids": c.token_ids, "prompt_token_ids": ids}
            out.append(entry)
        body = {**env, "object": "chat.completion", "choices": out, "usage": use}
        if want_plp is not None:  # vLLM: on the response, beside the choices
            body["prompt_logprobs"] = prompt_logprobs_body(tok, ids, prompt_lps, as_ids)
        return body

    return await run_request(
        request, request_id=request_id, jobs=[Job(ids, params, 0)], n=req.n, stream=req.stream,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        continuous_usage=bool(req.stream_options and req.stream_options.continuous_usage_stats),
        on_delta=on_delta, first_chunks=first_chunks, final_body=final_body, chunk_envelope=env,
    )
