"""One namespace for the hot-path operators: ``get_ops("torch")`` (the references, any device, the
test oracle), ``get_ops("cpu")`` (the CPU serving path, :mod:`shiftnode_kernels.cpu_ops`) or ``get_ops("triton")``
(the Triton kernels). :func:`resolve_backend` turns ``auto`` into one of them for a device type.

Importing this module is cheap and safe everywhere: Triton is only imported by ``get_ops("triton")``,
which raises :class:`RuntimeError` when the kernels cannot run (Triton missing, or neither a CUDA
device nor ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch

OP_NAMES = (
    "reshape_and_cache",
    "paged_attention",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "gather_kv_blocks",
    "scatter_kv_blocks",
)


@dataclass(frozen=True)
class KernelOps:
    """The seven operators of one backend; see :mod:`shiftnode_kernels.reference` for their contracts."""

    backend: str
    reshape_and_cache: Callable
    paged_attention: Callable
    rms_norm: Callable
    rotary_embedding: Callable
    silu_and_mul: Callable
    gather_kv_blocks: Callable
    scatter_kv_blocks: Callable


def triton_unavailable_reason() -> str | None:
    """None when the Triton kernels can run here, else why not (without importing Triton)."""
    interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if not interpret and not torch.cuda.is_available():
        return ("the Triton backend needs a CUDA device (or TRITON_INTERPRET=1 to run the kernels on "
                "CPU tensors with Triton's interpreter); use backend 'torch' on this machine")
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return "the Triton backend needs the 'triton' package, which is not installed"
    return None


BACKENDS = ("auto", "torch", "cpu", "triton")
"""The values of ``--attention-backend``."""


def resolve_backend(backend: str, device_type: str) -> str:
    """The concrete backend for ``backend`` on a device type (``"cuda"``, ``"cpu"``, ...): ``auto`` is
    ``triton`` on CUDA and ``cpu`` elsewhere; any other name is returned as it is.

    Raises:
        ValueError: ``backend`` is not one of :data:`BACKENDS`.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    if backend == "auto":
        return "triton" if device_type == "cuda" else "cpu"
    return backend


def get_ops(backend: str) -> KernelOps:
    """Return the operators of ``backend`` (``"torch"``, ``"cpu"`` or ``"triton"``; see
    :func:`resolve_backend` for ``auto``).

    Raises:
        ValueError: an unknown backend name. RuntimeError: the Triton kernels cannot run here.
    """
    if backend == "torch":
        from shiftnode_kernels import reference as mod
    elif backend == "cpu":
        from shiftnode_kernels import cpu_decode_numba, cpu_ops as mod

        cpu_decode_numba.available()  # compile (or load) the decode kernel now, not in the first step
    elif backend == "triton":
        reason = triton_unavailable_reason()
        if reason is not None:
            raise RuntimeError(reason)
        try:
            from shiftnode_kernels import triton_ops as mod
        except ImportError as exc:  # e.g. a Triton build that does not match this torch
            raise RuntimeError(f"cannot import the Triton kernels: {exc}") from exc
    else:
        raise ValueError(f"unknown kernel backend {backend!r}; expected 'torch', 'cpu' or 'triton'")
    return KernelOps(backend=backend, **{name: getattr(mod, name) for name in OP_NAMES})
