"""The flags of the HTTP streams and the API front ends (``shiftnode serve``): how events are sent, when a
slow client is stalled (node/api/sse.py), how many front-end processes serve and how they are watched."""

from __future__ import annotations

import argparse


def add_stream_flags(p: argparse.ArgumentParser) -> None:
    """Add the flags to ``shiftnode serve``'s parser (their values: :func:`stream_config`)."""
    p.add_argument("--stream-interval", type=int, default=1, metavar="N",
                   help="streams send an event every N tokens (the first token and the end at once): fewer events "
                        "and less work per token for clients that do not need each token (SGLang's and vLLM's flag)")
    p.add_argument("--sse-keepalive-s", type=float, default=10.0, help="SSE comment line after this much silence")
    p.add_argument("--body-timeout-s", type=float, default=30.0, help="answer 408 to a request body slower than this")
    p.add_argument("--sse-buffer-bytes", type=int, default=1 << 20,
                   help="a stream whose client has more than this unsent gets its deltas joined until it catches up")
    p.add_argument("--sse-stall-bytes", type=int, default=64 << 20,
                   help="a stream whose client has more than this unsent and held is stalled: its KV freed, its stream ended with an error event")
    p.add_argument("--sse-stall-s", type=float, default=60.0,
                   help="a stream whose client, above --sse-buffer-bytes unsent, acknowledges nothing for this long is "
                        "stalled (as --sse-stall-bytes)")
    p.add_argument("--api-heartbeat-timeout-s", type=float, default=10.0,
                   help="an API front end that answers no heartbeat for this long (its event loop stuck, its process "
                        "stopped) is killed and started again")
    p.add_argument("--api-processes", type=int, default=None, metavar="N",
                   help="HTTP front-end processes sharing --port (SO_REUSEPORT): they decode bodies, detokenize, apply "
                        "stop strings and write the streams, so the node's event loop does per-step work only; 1: all "
                        "in one process (default: 1 below 8 cores, else a quarter of the cores, at most 4; see "
                        "docs/user-guide.md)")


def stream_config(a: argparse.Namespace) -> dict:
    """The :class:`~node.config.NodeConfig` fields of the flags :func:`add_stream_flags` added."""
    from node.config import usable_cores

    return dict(sse_keepalive_s=a.sse_keepalive_s, stream_interval=a.stream_interval, body_timeout_s=a.body_timeout_s,
                sse_buffer_bytes=a.sse_buffer_bytes, sse_stall_bytes=a.sse_stall_bytes, sse_stall_s=a.sse_stall_s,
                api_processes=a.api_processes if a.api_processes is not None else default_api_processes(usable_cores()),
                api_heartbeat_timeout_s=a.api_heartbeat_timeout_s)


def default_api_processes(cores: int | None) -> int:
    """``--api-processes`` when not given: one process on a small machine (a front end only pays off
    where it gets a core of its own beside the control loop and the engines), else a quarter of the
    cores, at most 4 (bench/RESULTS.md, host path: a front end costs more CPU per token than the
    control loop saves, so more processes than needed only spread the same work thinner)."""
    cores = cores or 1
    return 1 if cores < 8 else min(4, cores // 4)
