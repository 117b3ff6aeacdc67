"""Compiling the forward's buckets in the background while the engine serves eager steps.

Compiling stories260k's nine default buckets takes minutes on a small CPU (issue 46); compiled at
start-up, the node answered nothing meanwhile. Here an engine serves as soon as its model is loaded,
eagerly, and one thread of the engine process compiles the buckets (:meth:`CompiledForward.warm`) in
ascending order; each bucket's steps run compiled from the step after it is ready, the others stay eager.

The compile must not take the cores or the interpreter from the steps:

* **It runs between steps.** :class:`StepGate` marks the runner's steps; the compile thread's profile
  hook (``sys.setprofile``, set on that thread only) parks it at its next Python call while a step runs,
  so the step never waits for the GIL behind it, and it resumes when the step ends. Inductor's C++
  compiler runs as a child process, which the gate cannot park: it runs at the lowest CPU priority
  (``nice`` 19, through a wrapper of the compiler, :func:`nice_compiler`), so the scheduler gives the
  step and the node's loop their cores first. The thread itself keeps the normal priority: a thread
  at ``nice`` 19 that holds the GIL when a step arrives is the one the step waits for, and on a loaded
  machine such a thread waits long for a core (measured: one stream's ITL p50 23-25 ms against 4-8 ms
  eager, at a load average of 20, while a niced thread loaded a warm bucket).
* **One compile at a time.** Inductor's parallel compile workers are limited to one
  (``torch._inductor.config.compile_threads``), and engines that share a cache directory take turns
  per bucket (:func:`node.worker.compile_cache.compile_lock`).
* **The step thread never compiles.** While buckets are pending, steps call their graphs in dynamo's
  run-only mode (:meth:`CompiledForward.run`), which looks graphs up but never traces, and writes no
  process-wide compile setting the compile thread reads.
* The interpreter's switch interval is lowered while the thread lives (:data:`SWITCH_INTERVAL_S`): a step
  arriving while the thread holds the GIL gets it within that time instead of CPython's 5 ms.

Progress is a :class:`CompileState`: the engine sends it to the node with the next step's reply when it
changed (and at start, in ``Ready``); the node shows it in ``GET /v1/node`` and tells the cost model's
refit (:mod:`node.runtime.compile_watch`).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import sys
import threading
import time
from typing import Iterator

import msgspec
import structlog

from node.worker.compile_cache import compile_lock
from node.worker.compiled_forward import CompiledForward

log = structlog.get_logger("shiftnode.background_compile")

SWITCH_INTERVAL_S = 1e-4
"""``sys.setswitchinterval`` while a background compile runs (CPython's default is 5 ms): the longest a
step that starts while the compile thread holds the GIL waits for it."""

MAX_PARK_S = 0.5
"""The longest the compile thread parks at once while a step runs. It then goes on for a moment: a step
blocked on something the parked thread holds (an import lock, say) cannot wait for it forever."""

COMPILE_NICE = 19
"""The ``nice`` value of inductor's C++ compiler processes: the lowest CPU priority."""


class CompileState(msgspec.Struct, omit_defaults=True):
    """An engine's compiled buckets (``GET /v1/node``'s ``compile``).

    Attributes:
        state: ``compiling`` (buckets pending), ``done`` (every bucket compiled, or failed), ``failed``
            (none compiled; ``error`` says why).
        buckets: every token-count bucket, ascending.
        compiled: those whose steps run compiled now.
        failed: those whose compilation failed (their steps stay eager).
        error: the first failure's message.
        background: compiled while serving (False: at start-up, before the engine was ready).
        bucket_ms: each compiled bucket's compile (or cache load) time, ms.
        cache_dir: the inductor cache directory (:mod:`node.worker.compile_cache`), None: inductor's default.
    """

    state: str
    buckets: list[int]
    compiled: list[int] = []
    failed: list[int] = []
    error: str | None = None
    background: bool = False
    bucket_ms: dict[int, float] = {}
    cache_dir: str | None = None

    @property
    def pending(self) -> list[int]:
        """The buckets not compiled and not failed yet."""
        return [b for b in self.buckets if b not in self.compiled and b not in self.failed]


class StepGate:
    """Tells a background thread when a step runs, and parks it then (module doc).

    The runner wraps each step in :meth:`step`; the compile thread installs :meth:`install` on itself.
    Without a thread installed it costs two attribute writes per step."""

    def __init__(self, max_park_s: float = MAX_PARK_S):
        self.max_park_s = max_park_s
        self._busy = False
        self._idle = threading.Event()
        self._idle.set()
        self.parked_s = 0.0  # the compile thread's time parked behind steps (s)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Mark a step from entry to exit (steps are one at a time: the runner's lock)."""
        self._idle.clear()
        self._busy = True
        try:
            yield
        finally:
            self._busy = False
            self._idle.set()

    def _park(self, frame, event, arg) -> None:  # noqa: ARG002 - sys.setprofile's signature
        if self._busy:
            t0 = time.perf_counter()
            self._idle.wait(self.max_park_s)
            self.parked_s += time.perf_counter() - t0

    def install(self) -> None:
        """Park the calling thread at its Python calls while a step runs (``sys.setprofile`` on it alone)."""
        sys.setprofile(self._park)

    @staticmethod
    def uninstall() -> None:
        sys.setprofile(None)


def nice_compiler(folder: str | None) -> str | None:
    """A script in ``folder`` that runs inductor's C++ compiler (``$CXX``, else ``g++``) at
    :data:`COMPILE_NICE`, for ``torch._inductor.config.cpp.cxx`` (named ``nice-g++``: inductor tells gcc
    from clang by the name); None (the compiler as it is) without a folder, ``nice`` or the compiler.

    Raises:
        OSError: the script cannot be written.
    """
    compiler, nice = shutil.which(os.environ.get("CXX", "g++")), shutil.which("nice")
    if folder is None or compiler is None or nice is None:
        return None
    path = os.path.join(folder, "nice-g++")
    text = f'#!/bin/sh\nexec {shlex.quote(nice)} -n {COMPILE_NICE} {shlex.quote(compiler)} "$@"\n'
    try:
        with open(path) as f:
            if f.read() == text:
                return path
    except OSError:
        pass
    tmp = f"{path}.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o755)
    os.replace(tmp, path)
    return path


def _configure_inductor(folder: str | None) -> None:
    """One compile worker (no parallel compile processes), and the compiler at the lowest priority."""
    import torch._inductor.config as inductor_config

    inductor_config.compile_threads = 1
    try:
        wrapper = nice_compiler(folder)
    except OSError as e:
        log.warning("nice_compiler_unavailable", error=str(e))
        wrapper = None
    if wrapper is not None:
        inductor_config.cpp.cxx = (wrapper,)


class BackgroundCompile:
    """One thread compiling a runner's buckets in ascending order while the engine serves.

    Args:
        runner: the :class:`~node.worker.runner.ModelRunner` (its ``model``, ``kv_cache``, ``gate`` and step
            lock); the thread builds its :class:`CompiledForward` (``runner.compiled``, None until then:
            importing dynamo and inductor takes seconds, which the engine's start does not wait for), then
            compiles each bucket (:meth:`CompiledForward.warm`); the steps use run-only lookups until
            :meth:`CompiledForward.settle` at the end.
        sizes: the buckets (ascending).
        options: inductor options.
        device_id: for the logs.
        cache_dir: the inductor cache directory in use (:func:`node.worker.compile_cache.use_cache_dir`), for
            the state; None: inductor's default.
        lock_root: the ``--compile-cache-dir`` whose lock the thread holds per bucket
            (:func:`node.worker.compile_cache.compile_lock`); None: no lock.

    :meth:`take_update` gives the :class:`CompileState` once each time it changed (the engine's next
    reply carries it); :meth:`state` always gives it.
    """

    def __init__(self, runner, sizes: tuple[int, ...], options: dict, device_id: str, cache_dir: str | None = None,
                 lock_root: str | None = None):
        self.runner = runner
        self.sizes = tuple(sizes)
        self.options = options
        self.device_id = device_id
        self.cache_dir = cache_dir
        self.lock_root = lock_root
        self.compiled: CompiledForward | None = None
        self.failed: dict[int, str] = {}
        self._changed = False
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self.started_s: float | None = None
        self.finished_s: float | None = None

    def start(self) -> None:
        """Start the thread (once); returns at once."""
        if self._thread is not None:
            return
        self.started_s = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=f"compile-{self.device_id}", daemon=True)
        self._thread.start()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until every bucket is compiled or failed; whether it finished within ``timeout_s``."""
        return self._done.wait(timeout_s)

    def state(self) -> CompileState:
        """The buckets' state now."""
        c = self.compiled
        ready = list(c.ready_sizes) if c is not None else []
        failed = sorted(self.failed)
        if self.done:
            state = "failed" if failed and not ready else "done"
        else:
            state = "compiling"
        ms = {t: round(v, 1) for t, v in c.compile_ms_by_size.items()} if c is not None else {}
        return CompileState(state, list(self.sizes), ready, failed, next(iter(self.failed.values()), None), True, ms,
                            self.cache_dir)

    def take_update(self) -> CompileState | None:
        """:meth:`state` if a bucket finished (or failed) since the last call, else None."""
        if not self._changed:
            return None
        self._changed = False
        return self.state()

    def _build(self) -> CompiledForward:
        """The runner's compiled forward, its buckets not compiled yet. The imports (seconds) run first,
        parked behind steps; the forward itself is made under the runner's step lock (it rebuilds the
        model's weight views: not beside a step), which then takes milliseconds."""
        import torch._dynamo  # noqa: F401 - the slow part, before the lock
        import torch._inductor.compile_fx  # noqa: F401

        r = self.runner
        with r._lock:
            compiled = CompiledForward(r.model, r.kv_cache, self.sizes, options=self.options, settled=False)
            r.compiled = compiled
        return compiled

    def _run(self) -> None:
        _configure_inductor(self.lock_root)
        old_interval = sys.getswitchinterval()
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        self.runner.gate.install()
        try:
            try:
                self.compiled = self._build()
            except Exception as e:  # noqa: BLE001 - no compiled forward: every step stays eager
                self.failed = {t: f"{type(e).__name__}: {e}"[:500] for t in self.sizes}
                log.warning("compile_failed", device=self.device_id, error=self.failed[self.sizes[0]])
                return
            for size in self.sizes:
                try:
                    with compile_lock(self.lock_root):
                        ms = self.compiled.warm(size)
                except Exception as e:  # noqa: BLE001 - a bucket that fails to compile stays eager
                    self.failed[size] = f"{type(e).__name__}: {e}"[:500]
                    log.warning("bucket_compile_failed", device=self.device_id, bucket=size, error=self.failed[size])
                else:
                    log.info("bucket_compiled", device=self.device_id, bucket=size, ms=round(ms),
                             parked_ms=round(self.runner.gate.parked_s * 1e3))
                self._changed = True
        finally:
            self.runner.gate.uninstall()
            sys.setswitchinterval(old_interval)
            if self.compiled is not None:
                self.compiled.settle()
            self.finished_s = time.monotonic()
            self._changed = True
            self._done.set()
        log.info("forward_compiled", device=self.device_id, background=True, sizes=list(self.compiled.ready_sizes),
                 failed=sorted(self.failed), s=round(self.finished_s - self.started_s, 1),
                 parked_s=round(self.runner.gate.parked_s, 2), cache_dir=self.cache_dir)


def compile_state(runner) -> CompileState | None:
    """A :class:`~node.worker.runner.ModelRunner`'s compiled buckets now: its background compile's state,
    else those compiled at start-up (``done``; ``failed`` with the reason where the compile failed on
    CUDA), else None (steps run eagerly: ``--compile none``, or compiling does not apply)."""
    if runner.background is not None:
        return runner.background.state()
    c = runner.compiled
    if c is not None:
        return CompileState("done", list(c.sizes), list(c.ready_sizes),
                            bucket_ms={t: round(v, 1) for t, v in c.compile_ms_by_size.items()})
    if runner.compiled_error is not None:
        return CompileState("failed", [], error=runner.compiled_error)
    return None
