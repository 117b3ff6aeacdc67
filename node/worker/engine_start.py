"""How an engine process is started: forked from the node, spawned, or forked from a fork server.

Three ways, by what the starting process has done and which device the engine drives:

- ``"fork"``: ``shiftnode serve`` forks its CPU engines before the event loop starts
  (:func:`~node.worker.engine_group.prelaunch`): the node has imported torch and the engine's modules
  but has run no parallel torch work, so the child shares them at the cost of a fork.
- ``"forkserver"``: every other CPU engine (an engine restarted after its process died; the engines of
  a node created inside a process that has already computed, as tests do). A fork of such a process is
  unsafe (its OpenMP pool and threads do not survive a fork), so the engine is forked from a server
  process instead: Python's ``multiprocessing`` fork server, a fresh single-threaded interpreter that
  imports torch and the engine's modules (:data:`PRELOAD`) once and then only forks. One engine start
  then costs a fork instead of a new interpreter importing torch and the node (about 2 CPU-seconds).
  The server starts on the first such engine start (never for a ``shiftnode serve`` node whose engines
  never restart: starting it costs about as much as one spawn, so a node pays it only when it needs a
  second engine start) and lives as long as the process that started it. ``multiprocessing`` starts its
  resource tracker with it (a small interpreter without torch).
- ``"spawn"``: engines of CUDA devices (a fork after CUDA initialisation is unsafe, and the server
  would have to import the CUDA runtime for every device kind).

A forked-from-server engine is the server's child, not the node's, so the node's death must reach it
through the server: the engine drops its copy of the server's "alive" pipe (:func:`serve_forked`), so
the node is the only holder of the pipe's write end; when the node dies in any way the server reads
end-of-file and exits, and the engine's parent-death signal (set by
:func:`~node.worker.engine_main.engine_main` on the server) kills it. The engine checks at start that
the chain node → server → engine is intact (:func:`~node.worker.engine_main.parent_alive`). A server
killed on its own takes its engines with it: the node sees them die, and their restarts start a new
server (``multiprocessing`` starts one again when it finds the old one gone).

Process state. A spawned engine gets the node's environment and working directory at its start; a
forked-from-server one would get the server's, fixed when the server started, so :func:`serve_forked`
applies the node's (passed with the request) before the engine runs. Settings read when a module is
first imported (``SHIFTNODE_CPU_SAMPLER``, torch's own) are the server's, which are the node's at the
server's start. The engine's standard streams are the server's, which are the node's when the server
started (inside :func:`~node.log_native.stderr_uncaptured`, so descriptor 2 is the real one).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import threading
from typing import Any, Callable

# The modules an engine imports to load and serve, imported once by the fork server. Importing them runs
# no parallel work and starts no thread (tests/test_engine_start.py checks the server is one thread);
# node.worker.fork_server_init builds the kernels every CPU engine builds at its start.
PRELOAD = (
    "torch",
    "node.worker.engine_main",
    "node.worker.loader",
    "node.worker.cpu_threads",
    "node.log",
    "node.worker.fork_server_init",  # last: builds the CPU kernels; the server's exit is immediate
)

_preload_lock = threading.Lock()
_preload_set = False


def start_method(devices: list[str]) -> str:
    """How to start the engine of ``devices`` (one device or a tensor-parallel group's) in a process that
    may already have run parallel torch work: ``"forkserver"`` for CPU devices, ``"spawn"`` otherwise."""
    return "forkserver" if all(d.startswith("cpu") for d in devices) else "spawn"


def process_target(method: str, target: Callable, args: tuple) -> tuple[Callable, tuple]:
    """The ``(target, args)`` of a ``multiprocessing`` process that runs ``target(*args)`` started by
    ``method``: for ``"forkserver"``, :func:`serve_forked` with the node's environment and working
    directory in front (and the server's preload set, if the server has not started yet); as given
    otherwise."""
    if method != "forkserver":
        return target, args
    _set_preload()
    return serve_forked, (dict(os.environ), os.getcwd(), target, *args)


def _set_preload() -> None:
    """Name :data:`PRELOAD` as the fork server's imports, once per process (before the server starts:
    ``multiprocessing`` starts it on the first forkserver process's start). Not ``__main__``: a node's
    main module is the CLI or a test runner, which an engine does not need."""
    global _preload_set
    with _preload_lock:
        if not _preload_set:
            multiprocessing.forkserver.set_forkserver_preload(list(PRELOAD))
            _preload_set = True


def serve_forked(environ: dict[str, str], cwd: str, target: Callable, *args: Any) -> Any:
    """The body of a process forked by the fork server: close this process's copy of the server's alive
    pipe (so the server exits when the node dies: see the module docstring), take on the node's
    environment and working directory, then return ``target(*args)``."""
    server = multiprocessing.forkserver._forkserver
    alive = server._forkserver_alive_fd
    if alive is not None:
        server._forkserver_alive_fd = None
        os.close(alive)
    for name in set(os.environ) - set(environ):
        del os.environ[name]
    os.environ.update(environ)
    os.chdir(cwd)
    return target(*args)


def server_pid() -> int | None:
    """The pid of this process's fork server, None when none was started (for tests and tools)."""
    return multiprocessing.forkserver._forkserver._forkserver_pid
