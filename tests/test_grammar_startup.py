"""Issue 44's first-request stall and raw console lines: the grammar engine starts off the step path on the
first structured request, a grammar compiles off the step path, and xgrammar's C++ warnings become log lines.

The first structured request used to import xgrammar and scan the vocabulary inside a step of the engine
process (1.6-6 s on this 2-core sandbox), so every stream on the device stopped; now the node has each
engine build its grammar cache and compile a request's grammar in threads before queueing it
(:meth:`GrammarMasks.prepare`, answered between steps), and no node builds the cache at start-up.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import threading
import time

import pytest
import structlog
import torch

from node.core.grammar_spec import GrammarSpec
from node.log_native import native_stderr_to_log
from node.worker.grammar_masks import GrammarMasks
from node.worker.tokenizer import TextTokenizer
from support import STORIES, NodeProcess, require_shared

TOK = TextTokenizer.from_folder(STORIES)
RAW_NATIVE = re.compile(r"^\[\d\d:\d\d:\d\d\] \S+\.(cc|h):\d+:", re.M)  # xgrammar's own console format
# xgrammar warns (and ignores multipleOf: the API refuses this schema, node.api.structured.unenforced_keyword)
UNENFORCED_NUMBER = {"type": "object", "properties": {"x": {"type": "number", "multipleOf": 0.5}}}


class _Seq:
    """The engine-side state GrammarMasks reads: params.grammar, token_ids, prompt_len, grammar."""

    def __init__(self, spec: GrammarSpec):
        self.params = type("P", (), {"grammar": spec})()
        self.token_ids = TOK.encode("Once upon a time")
        self.prompt_len = len(self.token_ids)
        self.grammar = None


def _prepared(masks: GrammarMasks, spec: GrammarSpec) -> tuple[bool, str]:
    """Ask as the node does (between steps) until the engine's compile thread has an answer."""
    deadline = time.monotonic() + 60
    while True:
        ready, error = masks.prepare(spec)
        if ready or error or time.monotonic() > deadline:
            return ready, error
        time.sleep(0.005)


@pytest.mark.quick
def test_a_prepared_grammar_is_not_compiled_by_the_step_and_an_unprepared_one_is_counted():
    masks = GrammarMasks(TOK, 512, TOK.eos_token_ids)
    spec = GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {"prepared": {"type": "integer"}}}))
    assert not masks.started  # nothing built before a request needs it
    assert masks.prepare(spec) == (False, "")  # the first ask starts the cache's build in a thread, answered at once
    masks.preload().result(timeout=120)
    assert masks.started
    assert masks.prepare(spec) == (False, "")  # not compiled yet: handed to the compile thread, answered at once
    assert _prepared(masks, spec) == (True, "")
    mask, rows = masks.fill([(0, _Seq(spec))])
    assert rows == [0] and mask.dtype == torch.int32
    assert masks.in_step_compiles == 0
    other = GrammarSpec("regex", "[0-9]{2,5}unprepared")
    masks.fill([(0, _Seq(other))])  # a sequence moved here: compiled by the step, and counted
    assert masks.in_step_compiles == 1


@pytest.mark.quick
def test_an_arrivals_matcher_is_replayed_off_the_step_and_taken_by_its_first_step():
    """A sequence arriving with output (moved, handed off, resumed): the engine's grammar thread compiles its
    grammar and replays its emitted tokens into a matcher (:meth:`GrammarMasks.prepare` with ``seq_id``); the
    sequence's first step takes it (:meth:`GrammarMasks.arrived`) and fills its mask without a compile or a
    replay. One nobody prepared, or prepared from other tokens, is replayed by its step, and counted."""
    masks = GrammarMasks(TOK, 512, TOK.eos_token_ids)
    spec = GrammarSpec("regex", "(ab|cd)+e")
    prompt = TOK.encode("Once upon a time")
    emitted = TOK.encode("ab", add_special_tokens=False)
    deadline = time.monotonic() + 60
    while (got := masks.prepare(spec, "moved", emitted)) == (False, "") and time.monotonic() < deadline:
        time.sleep(0.005)
    assert got == (True, "")
    arrival = _Seq(spec)
    arrival.token_ids, arrival.prompt_len = prompt + emitted, len(prompt)
    arrival.grammar = masks.arrived("moved", spec, arrival.token_ids, arrival.prompt_len)
    assert arrival.grammar is not None and arrival.grammar.consumed == len(emitted)
    assert masks.arrived("moved", spec, arrival.token_ids, arrival.prompt_len) is None  # taken once
    masks.fill([(0, arrival)])
    assert masks.in_step == 0
    assert _prepared(masks, spec) == (True, "")
    other = _Seq(spec)  # prepared from other tokens than it carries: not taken, replayed by its step
    assert masks.prepare(spec, "other", [5]) == (False, "")
    deadline = time.monotonic() + 60
    while masks.prepare(spec, "other", [5]) == (False, "") and time.monotonic() < deadline:
        time.sleep(0.005)
    other.token_ids, other.prompt_len = prompt + emitted, len(prompt)
    assert masks.arrived("other", spec, other.token_ids, other.prompt_len) is None
    masks.fill([(0, other)])
    assert (masks.in_step_compiles, masks.in_step_rebuilds) == (0, 1)


