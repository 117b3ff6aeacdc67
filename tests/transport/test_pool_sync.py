"""Every node-side writer into an engine's KV pool ends with the pool fence
(:func:`node.transport.pool_sync.sync_pool_writes`), after its write and before it announces the
layer (issue 33, item 1). On the CPU the fence itself does nothing, so it is replaced here by a recorder;
``test_pool_sync_cuda.py`` checks it on a GPU."""

from __future__ import annotations

import pytest
import torch

import node.transport.pool_sync as pool_sync
from node.transport.local import copy_sequence_blocks, copy_sharded_blocks
from node.transport.tensors import gather_layer, scatter_layer_bytes, tensor_bytes
from transport_fakes import random_cache

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here


@pytest.fixture
def fences(monkeypatch):
    """Each call of the fence: (storage of the pool it fenced, a copy of that pool as it was then)."""
    calls = []
    monkeypatch.setattr(pool_sync, "sync_pool_writes",
                        lambda pool: calls.append((pool.untyped_storage().data_ptr(), pool.clone())))
    return calls


def test_a_received_layer_is_fenced_once_written(fences):
    src = random_cache(num_layers=3, num_blocks=8)
    dst = torch.zeros_like(src)
    for layer in range(3):
        payload = bytearray(tensor_bytes(gather_layer(src, layer, [1, 2, 5])))
        scatter_layer_bytes(payload, _layout(src), dst, layer, [0, 3, 4])
        ptr, seen = fences[-1]
        assert len(fences) == layer + 1 and ptr == dst.untyped_storage().data_ptr()
        assert torch.equal(gather_layer(seen, layer, [0, 3, 4]), gather_layer(src, layer, [1, 2, 5]))  # written first


@pytest.mark.parametrize("verify", [False, True])
def test_an_in_node_copy_fences_every_layer_before_announcing_it(fences, verify):
    src = random_cache(num_layers=4, num_blocks=8)
    dst = torch.zeros_like(src)
    announced = []
    copy_sequence_blocks(src, [1, 2], dst, [6, 7], verify=verify, on_layer=lambda layer: announced.append(len(fences)))
    assert announced == [1, 2, 3, 4]  # layer l's fence came before layer l was announced
    assert all(ptr == dst.untyped_storage().data_ptr() for ptr, _ in fences)
    for layer, (_, seen) in enumerate(fences):
        assert torch.equal(gather_layer(seen, layer, [6, 7]), gather_layer(src, layer, [1, 2]))


def test_a_resharding_copy_fences_every_destination_rank(fences):
    src = random_cache(num_layers=2, num_blocks=8, heads=4)
    src_pools = [src[..., :2, :].clone(), src[..., 2:, :].clone()]  # a group of two ranks, two heads each
    dst = torch.zeros_like(src)  # one device holding all four heads
    copy_sharded_blocks(src_pools, [0, 3], [dst], [5, 1], verify=False)
    assert len(fences) == 2 * 2 and {ptr for ptr, _ in fences} == {dst.untyped_storage().data_ptr()}
    assert torch.equal(gather_layer(dst, 1, [5, 1]), gather_layer(src, 1, [0, 3]))


def _layout(kv):
    from node.transport.tensors import layout_of

    return layout_of(kv, "m")
