"""Small helpers shared by the Triton launchers (no Triton import here).

``POISON`` is a debugging hook: when it is a float (tests set ``float("nan")``), every output buffer a
launcher allocates is filled with it first, so an element a kernel forgets to write shows up as NaN
instead of as whatever ``torch.empty`` happened to return.
"""

from __future__ import annotations

import os

import torch

POISON: float | None = None


def new_empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty`` for kernel outputs, filled with :data:`POISON` when that is set."""
    out = torch.empty(shape, dtype=dtype, device=device)
    if POISON is not None:
        out.fill_(POISON)
    return out


def next_pow2(n: int) -> int:
    """Smallest power of two >= ``max(n, 1)`` (Triton tile sizes must be powers of two)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def interpreting() -> bool:
    """True when Triton runs kernels with its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_SM_COUNT: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors on ``device`` (a fixed 16 under the interpreter or on the CPU)."""
    if device.type != "cuda":
        return 16
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]
