"""How fast peer sets follow membership through etcd: join, death (kill -9) and clean stop.

    python -m bench.load.membership [--nodes 3] [--ttl 2] [--rounds 3] [--model PATH]

Starts a throwaway etcd (:mod:`bench.load.etcd_server`) and ``--nodes`` time-shared nodes on the model
(default: the shared stories260k) with ``--kv-port 0 --etcd``; each node's ``--peer-stale-s`` (its
lease TTL) is ``--ttl``. It measures, per round, with ``GET /v1/node`` polled every 20 ms:

* **join**: from a new node's ``/health`` answering to every other node listing it as a healthy peer;
* **kill -9**: from the kill to its removal from every other node's membership and peer set
  (bounded by the TTL plus etcd's lease check; its KV link turns unhealthy at once, which is not
  what is measured);
* **stop**: from SIGTERM to the removal everywhere (the node revokes its lease on the way out).

Prints one line per event and the median of each. Loopback only; the work is the nodes' and etcd's.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from bench.load.etcd_server import EtcdServer
from bench.load.node_process import NodeServer

REPO = Path(__file__).resolve().parents[2]
STORIES = REPO.parent / "shared" / "models" / "stories260k"


def peer_ids(node: NodeServer) -> set[str]:
    """Node ids of the peers this node has a healthy KV link to."""
    return {p["node_id"] for p in node.get_json("/v1/node")["network"].get("peers", []) if p["healthy"]}


def member_ids(node: NodeServer) -> tuple[set[str], int]:
    """Node ids this node sees in etcd, and how many peers (healthy or not) it still places on."""
    net = node.get_json("/v1/node")["network"]
    return set(net["membership"]["members"]), len(net.get("peers", []))


def gone(victim: str, others: list[NodeServer]) -> bool:
    """``victim`` is out of every other node's membership and peer set (not merely unhealthy: its
    KV link breaks at once on a kill, which is not the membership's doing)."""
    views = [member_ids(n) for n in others]
    return all(victim not in m and count == len(others) - 1 for m, count in views)


def until(predicate, timeout_s: float) -> float:
    """Seconds until ``predicate()`` holds (polled every 20 ms); raises TimeoutError."""
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError
        time.sleep(0.02)
    return time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.load.membership", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--ttl", type=float, default=2.0, help="--peer-stale-s of every node: its lease TTL (s)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", default=str(STORIES))
    a = ap.parse_args(argv)
    if a.nodes < 2:
        ap.error("--nodes must be at least 2")
    logs = Path(tempfile.mkdtemp(prefix="bench-membership-"))
    times: dict[str, list[float]] = {"join": [], "kill -9": [], "stop": []}
    counter = iter(range(10**6))

    with EtcdServer() as etcd:
        def start() -> tuple[str, NodeServer]:
            name = f"n{next(counter)}"
            node = NodeServer(["--model", a.model, "--mode", "time-shared", "--kv-port", "0", "--kv-host", "127.0.0.1", "--peer-secret", "bench",
                               "--etcd", etcd.url, "--node-id", name, "--peer-stale-s", str(a.ttl)],
                              log_path=logs / f"{name}.log")
            node.start()
            return name, node

        nodes = dict(start() for _ in range(a.nodes - 1))
        try:
            for r in range(a.rounds):
                name, node = start()
                dt = until(lambda: all(name in peer_ids(n) for n in nodes.values()), 30)
                times["join"].append(dt)
                print(f"round {r}: {name} joined every peer set in {dt * 1e3:.0f} ms")
                nodes[name] = node
                for event in ("kill -9", "stop"):
                    victim = sorted(nodes)[0]
                    node = nodes.pop(victim)
                    t0 = time.monotonic()
                    if event == "kill -9":
                        node.proc.kill()
                    else:
                        node.proc.terminate()
                    until(lambda: gone(victim, list(nodes.values())), 4 * a.ttl + 10)
                    dt = time.monotonic() - t0
                    node.stop()
                    times[event].append(dt)
                    print(f"round {r}: {event} of {victim}: gone from every peer set in {dt * 1e3:.0f} ms")
                    nodes.update([start()])
                    until(lambda: all(len(peer_ids(n)) == len(nodes) - 1 for n in nodes.values()), 30)
        finally:
            for n in nodes.values():
                n.stop()
    print(f"\n{a.nodes} nodes, lease TTL {max(2, int(-(-a.ttl // 1)))} s, {a.rounds} rounds (median):")
    for event, xs in times.items():
        print(f"  {event:8s} {statistics.median(xs) * 1e3:7.0f} ms   (min {min(xs) * 1e3:.0f}, max {max(xs) * 1e3:.0f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
