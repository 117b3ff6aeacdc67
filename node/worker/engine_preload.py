"""What a process that forks CPU engines prepares once, so that each engine it forks finds it done.

Importing this module builds the CPU engine's Numba kernels (:func:`warm_cpu_kernels`): the fork
server imports it (last in :data:`node.worker.engine_start.PRELOAD`; a module import is the only
preparation ``multiprocessing``'s fork server runs), and ``shiftnode serve`` calls
:func:`warm_cpu_kernels` before it forks two or more CPU engines
(:func:`~node.worker.engine_group.prelaunch`). Each engine would otherwise import Numba and LLVM and
load both kernels from Numba's disk cache on its own: about 0.4 CPU-seconds an engine, a start's
largest cost after the interpreter and torch. The kernels are serial machine code, built and run
once on a one-row input in this one thread: no thread pool exists for a fork to break.
"""

from __future__ import annotations

from shiftnode_kernels import cpu_decode_numba, cpu_sampling_numba


def warm_cpu_kernels() -> None:
    """Build (or load from Numba's disk cache) and run once the CPU decode-attention and sampling
    kernels, as an engine's start does (:func:`shiftnode_kernels.ops.get_ops`, the model runner);
    where Numba is missing or has no writable cache folder the kernels record why and the engine
    takes its torch path, as it would have."""
    cpu_decode_numba.available()
    cpu_sampling_numba.available()


warm_cpu_kernels()
