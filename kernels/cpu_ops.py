"""The CPU serving implementations of the hot-path operators (backend ``cpu``), one name per function
of :mod:`kernels.reference` (same signatures, same semantics; the references stay the test oracle).

Only the operators where the CPU profile showed a cheap win differ from the references: paged
attention (:mod:`kernels.cpu_attention`). The others are the references themselves.
"""

from kernels.cpu_attention import paged_attention
from kernels.reference import (gather_kv_blocks, reshape_and_cache, rms_norm, rotary_embedding,
                               scatter_kv_blocks, silu_and_mul)

__all__ = [
    "reshape_and_cache",
    "paged_attention",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "gather_kv_blocks",
    "scatter_kv_blocks",
]
