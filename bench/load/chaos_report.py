"""What a chaos run (``bench/load/chaos.py``) saw, and the verdict: the report and how an answer is classified.

Every request ends in one of four ways: ``ok`` (a full answer: ``[DONE]`` with no error event, or a 200 body),
``failed`` with a clear error, ``aborted`` by its own client, or ``hung`` (no end within the client's deadline:
must be 0). A clear error is an OpenAI-style error with a code that says why: a 503 (``type``
``service_unavailable``; over HTTP with ``Retry-After``), or the one documented 500, ``engine_crash`` (a request
whose step killed its engine again while it ran alone, ``node/runtime/resume.py``). Anything else (a bare 5xx, an
``internal_error`` event, a stream cut without ``[DONE]``, a refused connection) is *unclear* and fails the run,
except on a node that the run killed: a request whose node died under it, or that found it down, is *lost*
(``lost:<what>``, counted apart; :func:`bench.load.chaos_nodes.lost_to_a_killed_node`), neither clear nor hung.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

UNCLEAR_PREFIX = "unclear:"
LOST_PREFIX = "lost:"  # the connection to a node the run killed dropped, or was refused while it was down


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
    ``no-transfer``: none)."""

    at_s: float
    node: str
    device: str
    pid: int
    context: str

    def line(self) -> str:
        return f"{self.at_s:7.1f} s  kill -9 {self.node} {self.device} (pid {self.pid}): {self.context}"


@dataclass
class NodeKill:
    """One ``kill -9`` of a whole node (``--node-kill-every``): when (s into the run), which, its server pid, its
    engine pids then, those still alive ``ORPHAN_WAIT_S`` after it died (must be none), and how long until
    it answered ``/health`` again on the same port (None: it did not come back; ``restart_error`` says why)."""

    at_s: float
    node: str
    pid: int
    engines: list[int]
    orphans: list[int] = field(default_factory=list)
    back_after_s: float | None = None
    restart_error: str = ""

    def line(self) -> str:
        back = f"back after {self.back_after_s:.1f} s" if self.back_after_s is not None else \
            f"NOT BACK: {self.restart_error or 'the run ended first'}"
        return (f"{self.at_s:7.1f} s  kill -9 node {self.node} (pid {self.pid}, engines {self.engines}): {back}"
                + (f"; engines outlived it: {self.orphans}" if self.orphans else ""))


@dataclass
class EtcdRestart:
    """One ``kill -9`` of etcd, restarted after ``down_s`` on the same ports and data (``--etcd-restart-every``)."""

    at_s: float
    down_s: float
    back_after_s: float | None = None
    error: str = ""

    def line(self) -> str:
        back = f"healthy after {self.back_after_s:.1f} s" if self.back_after_s is not None else f"NOT BACK: {self.error}"
        return f"{self.at_s:7.1f} s  kill -9 etcd, restarted {self.down_s:g} s later: {back}"


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
    node_kills: list[NodeKill] = field(default_factory=list)
    etcd_restarts: list[EtcdRestart] = field(default_factory=list)
    membership_after: dict = field(default_factory=dict)  # node -> what is wrong with its etcd membership ("" ok)
    unhealthy_peers_after: dict = field(default_factory=dict)  # node -> its peers without a healthy KV link
    counters: dict = field(default_factory=dict)  # node -> {metric: value} at the end (restarts, resumes, ...)
    leaked_blocks: dict = field(default_factory=dict)  # "node device" -> KV blocks still held after the drain
    live_requests: dict = field(default_factory=dict)  # node -> requests it still holds after the drain
    engine_errors: dict = field(default_factory=dict)  # "node device" -> {stage: count} (ledger check included)
    ledger_log_lines: int = 0  # node log lines naming a LedgerError
    asyncio_error_lines: int = 0  # node log lines of asyncio's own errors (an exception nobody retrieved)
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
    def lost(self) -> dict:
        """Requests whose node the run killed under them (or that found it down), by what the client saw."""
        return {k: n for k, n in self.outcomes.items() if k.startswith(LOST_PREFIX)}

    @property
    def clear_errors(self) -> dict:
        return {k: n for k, n in self.outcomes.items()
                if k not in ("ok", "aborted", "hung") and not k.startswith((UNCLEAR_PREFIX, LOST_PREFIX))}

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
        if self.asyncio_error_lines:
            out.append(f"{self.asyncio_error_lines} asyncio error log lines (a failure nobody handled)")
        if any(k.orphans for k in self.node_kills):
            out.append(f"engine processes outlived their killed node: {[k.orphans for k in self.node_kills if k.orphans]}")
        if any(k.back_after_s is None for k in self.node_kills) or any(r.back_after_s is None for r in self.etcd_restarts):
            out.append("a killed node or etcd did not come back")
        if any(self.membership_after.values()):
            out.append(f"etcd membership not whole after the run: {self.membership_after}")
        if any(self.unhealthy_peers_after.values()):
            out.append(f"peers without a healthy KV link after the run: {self.unhealthy_peers_after}")
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
            *(k.line() for k in self.kills), *(k.line() for k in self.node_kills),
            *(r.line() for r in self.etcd_restarts), *self.stalls, *self.notes,
            f"scenario {self.scenario}: {self.seconds:.0f} s of load, {len(self.kills)} engine kills {ctx}, "
            f"{len(self.node_kills)} node kills, {len(self.etcd_restarts)} etcd restarts, {len(self.stalls)} node stalls",
            f"requests {self.requests}: ok {o['ok']}, failed with a clear error {sum(self.clear_errors.values())} "
            f"{self.clear_errors}, aborted by the client {o['aborted']}, lost with a killed node "
            f"{sum(self.lost.values())} {self.lost}, hung {o['hung']}, unclear {self.unclear}",
            f"greedy outputs compared with the unkilled reference {self.greedy_compared} "
            f"({self.greedy_during_kills} in flight during a kill), different {len(self.greedy_mismatches)}",
            "per node at the end: " + "; ".join(f"{n} {c}" for n, c in self.counters.items()),
            f"leaked KV blocks {sum(self.leaked_blocks.values())} {self.leaked_blocks}; requests still held "
            f"{self.live_requests}; engine errors {self.engine_errors}; LedgerError log lines {self.ledger_log_lines}; asyncio error lines {self.asyncio_error_lines}",
            f"after the run: /health {self.health_after}, devices down {self.devices_down_after or 'none'}, "
            f"served the reference exactly: {self.served_after}; etcd membership {self.membership_after or 'not used'}; "
            f"unhealthy peers {self.unhealthy_peers_after}",
            "node private RSS after warm-up -> end (KiB): " + ", ".join(
                f"{n} {w} -> {e} ({e / w - 1:+.1%})" for n, (w, e) in self.rss_kib.items() if w)
            + ("" if self.judge_memory else " (not judged: short run)"),
            "PASS" if self.ok() else "FAIL: " + "; ".join(self.failures()),
        ]
