"""CUDA paths of the transfer (skipped without a GPU): device-to-device copy with the reference and
Triton ops, host↔device payloads over TCP."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import torch

from node.transport import KVClient, copy_sequence_blocks
from node.transport.tensors import gather_layer
from transport_fakes import HOST, SECRET, FakeReceiver, make_seq, random_cache, run

# the quick tier (bash scripts/test --quick) runs every test here (on a GPU machine; elsewhere they skip)
pytestmark = [pytest.mark.quick, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def same_blocks(a, a_blocks, b, b_blocks):
    return all(torch.equal(gather_layer(a, l, a_blocks).cpu().view(torch.uint8),
                           gather_layer(b, l, b_blocks).cpu().view(torch.uint8)) for l in range(a.shape[0]))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cuda_local_copy(backend):
    from shiftnode_kernels.ops import get_ops
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("Triton interpreter on 512 MiB would take minutes: run with TRITON_INTERPRET=0")
    ops = get_ops(backend)
    src = random_cache(num_layers=32, num_blocks=512, block_size=16, heads=8, head_dim=128,
                       dtype=torch.bfloat16).cuda()  # 64 KiB per block per layer
    dst = torch.zeros_like(src)
    src_blocks = torch.randperm(512)[:256].tolist()  # a 4096-token sequence: 16 MiB per layer, 512 MiB
    dst_blocks = torch.randperm(512)[:256].tolist()
    kw = dict(gather=ops.gather_kv_blocks, scatter=ops.scatter_kv_blocks)
    copy_sequence_blocks(src, src_blocks, dst, dst_blocks, **kw)  # warm-up (Triton compile)
    torch.cuda.synchronize()
    for verify in (True, False):
        t0 = time.perf_counter()
        report = copy_sequence_blocks(src, src_blocks, dst, dst_blocks, verify=verify, **kw)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        print(f"{backend} verify={verify}: {report.nbytes / 2**20:.0f} MiB in {dt * 1e3:.2f} ms "
              f"= {report.nbytes / dt / 1e9:.1f} GB/s")
    assert same_blocks(src, src_blocks, dst, dst_blocks)
    # host cache → device cache (different devices), throttled
    host = src.cpu()
    dst.zero_()
    report = copy_sequence_blocks(host, src_blocks[:8], dst, dst_blocks[:8], link_gbps=2.0, **kw)
    expected = report.nbytes * 8 / 2e9  # 16 MiB: 67 ms, longer than the host gather + copy
    assert same_blocks(src, src_blocks[:8], dst, dst_blocks[:8])
    assert 0.5 * expected < report.total_s < 3 * expected


def test_cuda_tcp_round_trip():
    async def main():
        src = random_cache(num_layers=8, num_blocks=64, block_size=16, heads=8, head_dim=128,
                           dtype=torch.bfloat16).cuda()
        rx = FakeReceiver(torch.zeros_like(src))
        seq, nb = make_seq(num_cached=40 * 16 - 3, prompt_len=600, block_size=16)
        src_blocks = list(range(63, 63 - nb, -1))

        async def layer(i):  # device-to-host copy off the event loop, prefetched one layer ahead
            return await asyncio.to_thread(lambda: gather_layer(src, i, src_blocks).cpu())

        async with rx.server() as server, await KVClient.connect(HOST, server.port, SECRET) as client:
            report = await client.send_sequence(rx.layout, seq, layer, nb, transfer_id="gpu")
        print(f"tcp loopback: {report.nbytes / 2**20:.0f} MiB at {report.gbps:.2f} Gb/s")
        assert rx.layers["gpu"] == list(range(8))
        assert same_blocks(src, src_blocks, rx.kv, rx.adopted["gpu"].block_ids)
    run(main())
