"""A node's identity on the network: its default id (``NodeConfig.name`` without ``--node-id``), unique
even where its address is not, and which addresses are its own."""

from __future__ import annotations

import secrets
import socket

INSTANCE = secrets.token_hex(3)
"""This process's random suffix of a made-up node id (drawn once: the id stays the same while it runs)."""

LOCAL_HOSTS = {"localhost", "0.0.0.0", "::", "::1", "ip6-localhost"}  # wildcard and loopback names
_NO_MACHINE = LOCAL_HOSTS | {""}


def default_node_id(host: str, port: int) -> str:
    """``host:port`` for an address that names this machine. A wildcard or loopback ``host`` names no
    machine: every node started with ``--host 0.0.0.0`` would be ``0.0.0.0:8000``, and two of them
    would overwrite one etcd key and evict each other's NIXL agents. For those, this machine's name,
    the port and :data:`INSTANCE` (``gpu-7:8000-3fa9c1``): two processes never share it, even on one
    machine behind one port (containers)."""
    if host.lower() in _NO_MACHINE or host.startswith("127."):
        return f"{socket.gethostname()}:{port}-{INSTANCE}"
    return f"{host}:{port}"


def is_host_port(text: str) -> bool:
    """Whether ``text`` is ``host:port`` with a port in [1, 65535]."""
    host, _, port = text.rpartition(":")
    return bool(host) and port.isdigit() and 1 <= int(port) <= 65535


def is_own_kv_address(addr: str, kv_port: int | None, hosts) -> bool:
    """Whether peer address ``addr`` (``host:port``, ``[v6]:port``) is a node's own KV listener: its
    ``kv_port`` on a loopback or wildcard host or on one of its ``hosts`` (``--kv-host``, ``--host``,
    ``--advertise-host``; None where not given). A node cannot be its own peer (it would reserve its own
    blocks twice)."""
    host, _, port = addr.strip().rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if kv_port is None or not port.isdigit() or int(port) != kv_port:
        return False
    own = LOCAL_HOSTS | {h for h in hosts if h}
    return host.lower() in own or host.startswith("127.")
