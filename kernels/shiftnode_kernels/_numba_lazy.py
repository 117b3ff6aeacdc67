"""A Numba kernel built on first use, once, whichever thread asks first (the CPU kernels' loader)."""

from __future__ import annotations

import threading
from typing import Any, Callable


class LazyKernel:
    """Builds ``build()`` (which imports Numba and returns the compiled function) on the first
    :meth:`get`, then calls ``warm(kernel)`` once (a tiny run, so compiling or loading the disk cache
    happens now and not in a serving step). When Numba is missing, or finds no writable cache folder
    (``RuntimeError`` from ``cache=True``), :meth:`get` returns None from then on and ``error`` says why:
    the caller takes its torch path."""

    def __init__(self, build: Callable[[], Callable], warm: Callable[[Callable], Any]):
        self._build, self._warm = build, warm
        self._lock = threading.Lock()
        self.kernel: Callable | None = None
        self.error: str | None = None

    def get(self) -> Callable | None:
        if self.kernel is None and self.error is None:
            with self._lock:
                if self.kernel is None and self.error is None:
                    try:
                        kernel = self._build()
                    except (ImportError, RuntimeError) as e:  # no Numba, or no writable cache folder
                        self.error = str(e)
                        return None
                    self._warm(kernel)
                    self.kernel = kernel
        return self.kernel
