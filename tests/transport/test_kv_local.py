"""In-node copy between two caches: equality, order, verification, layout checks, emulated link."""

from __future__ import annotations

import pytest
import torch

from node.transport import ChecksumMismatch, LayoutMismatch, copy_sequence_blocks
from node.transport.tensors import gather_layer, layer_from_bytes, layout_of, tensor_bytes
from node.transport.throttle import as_throttle
from transport_fakes import random_cache

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_local_copy_equals_source_layer_by_layer(dtype):
    src = random_cache(num_blocks=20, dtype=dtype, seed=7)
    dst = torch.zeros(4, 2, 12, 16, 2, 8, dtype=dtype)  # a smaller pool on the "other device"
    before = dst.clone()
    src_blocks, dst_blocks = [19, 0, 7, 3], [11, 2, 5, 6]
    seen = []
    report = copy_sequence_blocks(src, src_blocks, dst, dst_blocks, on_layer=seen.append)
    assert seen == [0, 1, 2, 3] and report.layer_end_s == sorted(report.layer_end_s)
    for layer in range(4):
        assert torch.equal(gather_layer(src, layer, src_blocks).view(torch.uint8),
                           gather_layer(dst, layer, dst_blocks).view(torch.uint8))
    untouched = [b for b in range(12) if b not in dst_blocks]
    assert torch.equal(dst[:, :, untouched], before[:, :, untouched])
    assert report.nbytes == 4 * layout_of(src, "m").layer_bytes(4)


def test_local_copy_verification_catches_corruption():
    src = random_cache(seed=8)
    dst = torch.zeros_like(src)

    def corrupt(layer, buf):
        if layer == 1:
            buf.view(-1)[5] += 1
        return buf

    seen = []
    with pytest.raises(ChecksumMismatch, match="layer 1"):
        copy_sequence_blocks(src, [1, 2], dst, [3, 4], on_layer=seen.append, fault_hook=corrupt)
    assert seen == [0]


def test_local_copy_refuses_mismatched_caches_and_bad_blocks():
    src = random_cache()
    with pytest.raises(LayoutMismatch) as ei:
        copy_sequence_blocks(src, [0], torch.zeros(4, 2, 8, 16, 2, 16, dtype=src.dtype), [0])
    assert ei.value.fields == ["head_dim"]
    with pytest.raises(LayoutMismatch, match="dtype"):
        copy_sequence_blocks(src, [0], torch.zeros_like(src, dtype=torch.float32), [0])
    dst = torch.zeros_like(src)
    with pytest.raises(ValueError, match="out of range"):
        copy_sequence_blocks(src, [0], dst, [32])
    with pytest.raises(ValueError, match="repeat"):
        copy_sequence_blocks(src, [0, 1], dst, [2, 2])
    with pytest.raises(ValueError, match="2 source blocks but 1"):
        copy_sequence_blocks(src, [0, 1], dst, [2])


def test_local_copy_link_throttle():
    """The copy is paced to the link: it takes about the line time at least, and its throttle asks for no more
    sleep than the line time in all. That upper bound is on the sleeps the throttle asked for, not on the
    wall time: on a loaded 2-core machine the copy's own gather and scatter took 0.8 s against 0.17 s of line
    time, which is the machine's load, not over-pacing."""
    src = torch.ones(4, 2, 48, 16, 8, 128, dtype=torch.float16)  # 64 KiB per block per layer
    dst = torch.zeros_like(src)
    blocks = list(range(40))  # 2.5 MiB per layer, 10 MiB in all: ~0.17 s at 0.5 Gb/s
    gbps = 0.5  # slow enough that the CPU gather/scatter (~0.2-0.3 GB/s on a busy 2-core box) never dominates
    link = as_throttle(gbps)  # the throttle a figure gets (with its sleep slack), delays counted
    delays = []
    take = link.take
    link.take = lambda nbytes: delays.append(take(nbytes)) or delays[-1]
    report = copy_sequence_blocks(src, blocks, dst, blocks[::-1], link_gbps=link, verify=False)
    expected_s = report.nbytes * 8 / (gbps * 1e9)
    assert report.nbytes == 40 * 4 * 65536 and len(delays) == 4
    assert 0.5 * expected_s < report.total_s, (report.total_s, expected_s)  # paced
    assert 0.5 * expected_s < sum(delays) <= expected_s + 1e-9, (delays, expected_s)  # never past the line time
    assert torch.equal(dst[:, :, blocks[::-1]], src[:, :, blocks])


def test_bytes_helpers_round_trip_bfloat16():
    kv = random_cache(dtype=torch.bfloat16, seed=9)
    layout = layout_of(kv, "m")
    buf = gather_layer(kv, 2, [5, 1])
    back = layer_from_bytes(bytearray(tensor_bytes(buf)), layout, 2)
    assert back.dtype == torch.bfloat16 and torch.equal(back, buf)
    with pytest.raises(ValueError, match="bytes"):
        layer_from_bytes(b"\0" * 10, layout, 2)


def test_host_caches_always_use_the_reference_ops():
    def device_only(*args):
        raise AssertionError("a device kernel was given host memory")

    src = random_cache(seed=10)
    dst = torch.zeros_like(src)
    copy_sequence_blocks(src, [0, 1], dst, [2, 3], gather=device_only, scatter=device_only)
    assert torch.equal(dst[:, :, [2, 3]], src[:, :, [0, 1]])
