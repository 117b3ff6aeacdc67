"""KV transfer between two processes on loopback: NIXL against TCP, MB/s and the event loop's busy share.

    python -m bench.device.transfer [--mib 64] [--rounds 5] [--transports tcp,nixl] [--ucx-tls tcp]

A receiving process (a :class:`~node.transport.server.KVServer` on a uvloop event loop, as in a node)
and this process (the sender, a :class:`~node.transport.client.KVClient`) each hold a KV pool of a
Llama-3-8B-like geometry (32 layers, 8 KV heads of 128, bfloat16, blocks of 16 tokens: 2 MiB per
block over all layers), and move one sequence of ``--mib`` MiB (64 MiB: 32 blocks, 512 tokens) per
round, as a node's hand-off does:

* **tcp**: each layer gathered on a worker thread, CRC-32'd and written to the socket by the loop;
  read, checked and scattered into the reserved blocks on the receiver (its worker thread);
* **nixl**: both pools registered with a NIXL agent (UCX); the sender WRITEs each layer's blocks into
  the receiver's reserved blocks, one request per layer with a notification; the TCP connection
  carries the offer, the accept (block ids) and the commit.

Per round and side it reports the throughput (payload MB/s, 1 MB = 1e6 bytes, from the offer to the
commit on the sender's clock), the event loop's busy share (CPU time of the loop's thread over the
transfer's wall time) and the process's CPU share (all threads: NIXL's agent thread, the workers).
A first, warm-up round is not counted; its received blocks are checked against the sent ones (CRC-32). ``--ucx-tls`` sets
``UCX_TLS`` for both processes (``tcp``: UCX's TCP transport; unset: UCX picks, shared memory on one
host). Prints one line per round and the medians.
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import time
import zlib

import torch

GEOMETRY = dict(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16)
SECRET = "bench-transfer"


def _pool(num_blocks: int, seed: int | None) -> torch.Tensor:
    g = GEOMETRY
    shape = (g["num_layers"], 2, num_blocks, g["block_size"], g["num_kv_heads"], g["head_dim"])
    if seed is None:
        return torch.zeros(shape, dtype=torch.bfloat16)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _crc(kv: torch.Tensor, blocks: list[int]) -> int:
    return zlib.crc32(kv[:, :, blocks].contiguous().view(torch.uint8).numpy().tobytes())


def _receiver(conn, num_blocks: int, transport: str, poll_s: float) -> None:
    """The receiving process: serve transfers until the pipe closes; report each one's loop and CPU use."""
    import uvloop

    from node.transport import KVServer
    from node.transport.nixl_plane import info_of
    from node.transport.tensors import layout_of, scatter_layer_bytes

    async def main() -> None:
        kv = _pool(num_blocks, None)
        layout = layout_of(kv, "bench")
        agent = None
        if transport == "nixl":
            from node.transport.nixl_agent import NixlAgent
            agent = await NixlAgent.create("bench-receiver", poll_s)
            await agent.register(kv)
        marks: dict[str, tuple] = {}
        done = asyncio.Event()

        def reserve(offer):
            marks[offer.transfer_id] = (time.monotonic(), time.thread_time(), time.process_time())
            blocks = list(range(offer.num_blocks))
            return (blocks, 0, 0) if agent is not None else blocks

        async def on_layer(tid, layer, data):  # the TCP path: scatter on a worker thread, as a node does
            blocks = server.in_flight[tid].block_ids
            await asyncio.to_thread(scatter_layer_bytes, data, layout, kv, layer, blocks)

        def on_done(tid, report):
            t0, c0, p0 = marks.pop(tid)
            wall = time.monotonic() - t0
            busy, cpu = (time.thread_time() - c0) / wall, (time.process_time() - p0) / wall
            crc = _crc(kv, report.block_ids) if tid.endswith("/0") else None  # after the measurement
            conn.send((tid, wall, busy, cpu, crc))

        def on_abort(tid, reason):
            conn.send((tid, None, reason))

        server = KVServer("127.0.0.1", 0, SECRET, layout, reserve=reserve, on_layer=on_layer, on_done=on_done,
                          on_abort=on_abort, node_id="receiver", nixl=agent,
                          nixl_info=info_of(agent, await agent.metadata()) if agent else None)
        await server.start()
        conn.send(server.port)
        loop = asyncio.get_running_loop()
        loop.add_reader(conn.fileno(), done.set)  # the parent closed its end: stop
        await done.wait()
        await server.close()
        if agent is not None:
            await agent.close()

    uvloop.run(main())


