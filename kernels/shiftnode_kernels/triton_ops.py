"""The Triton implementations of the hot-path operators, one name per function of
:mod:`shiftnode_kernels.reference` (same signatures, same semantics).

Importing this module imports Triton and defines the kernels; use :func:`shiftnode_kernels.ops.get_ops`, which
checks first that they can run (a CUDA device, or ``TRITON_INTERPRET=1`` for CPU tensors).
Note: Triton decides between compiling and interpreting when a kernel is *defined*, so set
``TRITON_INTERPRET`` before this module is first imported.
"""

from shiftnode_kernels.activation import silu_and_mul
from shiftnode_kernels.attention import paged_attention
from shiftnode_kernels.cache import reshape_and_cache
from shiftnode_kernels.kv_transfer import gather_kv_blocks, scatter_kv_blocks
from shiftnode_kernels.norm import rms_norm
from shiftnode_kernels.rotary import rotary_embedding

__all__ = [
    "reshape_and_cache",
    "paged_attention",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "gather_kv_blocks",
    "scatter_kv_blocks",
]
