"""What clients send as ``max_tokens``: a stated, seeded mix, drawn per request.

A trace gives each request's true output length; a real client does not send it. It sends a
``max_tokens`` far above the output (a UI's or SDK's round default), or none, leaving the node's context
limit as the bound. :data:`DEFAULT_CLIENT_MIX` is a stated assumption, not a measurement: 60 % of
requests at 4,096, 30 % at 1,024 and 10 % with no ``max_tokens``. A request then ends by EOS at its true
length (a stop the node does not foresee), or at its ``max_tokens`` when that comes first.

The mix is written ``VALUE:SHARE,...`` (``none`` for an absent ``max_tokens``); ``true`` is the old
oracle, ``max_tokens`` = the trace's output (and ``ignore_eos``), kept as a named comparison.
:func:`draw_max_tokens` draws one value per request from a ``random.Random(seed)``, in request order, so
the simulator and a live replay of the same workload and seed send the same values.
"""

from __future__ import annotations

import random

from bench.traffic.traces import TraceRequest

__all__ = ["DEFAULT_CLIENT_MIX", "TRUE_LENGTH", "parse_client_mix", "draw_max_tokens", "with_client_max_tokens"]

DEFAULT_CLIENT_MIX = "4096:0.6,1024:0.3,none:0.1"
TRUE_LENGTH = "true"  # the oracle: max_tokens = the trace's output length


def parse_client_mix(text: str) -> list[tuple[int | None, float]]:
    """``[(max_tokens or None for absent, share)]`` of a mix ``VALUE:SHARE,...`` (shares need not sum to 1;
    they are weights).

    Raises:
        ValueError: an empty mix, a value that is not a positive integer or ``none``, or a share that is
            not positive.
    """
    out: list[tuple[int | None, float]] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        value, sep, share = part.partition(":")
        try:
            v = None if value.strip().lower() == "none" else int(value)
            w = float(share) if sep else float("nan")
        except ValueError:
            raise ValueError(f"client mix entry {part!r}: want VALUE:SHARE (VALUE a token count or none)") from None
        if (v is not None and v < 1) or not w > 0:
            raise ValueError(f"client mix entry {part!r}: max_tokens at least 1 and a positive share")
        out.append((v, w))
    if not out:
        raise ValueError("empty client max_tokens mix")
    return out


def draw_max_tokens(n: int, mix: str, seed: int) -> list[int | None]:
    """``n`` client ``max_tokens`` values (None: absent) drawn from ``mix`` with ``random.Random(seed)``."""
    entries = parse_client_mix(mix)
    rng = random.Random(seed)
    values, weights = [v for v, _ in entries], [w for _, w in entries]
    return [rng.choices(values, weights)[0] for _ in range(n)]


def with_client_max_tokens(requests: list[TraceRequest], mix: str, seed: int) -> list[TraceRequest]:
    """``requests`` (in this order) with ``max_tokens`` drawn from ``mix`` (:func:`draw_max_tokens`); with
    ``mix == "true"`` each gets its own output length (the oracle)."""
    from dataclasses import replace

    if mix == TRUE_LENGTH:
        return [replace(r, max_tokens=r.output_tokens) for r in requests]
    return [replace(r, max_tokens=m) for r, m in zip(requests, draw_max_tokens(len(requests), mix, seed))]
