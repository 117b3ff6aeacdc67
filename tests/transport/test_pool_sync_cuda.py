"""On a GPU, a node-side write into a KV pool is complete when its writer returns, so an engine reading
the pool on its own stream sees it (issue 33, item 1; skipped without CUDA, run by ``scripts/gpu_check``).

The engine is stood in for by a second CUDA stream of this process that reads the destination blocks
right after the writer returned, without waiting on the writer's stream: only the writer's fence
(:func:`node.transport.pool_sync.sync_pool_writes`) orders the two.
"""

from __future__ import annotations

import pytest
import torch

from node.transport.local import copy_sequence_blocks
from node.transport.tensors import gather_layer, layout_of, scatter_layer_bytes, tensor_bytes
from transport_fakes import random_cache

# the quick tier (bash scripts/test --quick) runs every test here (on a GPU machine; elsewhere they skip)
pytestmark = [pytest.mark.quick, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _engine_reads(dst: torch.Tensor, layer: int, blocks: list[int]) -> torch.Tensor:
    """The blocks as a reader on another stream sees them right now (not ordered after our stream)."""
    other = torch.cuda.Stream(device=dst.device)
    with torch.cuda.stream(other):
        ids = torch.tensor(blocks, dtype=torch.long, device=dst.device)
        seen = dst[layer].index_select(1, ids).clone()
    other.synchronize()
    return seen


def test_the_writers_fence_with_a_device_synchronize(monkeypatch):
    calls = []
    real = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: (calls.append(torch.device(device)), real(device)))
    src = random_cache(num_layers=2, num_blocks=8).cuda()
    dst = torch.zeros_like(src)
    copy_sequence_blocks(src, [1, 2], dst, [3, 4], verify=False)
    payload = bytearray(tensor_bytes(gather_layer(src, 0, [5])))
    scatter_layer_bytes(payload, layout_of(src, "m"), dst, 0, [6])
    assert calls == [dst.device] * 3  # two copied layers, one received layer


def test_another_stream_sees_an_in_node_copy_as_soon_as_it_returns():
    # 32 layers x 256 blocks of 64 KiB: 512 MiB, long enough that an unfenced reader would overtake it
    src = random_cache(num_layers=32, num_blocks=512, block_size=16, heads=8, head_dim=128,
                       dtype=torch.bfloat16).cuda()
    dst = torch.zeros_like(src)
    src_blocks, dst_blocks = list(range(0, 512, 2)), list(range(1, 512, 2))
    copy_sequence_blocks(src, src_blocks, dst, dst_blocks, verify=False)
    last = src.shape[0] - 1  # written last: the one a race would catch
    want = src[last].index_select(1, torch.tensor(src_blocks, device=src.device))
    assert torch.equal(_engine_reads(dst, last, dst_blocks).view(torch.uint8), want.view(torch.uint8))


def test_another_stream_sees_a_received_layer_as_soon_as_it_is_scattered():
    src = random_cache(num_layers=1, num_blocks=1024, block_size=16, heads=8, head_dim=128, dtype=torch.bfloat16)
    dst = torch.zeros_like(src).cuda()
    blocks = list(range(1024))
    payload = bytearray(tensor_bytes(gather_layer(src, 0, blocks)))  # 128 MiB from host memory
    scatter_layer_bytes(payload, layout_of(src, "m"), dst, 0, blocks)
    assert torch.equal(_engine_reads(dst, 0, blocks).cpu().view(torch.uint8), src[0].view(torch.uint8))