@pytest.mark.quick
def test_a_grammar_that_does_not_compile_in_the_engine_is_an_error_answer():
    masks = GrammarMasks(TOK, 512, TOK.eos_token_ids)
    ready, error = _prepared(masks, GrammarSpec("ebnf", "root ::= undefined_rule"))
    assert not ready and "does not compile" in error


@pytest.fixture
def no_native_capture():
    """Wait until no capture of descriptor 2 is open in this process (a grammar still compiling in a thread
    of an earlier test's in-process node keeps one open, and a capture's end restores descriptor 2 to what
    it was at its start), so that ``capfd``, set up after this, owns descriptor 2 for the test."""
    from node.log_native import stderr_uncaptured

    with stderr_uncaptured():
        pass


@pytest.mark.quick
def test_xgrammar_cpp_warnings_become_log_lines_and_other_stderr_passes_through(no_native_capture, capfd):
    from node.worker.grammar import json_schema_ebnf

    with structlog.testing.capture_logs() as logs:
        with native_stderr_to_log():
            json_schema_ebnf(json.dumps(UNENFORCED_NUMBER))
            os.write(2, b"not a native log line\n")
    err = capfd.readouterr().err
    assert not RAW_NATIVE.search(err), err
    assert "not a native log line" in err
    [line] = [e for e in logs if e["event"] == "native_warning"]
    assert "multipleOf" in line["message"] and line["library"] == "xgrammar" and line["source"].endswith(".cc:1094")


@pytest.mark.quick
def test_a_matchers_warning_while_an_arrival_is_replayed_becomes_a_log_line(no_native_capture, capfd):
    """xgrammar's matcher warns on the console about a token it cannot take (a special token: one whose text
    is empty, as a chat model's added tokens are). An arriving sequence's tokens were sampled elsewhere, not
    under this matcher's mask, so its replay (in the engine's grammar thread) may meet one: the line is a
    ``native_warning`` log event, not a raw console line, and the matcher stops masking (logged)."""
    import xgrammar

    from node.worker.grammar import GrammarCache, tokenizer_info

    masks = GrammarMasks(TOK, 512, TOK.eos_token_ids)
    vocab = list(tokenizer_info(TOK, 512, TOK.eos_token_ids).decoded_vocab)
    vocab[0] = b""  # <unk> as a special token
    info = xgrammar.TokenizerInfo(vocab, vocab_size=512, stop_token_ids=TOK.eos_token_ids)
    assert info.special_token_ids == [0]
    built = concurrent.futures.Future()
    built.set_result(GrammarCache(info))
    masks._preload = built  # this vocabulary's cache, as if the engine had built it
    spec = GrammarSpec("regex", "(ab|cd)+e")
    capfd.readouterr()
    with structlog.testing.capture_logs() as logs:
        deadline = time.monotonic() + 60
        while (got := masks.prepare(spec, "arrived", [0])) == (False, "") and time.monotonic() < deadline:
            time.sleep(0.005)
    err = capfd.readouterr().err
    assert got == (True, "")
    assert not RAW_NATIVE.search(err), err
    [line] = [e for e in logs if e["event"] == "native_warning"]
    assert "cannot accept special token id 0" in line["message"] and line["source"].startswith("/project/cpp/grammar_matcher")
    assert any(e["event"] == "grammar_token_rejected" for e in logs)
    assert masks.arrived("arrived", spec, [5, 0], 1).broken


