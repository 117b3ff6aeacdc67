"""Binding the node's listening ports once before anything loads, so a taken port is told in a second."""

from __future__ import annotations

import errno
import socket

from node.config import ConfigError


def check_bindable(host: str, port: int, flag: str) -> None:
    """Bind (and release) every address of ``host:port`` as aiohttp will, before the model loads.

    Sockets get ``SO_REUSEADDR`` as asyncio's servers do, so a port in TIME_WAIT passes and one that
    another process listens on fails here, in a second, not after minutes of loading.

    Raises:
        ConfigError: naming the address, the flag and the OS's reason.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ConfigError(f"--host {host!r} does not resolve: {e.strerror}") from e
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                s.bind(addr)
            except OSError as e:
                where = f"[{addr[0]}]:{addr[1]}" if family == socket.AF_INET6 else f"{addr[0]}:{addr[1]}"
                hint = " (is another node running? choose another " + flag + ")" if e.errno == errno.EADDRINUSE else ""
                raise ConfigError(f"{flag} {port}: cannot bind {where}: {e.strerror}{hint}") from e
