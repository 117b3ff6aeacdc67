"""Issue 44's first-request stall and raw console lines: the grammar engine starts with the node, a grammar
compiles off the step path, and xgrammar's C++ warnings become log lines.

The first structured request used to import xgrammar and scan the vocabulary inside a step of the engine
process (1.6-6 s on this 2-core sandbox), so every stream on the device stopped; now the engine builds its
grammar cache before it reports ready and the node has each engine compile a request's grammar in a thread
before queueing it (:meth:`GrammarMasks.prepare`).
"""

from __future__ import annotations

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
UNENFORCED_NUMBER = {"type": "object", "properties": {"x": {"type": "number", "multipleOf": 0.5}}}  # xgrammar warns


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
    masks.preload().result(timeout=120)
    spec = GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {"prepared": {"type": "integer"}}}))
    assert masks.prepare(spec) == (False, "")  # not compiled yet: handed to the compile thread, answered at once
    assert _prepared(masks, spec) == (True, "")
    mask, rows = masks.fill([(0, _Seq(spec))])
    assert rows == [0] and mask.dtype == torch.int32
    assert masks.in_step_compiles == 0
    other = GrammarSpec("regex", "[0-9]{2,5}unprepared")
    masks.fill([(0, _Seq(other))])  # a sequence moved here: compiled by the step, and counted
    assert masks.in_step_compiles == 1


@pytest.mark.quick
def test_a_grammar_that_does_not_compile_in_the_engine_is_an_error_answer():
    masks = GrammarMasks(TOK, 512, TOK.eos_token_ids)
    ready, error = _prepared(masks, GrammarSpec("ebnf", "root ::= undefined_rule"))
    assert not ready and "does not compile" in error


@pytest.mark.quick
def test_xgrammar_cpp_warnings_become_log_lines_and_other_stderr_passes_through(capfd):
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


def _timed_stream(node: NodeProcess, arrivals: list[float], started: threading.Event) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True, "temperature": 0, "stream": True}
    with node.client.stream("POST", "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.monotonic())
                if len(arrivals) == 60:
                    started.set()


def test_the_first_structured_request_does_not_stall_a_decoding_stream_and_prints_no_raw_lines():
    """A stream decodes on a fresh node; its largest inter-token gap while the node's first structured
    request is served stays within a bound set by its own gaps before (the old code's first grammar step
    imported xgrammar: over a second here, every stream of the device waiting)."""
    require_shared()
    node = NodeProcess("--model", str(STORIES), "--log-level", "debug")
    try:
        arrivals: list[float] = []
        started = threading.Event()
        t = threading.Thread(target=_timed_stream, args=(node, arrivals, started), daemon=True)
        t.start()
        assert started.wait(60)
        sent = time.monotonic()
        r = node.client.post("/v1/completions", json={"prompt": "Once", "max_tokens": 16, "temperature": 0,
                                                      "guided_json": UNENFORCED_NUMBER})
        answered = time.monotonic()
        assert r.status_code == 200, r.text
        t.join(120)
        before = [b - a for a, b in zip(arrivals, arrivals[1:]) if b <= sent]
        during = [b - a for a, b in zip(arrivals, arrivals[1:]) if b > sent and a < answered + 0.05]
        assert arrivals[-1] > answered, "the stream ended before the structured request was answered: nothing measured"
        assert len(before) >= 50 and during, (len(before), len(during))
        bound = max(3 * max(before), 0.3)
        assert max(during) < bound, f"a {max(during):.3f} s gap while the first grammar compiled (bound {bound:.3f} s)"
        logs = node.logs()
        assert "grammar_compiled_in_step" not in logs and "grammar_cache_built_in_step" not in logs
        assert not RAW_NATIVE.search(logs), logs[-2000:]
        assert "native_warning" in logs and "multipleOf" in logs  # routed, not lost
    finally:
        node.close()


@pytest.mark.quick
def test_a_child_process_started_while_a_capture_is_open_inherits_the_real_stderr(capfd):
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
