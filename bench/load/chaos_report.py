"""What a chaos run (``bench/load/chaos.py``) saw, and the verdict: the report and how an answer is classified.

Every request ends in one of four ways: ``ok`` (a full answer: ``[DONE]`` with no error event, or a 200 body),
``failed`` with a clear error, ``aborted`` by its own client, or ``hung`` (no end within the client's deadline:
must be 0). A clear error is an OpenAI-style error with a code that says why: a 503 (``type``
``service_unavailable``; over HTTP with ``Retry-After``), or the one documented 500, ``engine_crash`` (a request
whose step killed its engine again while it ran alone, ``node/runtime/resume.py``). Anything else (a bare 5xx, an
``internal_error`` event, a stream cut without ``[DONE]``, a refused connection) is *unclear* and fails the run.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

UNCLEAR_PREFIX = "unclear:"


def classify_error(status: int, error: dict | None, retry_after: str | None = None) -> str:
    """The outcome key of a request answered with ``error`` (the ``error`` object of an OpenAI-style body or
    SSE event; ``status``: the HTTP status, 200 for an event inside a stream): ``"<code>"`` for a clear error,
    ``"unclear:<what>"`` otherwise."""
    error = error or {}
    code, kind = error.get("code"), error.get("type")
    if status == 200:  # an error event inside a stream: its type carries the status
        status = 503 if kind == "service_unavailable" else 500 if kind == "server_error" else 400
    elif status == 503 and retry_after is None:
        return f"{UNCLEAR_PREFIX}503 {code} without Retry-After"
    if code and (status == 503 or (status == 500 and code == "engine_crash")):
        return code
    return f"{UNCLEAR_PREFIX}{status} {code}"


@dataclass
class Kill:
    """One ``kill -9`` of an engine process: when (s into the run), which, and what was in flight on that
    device at the last look before it (``move-src``, ``move-dst``, ``handoff-src``, ``handoff-dst`` or
    ``idle-or-decoding``: no KV transfer)."""

    at_s: float
    node: str
    device: str
    pid: int
    context: str

    def line(self) -> str:
        return f"{self.at_s:7.1f} s  kill -9 {self.node} {self.device} (pid {self.pid}): {self.context}"


@dataclass
class ChaosReport:
    """Counts of one chaos run; :meth:`failures` lists the checks that did not hold."""

    scenario: str
    requests: int = 0
    outcomes: collections.Counter = field(default_factory=collections.Counter)  # ok / aborted / hung / error code
    greedy_compared: int = 0  # greedy answers compared with the unkilled reference (complete, or a prefix)
    greedy_during_kills: int = 0  # of those, requests in flight while an engine was killed
    greedy_mismatches: list[str] = field(default_factory=list)
    kills: list[Kill] = field(default_factory=list)
    stalls: list[str] = field(default_factory=list)
    counters: dict = field(default_factory=dict)  # node -> {metric: value} at the end (restarts, resumes, ...)
    leaked_blocks: dict = field(default_factory=dict)  # "node device" -> KV blocks still held after the drain
    live_requests: dict = field(default_factory=dict)  # node -> requests it still holds after the drain
    engine_errors: dict = field(default_factory=dict)  # "node device" -> {stage: count} (ledger check included)
    ledger_log_lines: int = 0  # node log lines naming a LedgerError
    health_after: dict = field(default_factory=dict)  # node -> /health status after the settle
    devices_down_after: list[str] = field(default_factory=list)
    served_after: bool = False  # every node answered the reference prompts exactly after the run
    rss_kib: dict = field(default_factory=dict)  # node -> [private RSS after warm-up, at the end] (KiB)
    judge_memory: bool = False
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def unclear(self) -> dict:
        return {k: n for k, n in self.outcomes.items() if k.startswith(UNCLEAR_PREFIX)}

    @property
    def clear_errors(self) -> dict:
        return {k: n for k, n in self.outcomes.items()
                if k not in ("ok", "aborted", "hung") and not k.startswith(UNCLEAR_PREFIX)}

    def transfer_kills(self) -> collections.Counter:
        """Kills by what was in flight on the killed device."""
        return collections.Counter(k.context for k in self.kills)

    def max_rss_growth(self) -> float:
        return max((end / warm - 1 for warm, end in self.rss_kib.values() if warm and end), default=0.0)

    def failures(self) -> list[str]:
        """The checks that failed (empty: the run passed)."""
        out = []
        if not self.kills:
            out.append("no engine was killed")
        if self.outcomes["hung"]:
            out.append(f"{self.outcomes['hung']} requests hung")
        if self.unclear:
            out.append(f"unclear failures {self.unclear}")
        if self.greedy_mismatches:
            out.append(f"{len(self.greedy_mismatches)} greedy outputs differ from the reference: "
                       f"{self.greedy_mismatches[:3]}")
        if any(self.leaked_blocks.values()):
            out.append(f"leaked KV blocks {self.leaked_blocks}")
        if any(self.live_requests.values()):
            out.append(f"requests still held {self.live_requests}")
        if any(self.engine_errors.values()) or self.ledger_log_lines:
            out.append(f"engine errors {self.engine_errors}, {self.ledger_log_lines} LedgerError log lines")
        if any(s != "ok" for s in self.health_after.values()) or self.devices_down_after:
            out.append(f"not healthy after the run: {self.health_after}, down {self.devices_down_after}")
        if not self.served_after:
            out.append("a node did not serve the reference prompts exactly after the run")
        if self.judge_memory and self.max_rss_growth() >= 0.10:
            out.append(f"node RSS grew {self.max_rss_growth():+.1%} after the warm-up")
        return out

    def ok(self) -> bool:
        return not self.failures()

    def lines(self) -> list[str]:
        o = self.outcomes
        ctx = dict(self.transfer_kills())
        return [
            *(k.line() for k in self.kills), *self.stalls, *self.notes,
            f"scenario {self.scenario}: {self.seconds:.0f} s of load, {len(self.kills)} engine kills {ctx}",
            f"requests {self.requests}: ok {o['ok']}, failed with a clear error {sum(self.clear_errors.values())} "
            f"{self.clear_errors}, aborted by the client {o['aborted']}, hung {o['hung']}, unclear {self.unclear}",
            f"greedy outputs compared with the unkilled reference {self.greedy_compared} "
            f"({self.greedy_during_kills} in flight during a kill), different {len(self.greedy_mismatches)}",
            "per node at the end: " + "; ".join(f"{n} {c}" for n, c in self.counters.items()),
            f"leaked KV blocks {sum(self.leaked_blocks.values())} {self.leaked_blocks}; requests still held "
            f"{self.live_requests}; engine errors {self.engine_errors}; LedgerError log lines {self.ledger_log_lines}",
            f"after the run: /health {self.health_after}, devices down {self.devices_down_after or 'none'}, "
            f"served the reference exactly: {self.served_after}",
            "node private RSS after warm-up -> end (KiB): " + ", ".join(
                f"{n} {w} -> {e} ({e / w - 1:+.1%})" for n, (w, e) in self.rss_kib.items() if w)
            + ("" if self.judge_memory else " (not judged: short run)"),
            "PASS" if self.ok() else "FAIL: " + "; ".join(self.failures()),
        ]
