"""The node's health for ``GET /health``: ``ok``, ``degraded`` (it serves, but something is wrong:
a peer unreachable, stalled or refused, the node draining, a device down or stalled) or ``unavailable`` (it
cannot serve a request at all: every device down or stalled, or a pooled node whose prefill or decode
side is wholly gone).

A device is *stalled* when its oldest step in flight was sent :data:`STALLED_STEP_S` ago and has not
come back: its engine lives but does not answer (a kernel that never returns), so nothing else would
mark it down. With overlapped steps a step is sent while the one before it runs, so the age counts
that wait too: the test is "the last two steps took that long together".

A down device's reason says what happens next when the node has a restart supervisor
(:meth:`EngineSupervisor.describe <node.runtime.engine_supervisor.EngineSupervisor.describe>`): how long
it has been down, and when its restart comes, that it is restarting now, or why it is left down.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from node.runtime.interfaces import StateSource
from node.runtime.peer_state import READY, REFUSED
from node.runtime.switching import STALLED_STEP_S  # noqa: F401 - the threshold health reports by


INBOUND_REFUSAL_WINDOW_S = 60.0  # an inbound refusal this recent makes the node degraded
OK, DEGRADED, UNAVAILABLE = "ok", "degraded", "unavailable"


@dataclass
class Health:
    """``status`` (ok / degraded / unavailable) and why (empty when ok)."""

    status: str
    reasons: list[str] = field(default_factory=list)

    @property
    def http_status(self) -> int:
        """200 while the node can serve (ok or degraded), 503 when it cannot."""
        return 503 if self.status == UNAVAILABLE else 200

    def body(self) -> dict:
        return {"status": self.status} | ({"reasons": self.reasons} if self.reasons else {})


def _down(engine) -> str | None:
    # the engine's containment sets ``failure`` (a message) when its device stopped serving
    return getattr(engine, "failure", None)


def node_health(node: StateSource, now: float | None = None) -> Health:
    """The health of ``node`` at ``now`` (its monotonic clock; default: the current time)."""
    now = time.monotonic() if now is None else now
    cfg = node.config
    reasons: list[str] = []
    fatal: list[str] = []
    down = {e.device_id: f for e in node.engines if (f := _down(e))}
    supervisor = getattr(node, "supervisor", None)  # what happens next: since when, next restart, or left down
    plans = {d: supervisor.describe(d, now) if supervisor is not None else None for d in down}
    reasons += [f"engine {d} down: {f}" + (f" ({plans[d]})" if plans[d] else "") for d, f in down.items()]
    for e in node.engines:
        started = getattr(e, "step_started_s", None)
        if e.device_id not in down and started is not None and now - started >= STALLED_STEP_S:
            down[e.device_id] = "stalled"
            reasons.append(f"engine {e.device_id} stalled: a step has run for {now - started:.0f} s")
    if len(down) == len(node.engines):
        fatal.append("every engine is down or stalled")
    reasons += [f"API front end {i} down: {why}" for i, why in sorted(getattr(node, "api_down", {}).items())]
    if node.draining:
        reasons.append("draining: the node takes no new requests")
    ready = refused = 0
    if node.peers is not None:
        for p in list(node.peers.peers.values()):
            state, why = p.state(now, node.peers.stale_s)
            if state == READY:
                ready += 1
            else:
                refused += state == REFUSED
                reasons.append(f"peer {p.addr} {state}: {why}")
    if node.receiver is not None:
        reasons += [f"refused peer {r.node_id or r.peer} connecting to the KV port ({r.code}): {r.reason}"
                    for r in node.receiver.refused.recent(now, INBOUND_REFUSAL_WINDOW_S)]
    if cfg.mode == "pooled" and cfg.prefill_devices:
        if all(d in down for d in cfg.prefill_group_ids()):
            fatal.append("no prefill device is up")
        if ready == 0 and all(d in down for d in cfg.decode_group_ids()):
            why = "no decode device is up and no decode peer is ready" if cfg.decode_devices else "no decode peer is ready"
            if refused and refused == len(node.peers.peers):  # it cannot serve until a compatible peer comes
                why += ": every peer refused the handshake (incompatible: another model, layout or secret)"
            fatal.append(why)
    if fatal:
        return Health(UNAVAILABLE, fatal + reasons)
    return Health(DEGRADED if reasons else OK, reasons)