async def _send(port: int, transport: str, mib: int, rounds: int, pool_blocks: int, poll_s: float) -> list[dict]:
    from node.transport import KVClient
    from node.transport.protocol import SeqState
    from node.transport.tensors import gather_layer, layout_of

    kv = _pool(pool_blocks, seed=1)
    layout = layout_of(kv, "bench")
    per_block = layout.block_bytes * layout.num_layers
    n = mib * 2**20 // per_block
    blocks = list(range(pool_blocks - n, pool_blocks))[::-1]  # not the receiver's ids, not in order: a real gather
    agent = None
    if transport == "nixl":
        from node.transport.nixl_agent import NixlAgent
        agent = await NixlAgent.create("bench-sender", poll_s)
        await agent.register(kv)
    client = await KVClient.connect("127.0.0.1", port, SECRET, node_id="sender", layout=layout, nixl=agent,
                                    heartbeat_interval_s=None)
    tokens = n * layout.block_size
    out = []
    try:
        for r in range(rounds):
            seq = SeqState(request_id="bench", seq_id=f"s{r}", token_ids=list(range(tokens + 1)), prompt_len=tokens,
                           num_computed=tokens, max_len=tokens + 16)

            async def layer(i: int):
                return await asyncio.to_thread(gather_layer, kv, i, blocks)

            t0, c0, p0 = time.monotonic(), time.thread_time(), time.process_time()
            report = await client.send_sequence(layout, seq, layer, n, transfer_id=f"{transport}/{r}",
                                                nixl_blocks=(0, blocks) if agent else None)
            wall = time.monotonic() - t0
            out.append({"round": r, "nbytes": report.nbytes, "wall_s": wall, "mb_s": report.nbytes / wall / 1e6,
                        "loop_busy": (time.thread_time() - c0) / wall, "cpu": (time.process_time() - p0) / wall,
                        "crc": _crc(kv, blocks) if r == 0 else None})
    finally:
        await client.close()
        if agent is not None:
            await agent.close()
    return out


def run(transport: str, mib: int, rounds: int, poll_s: float = 50e-6) -> list[dict]:
    """One transport's rounds (round 0 is a warm-up: first-touch page faults, UCX's connection set-up);
    each row merges the sender's and the receiver's figures."""
    pool_blocks = 2 * (mib * 2**20 // (2 * GEOMETRY["block_size"] * GEOMETRY["num_kv_heads"] * GEOMETRY["head_dim"]
                                       * 2 * GEOMETRY["num_layers"]))
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(child, pool_blocks, transport, poll_s), daemon=True)
    proc.start()
    child.close()
    try:
        port = parent.recv()
        import uvloop
        rows = uvloop.run(_send(port, transport, mib, rounds + 1, pool_blocks, poll_s))
        for row in rows:
            tid, wall, *rest = parent.recv()
            if wall is None:
                raise RuntimeError(f"the receiver aborted {tid}: {rest[0]}")
            busy, cpu, crc = rest
            if row["crc"] is not None and crc != row["crc"]:
                raise RuntimeError(f"{transport}: the received KV differs from the sent KV")
            row |= {"rx_loop_busy": busy, "rx_cpu": cpu}
        return rows[1:]
    finally:
        parent.close()
        proc.join(10)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=64, help="KV of the sequence moved per round (MiB)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--transports", default="tcp,nixl")
    ap.add_argument("--ucx-tls", default=None, help="UCX_TLS for both processes (e.g. tcp)")
    ap.add_argument("--poll-us", type=float, default=50.0, help="the NIXL agent thread's pause between idle polls (µs)")
    a = ap.parse_args(argv)
    if a.ucx_tls:
        os.environ["UCX_TLS"] = a.ucx_tls
    print(f"# {a.mib} MiB per round ({a.mib * 2**20 // (2 << 20)} blocks of 2 MiB), {a.rounds} rounds after a "
          f"warm-up, UCX_TLS={os.environ.get('UCX_TLS', '(unset)')}, NIXL poll pause {a.poll_us:g} us")
    print("transport round     MB/s  wall_ms  tx_loop_busy  tx_cpu  rx_loop_busy  rx_cpu")
    for transport in a.transports.split(","):
        rows = run(transport, a.mib, a.rounds, a.poll_us * 1e-6)
        for r in rows:
            print(f"{transport:9s} {r['round']:5d} {r['mb_s']:8.0f} {r['wall_s'] * 1e3:8.1f} {r['loop_busy']:13.2f} "
                  f"{r['cpu']:7.2f} {r['rx_loop_busy']:13.2f} {r['rx_cpu']:7.2f}")
        med = {k: statistics.median(r[k] for r in rows) for k in ("mb_s", "wall_s", "loop_busy", "cpu",
                                                                   "rx_loop_busy", "rx_cpu")}
        print(f"{transport:9s} {'med':>5s} {med['mb_s']:8.0f} {med['wall_s'] * 1e3:8.1f} {med['loop_busy']:13.2f} "
              f"{med['cpu']:7.2f} {med['rx_loop_busy']:13.2f} {med['rx_cpu']:7.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
