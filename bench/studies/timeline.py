"""Role timelines from a node's own switch records (``GET /v1/node``: ``devices[].switches``).

A record ``{start_s, end_s, from_role, to_role, pause_ms, ...}`` (node monotonic clock, s) says the
device left ``from_role`` at ``start_s``, drained the step in flight, paused ``pause_ms`` and took
``to_role`` at ``end_s``. :func:`role_segments` turns a device's records into contiguous segments
``(start, end, state)`` on ``[t0, t1]``, times relative to ``t0``, where ``state`` is a role
(``prefill``, ``decode``, or ``mixed`` for colocated devices, which never switch), ``drain`` (waiting
for the step in flight) or ``pause`` (the reconfiguration pause, the last ``pause_ms`` of a switch).
"""

from __future__ import annotations

__all__ = ["role_segments", "switches_in"]


def switches_in(records: list[dict], t0: float, t1: float) -> list[dict]:
    """Records of switches that ended after ``t0`` and began before ``t1``, by start time."""
    return sorted((r for r in records if r["end_s"] > t0 and r["start_s"] < t1), key=lambda r: r["start_s"])


def role_segments(records: list[dict], t0: float, t1: float, current_role: str) -> list[tuple[float, float, str]]:
    """Segments of one device on ``[t0, t1]`` (relative times, s); ``current_role`` when it never switched."""
    recs = switches_in(records, t0, t1)
    if not recs:
        return [(0.0, t1 - t0, current_role)]
    out: list[tuple[float, float, str]] = []

    def add(a: float, b: float, state: str) -> None:
        a, b = max(a, t0), min(b, t1)
        if b > a:
            out.append((a - t0, b - t0, state))

    t, role = t0, recs[0]["from_role"]
    for r in recs:
        add(t, r["start_s"], role)
        pause_start = max(r["start_s"], r["end_s"] - r["pause_ms"] / 1e3)
        add(r["start_s"], pause_start, "drain")
        add(pause_start, r["end_s"], "pause")
        t, role = r["end_s"], r["to_role"]
    add(t, t1, role)
    return out
