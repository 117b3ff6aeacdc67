"""A node's default id (``NodeConfig.name`` without ``--node-id``): unique even where its address is not."""

from __future__ import annotations

import secrets
import socket

INSTANCE = secrets.token_hex(3)
"""This process's random suffix of a made-up node id (drawn once: the id stays the same while it runs)."""

_NO_MACHINE = {"", "0.0.0.0", "::", "::1", "localhost", "ip6-localhost"}


def default_node_id(host: str, port: int) -> str:
    """``host:port`` for an address that names this machine. A wildcard or loopback ``host`` names no
    machine: every node started with ``--host 0.0.0.0`` would be ``0.0.0.0:8000``, and two of them
    would overwrite one etcd key and evict each other's NIXL agents. For those, this machine's name,
    the port and :data:`INSTANCE` (``gpu-7:8000-3fa9c1``): two processes never share it, even on one
    machine behind one port (containers)."""
    if host.lower() in _NO_MACHINE or host.startswith("127."):
        return f"{socket.gethostname()}:{port}-{INSTANCE}"
    return f"{host}:{port}"
