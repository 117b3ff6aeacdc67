"""A throwaway single-member etcd on free loopback ports, for tests and benchmarks.

``with EtcdServer() as etcd:`` starts Debian's ``etcd`` binary (package ``etcd-server``) with a fresh
data folder, waits for its ``/health``, yields, then kills it and removes the folder. ``etcd.url`` is
the client URL to pass as ``--etcd``. :meth:`EtcdServer.restart` kills it with ``kill -9`` and starts it again
on the same ports and data folder (a crashed etcd coming back: its keys and leases are still there). Stdlib only.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from bench.load.node_process import free_port


class EtcdMissing(RuntimeError):
    """No ``etcd`` binary on the PATH (``apt-get install etcd-server``; ``scripts/setup`` does it as root)."""


class EtcdServer:
    """One etcd process. Raises :class:`EtcdMissing`, or RuntimeError when it does not become healthy
    within ``startup_timeout_s`` (with its log)."""

    def __init__(self, startup_timeout_s: float = 20.0):
        self.binary = shutil.which("etcd")
        if self.binary is None:
            raise EtcdMissing("etcd is not installed (apt-get install etcd-server, or run scripts/setup as root)")
        self.startup_timeout_s = startup_timeout_s
        self.url = ""
        self._peer_url = ""
        self.proc: subprocess.Popen | None = None
        self.data: Path | None = None

    def __enter__(self) -> "EtcdServer":
        client, peer = free_port(), free_port()
        self.url = f"http://127.0.0.1:{client}"
        self._peer_url = f"http://127.0.0.1:{peer}"
        self.data = Path(tempfile.mkdtemp(prefix="etcd-"))
        self._launch()
        return self

    def restart(self, down_s: float = 0.0) -> None:
        """``kill -9`` the server, wait ``down_s`` seconds, and start it again on the same ports and data
        folder; returns once it is healthy. Raises RuntimeError as the start does."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        time.sleep(down_s)
        self._launch()

    def _launch(self) -> None:
        """Start the binary on ``self.url`` and wait for ``/health`` (its log is appended to)."""
        with open(self.data / "log", "a") as log:
            self.proc = subprocess.Popen(
                [self.binary, "--name", "t", "--data-dir", str(self.data / "d"), "--listen-client-urls", self.url,
                 "--advertise-client-urls", self.url, "--listen-peer-urls", self._peer_url,
                 "--initial-advertise-peer-urls", self._peer_url, "--initial-cluster", f"t={self._peer_url}"],
                stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if json.load(r).get("health") == "true":
                        return
            except (OSError, urllib.error.URLError, ValueError):
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                log_text = (self.data / "log").read_text()[-2000:]
                self.__exit__()
                raise RuntimeError(f"etcd did not start: {log_text}")
            time.sleep(0.1)

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.data is not None:
            shutil.rmtree(self.data, ignore_errors=True)
