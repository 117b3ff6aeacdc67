"""A ``shiftnode serve`` subprocess for benchmarks: free port, health wait, always stopped.

``with NodeServer([...serve flags...], log_path=...) as node:`` starts ``python -m node.cli serve``
on a free loopback port and waits for ``GET /health`` (``repo``: run another checkout's ``node``
package, e.g. a ``git worktree`` of an older commit: ``python -m`` imports from the working directory
first; the child's ``PYTHONPATH`` is the checkout and its ``kernels`` folder, then the caller's, so an
uninstalled copy runs too); a node that exits first raises
:class:`NodeUnavailable` with the tail of its log (an unknown ``--mode`` ends that way), one that is
not healthy in ``startup_timeout_s`` seconds raises it too. Calling :meth:`NodeServer.start` again after the
process died (a ``kill -9``) starts it anew on the same port, its log appended to. Leaving the block terminates the process
(SIGTERM, then SIGKILL after ``stop_timeout_s``). Stdlib only (``urllib``), so it needs no event loop.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

__all__ = ["NodeUnavailable", "NodeServer", "free_port"]

REPO = Path(__file__).resolve().parents[2]


class NodeUnavailable(RuntimeError):
    """The node did not come up (it exited, or never answered ``/health``)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class NodeServer:
    """One node process. ``url`` is its base URL; ``get_json``/``get_text`` read its routes. Its steps run
    eagerly unless ``serve_args`` name ``--compile`` (``--compile none`` is added otherwise)."""

    def __init__(self, serve_args: list[str], *, log_path: str | Path, env: dict[str, str] | None = None,
                 startup_timeout_s: float = 180.0, stop_timeout_s: float = 10.0, repo: str | Path | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        if not any(a == "--compile" or a.startswith("--compile=") for a in serve_args):
            # eager unless the run asks, whatever --compile's default (node.cli.DEFAULT_COMPILE) becomes: a run
            # of the policy or the host path must not measure steps changing speed, and a compile beside them
            serve_args = [*serve_args, "--compile", "none"]
        self.cmd = [sys.executable, "-m", "node.cli", "serve", "--port", str(self.port), *serve_args]
        self.repo = Path(repo) if repo is not None else REPO  # the checkout whose ``node`` package runs (the cwd)
        self.log_path = Path(log_path)
        self.env = {**os.environ, **(env or {})}
        # the checkout's own packages first (``node`` and ``kernels/shiftnode_kernels``; not pip-installed where
        # the project runs from a copy), then the caller's path (wheels installed elsewhere, e.g. /tmp/site)
        path = [str(self.repo), str(self.repo / "kernels")] + [p for p in self.env.get("PYTHONPATH", "").split(os.pathsep) if p]
        self.env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(path))
        self.startup_timeout_s = startup_timeout_s
        self.startup_s: float | None = None  # seconds from the launch to the first healthy answer
        self.stop_timeout_s = stop_timeout_s
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "NodeServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # a restart (start after a kill, on the same port) appends: the log keeps the first life's lines
        with open(self.log_path, "a" if self.proc is not None else "w") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, cwd=self.repo, env=self.env)
        t0 = time.monotonic()
        deadline = t0 + self.startup_timeout_s
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise NodeUnavailable(f"node exited with {self.proc.returncode}: {self.log_tail(1)}")
                try:
                    if self.get_text("/health", timeout_s=2):
                        self.startup_s = time.monotonic() - t0
                        return
                except (OSError, urllib.error.URLError):
                    time.sleep(0.25)
            raise NodeUnavailable(f"node not healthy after {self.startup_timeout_s:.0f} s: {self.log_tail()}")
        except BaseException:
            self.stop()
            raise

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def log_tail(self, lines: int = 5) -> str:
        try:
            text = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return " | ".join(text[-lines:])

    def get_text(self, path: str, timeout_s: float = 10.0) -> str:
        with urllib.request.urlopen(self.url + path, timeout=timeout_s) as r:
            return r.read().decode()

    def get_json(self, path: str, timeout_s: float = 10.0) -> dict:
        return json.loads(self.get_text(path, timeout_s))

    def wait_compiled(self, timeout_s: float = 900.0) -> float:
        """Wait until no device's buckets are still compiling in the background (``GET /v1/node``'s
        ``compile.state``; a node that reports no such field, an older checkout, has compiled at start-up
        or not at all); the seconds waited, also added to :attr:`startup_s`.

        Raises:
            NodeUnavailable: still compiling after ``timeout_s``.
        """
        t0 = time.monotonic()
        while any((d.get("compile") or {}).get("state") == "compiling" for d in self.get_json("/v1/node")["devices"]):
            if time.monotonic() - t0 > timeout_s:
                raise NodeUnavailable(f"buckets still compiling after {timeout_s:.0f} s: {self.log_tail()}")
            time.sleep(0.5)
        waited = time.monotonic() - t0
        if self.startup_s is not None:
            self.startup_s += waited
        return waited

    def wait_idle(self, timeout_s: float = 60.0) -> bool:
        """Wait until no device holds KV blocks or sequences and nothing is queued; False on timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            st = self.get_json("/v1/node")
            if st.get("queue_depth", 0) == 0 and all(
                    d["kv_blocks_used"] == 0 and d["running"] == 0 and d["waiting"] == 0 for d in st["devices"]):
                return True
            time.sleep(0.1)
        return False
