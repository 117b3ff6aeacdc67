"""The fork server's own preparation: importing this module is it (:data:`node.worker.engine_start.PRELOAD`
names it last, since importing modules is the only preparation ``multiprocessing``'s fork server runs).

Only the fork server imports it. It builds the CPU kernels, so each engine forked from the server finds
them built (:func:`node.worker.engine_preload.warm_cpu_kernels`), and it makes the server's own exit
immediate: the server exits when the node dies or stops, and an interpreter holding torch, Numba and
LLVM took 0.6 to 0.9 CPU-seconds to finalize (4 to 8 s of wall time on this project's loaded 2-core
machine; 0.2 s with this), while the node's engines wait for the server's exit to fire their
parent-death signal. The server has nothing to
clean up: its state is imported modules and its listening socket (an abstract address on Linux, no
file). The exit handler is the last one registered, so it runs first; the server's children never run
it (``multiprocessing``'s server ends each with ``os._exit``).
"""

from __future__ import annotations

import atexit
import os
import sys

from node.worker.engine_preload import warm_cpu_kernels


def _exit_now() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # closed or absent: nothing to flush
            pass
    os._exit(0)


warm_cpu_kernels()
atexit.register(_exit_now)