def _timed_streams(node: NodeProcess, arrivals: list[tuple[int, float]], started: threading.Event,
                   stop: threading.Event) -> None:
    """Greedy streams one after another until ``stop``: each token event's (stream, arrival time)."""
    body = {"prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True, "temperature": 0, "stream": True}
    n = 0
    while not stop.is_set():
        with node.client.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    arrivals.append((n, time.monotonic()))
                    if len(arrivals) == 200:
                        started.set()
        n += 1


def test_the_first_structured_request_does_not_stall_a_decoding_stream_and_prints_no_raw_lines():
    """Streams decode on a fresh node; their largest inter-token gap while the node's first structured
    request is served (xgrammar imported and the vocabulary scanned, by the node and its engine, then the
    grammar compiled) stays within a bound set by their own gaps before (the old code's first grammar step
    imported xgrammar: over a second here, every stream of the device waiting)."""
    require_shared()
    node = NodeProcess("--model", str(STORIES), "--log-level", "debug")
    try:
        arrivals: list[tuple[int, float]] = []
        started, stop = threading.Event(), threading.Event()
        t = threading.Thread(target=_timed_streams, args=(node, arrivals, started, stop), daemon=True)
        t.start()
        assert started.wait(60)
        sent = time.monotonic()
        r = node.client.post("/v1/completions", json={"prompt": "Once", "max_tokens": 16, "temperature": 0,
                                                      "guided_json": {"type": "object", "properties": {
                                                          "x": {"type": "integer", "multipleOf": 3}}}})
        answered = time.monotonic()
        assert r.status_code == 200, r.text
        time.sleep(0.2)
        stop.set()
        t.join(120)
        gaps = [(b, b - a) for (i, a), (j, b) in zip(arrivals, arrivals[1:]) if i == j]  # within one stream
        before = [g for b, g in gaps if b <= sent]
        during = [g for b, g in gaps if sent < b < answered + 0.05]
        assert len(before) >= 150 and during, (len(before), len(during))
        # the old in-step build stopped every stream for 1.6-6 s here. The build now runs in threads of the node
        # and the engine, which share the machine's 2 cores and the engine's GIL with the steps: gaps of up to
        # about a second were seen on a loaded machine, whose own scheduling gaps reach several tenths of a
        # second (a bare Python loop's), and a 1.02 s gap was seen once at load 8. So the bound is generous
        # (the old stall was 1.6-6 s); the exact checks are the log lines and the device's in-step counter
        bound = max(5 * max(before), 1.5)
        logs = node.logs()
        assert "grammar_compiled_in_step" not in logs and "grammar_cache_built_in_step" not in logs
        assert [d["grammar_in_step"] for d in node.status()["devices"]] == [0], node.status()["devices"]
        assert max(during) < bound, f"a {max(during):.3f} s gap while the first grammar compiled (bound {bound:.3f} s)"
        assert not RAW_NATIVE.search(logs), logs[-2000:]
    finally:
        node.close()


@pytest.mark.quick
def test_a_child_process_started_while_a_capture_is_open_inherits_the_real_stderr(no_native_capture, capfd):
    """A grammar compiling in one thread (descriptor 2 captured) while the node starts an engine process in
    another: the start waits for the capture to end, so the child's log lines are not lost in its file."""
    import subprocess
    import sys

    from node.log_native import stderr_uncaptured

    opened = threading.Event()

    def compile_slowly():
        with native_stderr_to_log():
            opened.set()
            time.sleep(0.4)

    t = threading.Thread(target=compile_slowly)
    t.start()
    assert opened.wait(10)
    t0 = time.monotonic()
    with stderr_uncaptured():
        waited = time.monotonic() - t0
        subprocess.run([sys.executable, "-c", "import sys; sys.stderr.write('the child writes this\\n')"], check=True)
    t.join()
    assert waited > 0.2  # it waited for the capture
    assert "the child writes this" in capfd.readouterr().err


@pytest.mark.quick
def test_looking_up_the_cache_never_waits_for_a_build(monkeypatch):
    """The event loop looks the cache up (existing_grammar_cache, grammar_cache_status) while a thread builds it
    (xgrammar's import: seconds): the lookup answers at once. It used to wait for the build, under one lock."""
    from node.worker import grammar

    building, release = threading.Event(), threading.Event()

    def slow_info(tok, vocab_size, stop_ids):
        building.set()
        assert release.wait(30)
        return real_info(tok, vocab_size, stop_ids)

    real_info = grammar.tokenizer_info
    monkeypatch.setattr(grammar, "tokenizer_info", slow_info)
    tok = TextTokenizer.from_folder(STORIES)  # a tokenizer object of its own: a key no other test built
    fut = concurrent.futures.ThreadPoolExecutor(1).submit(grammar.grammar_cache, tok, 512, tok.eos_token_ids)
    assert building.wait(30)
    t0 = time.monotonic()
    assert grammar.existing_grammar_cache(tok, 512, tok.eos_token_ids) is None
    grammar.grammar_cache_status()
    waited = time.monotonic() - t0
    release.set()
    assert fut.result(60) is grammar.existing_grammar_cache(tok, 512, tok.eos_token_ids)
    assert waited < 0.5, waited
