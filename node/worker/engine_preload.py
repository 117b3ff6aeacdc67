"""What a process that forks CPU engines prepares once, so that each engine it forks finds it done:
the CPU kernels (:func:`warm_cpu_kernels`).

The fork server runs it before its first fork (:mod:`node.worker.fork_server_init`), and
``shiftnode serve`` before it forks two or more CPU engines
(:func:`~node.worker.engine_group.prelaunch`). Each engine would otherwise import Numba and LLVM and
load both kernels from Numba's disk cache on its own: about 0.4 CPU-seconds an engine, a start's
largest cost after the interpreter and torch. The kernels are serial machine code, built and run once
on a one-row input in the calling thread: no thread pool exists for a fork to break.
"""

from __future__ import annotations


def warm_cpu_kernels() -> None:
    """Build (or load from Numba's disk cache) and run once the CPU decode-attention and sampling
    kernels, as an engine's start does (:func:`shiftnode_kernels.ops.get_ops`, the model runner);
    where Numba is missing or has no writable cache folder the kernels record why and the engine
    takes its torch path, as it would have."""
    from shiftnode_kernels import cpu_decode_numba, cpu_sampling_numba

    cpu_decode_numba.available()
    cpu_sampling_numba.available()
