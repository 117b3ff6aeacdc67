"""Chaos: engines killed with ``kill -9`` at random moments while KV is in flight, under streaming load.

    python -m bench.load.chaos [--scenario pooled|adaptive|both] [--duration 300] [--kill-every 4]
        [--kill-window 0.8] [--targeted 0.7] [--concurrency 8] [--abort 0.15] [--kv-transport tcp|nixl]
        [--stall-every 0] [--node-kill-every 0] [--node-down 1] [--membership peers|etcd]
        [--etcd-restart-every 0] [--etcd-down 1] [--seed 0]

Each scenario runs two nodes on the model (default: the shared stories260k), each with two CPU devices whose
engines are processes, ``SHIFTNODE_LEDGER_CHECK=1`` (every device checks after every step that no KV block
is owned twice or freed while held), restarts unbounded (``--engine-restart-max 1000`` within 20 s), a
32 MiB KV pool per device and one intra-op thread (so a restarted engine loads quickly), and every KV
transfer paced to ``--link-gbps`` (0.01 Gb/s: a 100-token sequence's KV takes about 0.1 s, a window to
kill in):

* ``pooled``: **P** (``--mode pooled --prefill-devices cpu:0 --decode-devices cpu:1 --peers D``) and **D**
  (``--mode pooled --decode-devices cpu:0,cpu:1 --kv-port``). Every prompt is prefilled on P's cpu:0, then
  its KV moves layer by layer to P's cpu:1 (an in-node move) or to D (a hand-off over TCP, or NIXL writes
  with ``--kv-transport nixl``). The load goes to P.
* ``adaptive``: **A** and **B** in adaptive mode, each the other's peer (``--kv-port``, ``--peers``),
  ``--imbalance-threshold 0.2``: decoding sequences move between a node's devices and to the peer when
  decode load is uneven. The load goes to both.

First an unkilled reference: every greedy prompt of the run (the stories260k reference cases, checked
against ``reference_greedy.json``, and ``--greedy-prompts`` seeded random ones that may end at their
natural EOS) is answered once. Then, for ``--duration`` seconds, ``--concurrency`` clients stream
completions (half greedy from that pool, half sampled; a fifth non-streamed; ``--abort`` of the streams
closed by the client after a few events; after an error a client waits the node's 1 s ``Retry-After``).
Every ``--kill-every`` seconds (uniformly 0.5-1.5x), during the first ``--kill-window`` of the run, one
engine process is killed, on a node whose devices are all up (so each node keeps one serving): with
probability ``--targeted`` one with a KV transfer in flight (either end of an in-node move, the sender or
receiver of a hand-off, read from ``GET /v1/node``: ``kv_moves_out``, ``network.sending_from`` and
``network.receiving_on``; waiting up to 3 s for one), else any. ``--stall-every S`` also stops a node with
SIGSTOP for 3 s every S seconds (a stalled peer).

Above the engines (:mod:`bench.load.chaos_nodes`): ``--node-kill-every S`` kills a whole node with ``kill -9``
now and then (the peer node: D in ``pooled``, B in ``adaptive``; P and A are never killed, so their memory is
judged) and starts it again ``--node-down`` seconds later on the same ports and node id; the clients avoid it
while it is down, and a request whose node died under it counts as *lost* (a dropped or refused connection,
apart from the clear errors; never "hung"). ``--membership etcd`` has the nodes find each other through a
throwaway etcd (``--etcd``, ``--node-id``, a 6 s lease) instead of ``--peers``, and ``--etcd-restart-every S``
kills etcd and starts it again ``--etcd-down`` seconds later on the same data.

After the load the nodes settle (every device back, nothing held), and the run checks
(:class:`~bench.load.chaos_report.ChaosReport`): every request ended (ok, a clear error, or aborted by its
client; none hung and none with an unclear failure); each greedy answer equals the reference (a prefix of it
when it ended early); no KV block is held and no request is left on either node; no device counted an
engine error (a ledger violation is one), no log line names a ``LedgerError`` and none is an error of asyncio's
own (``ERROR:asyncio:``: an exception that no code retrieved); both nodes answer
``/health`` ``ok`` with every device up and serve the reference prompts exactly; and, in runs of 5 minutes
or more, the private RSS of each node never killed grew less than 10 % after the warm-up; no engine process
outlived a killed node and every killed node came back; every node's peers have a healthy KV link; with etcd,
every node is registered and sees every other as a member. It prints the kills (with what was
in flight on the device), the requests by outcome, the restarts, resumes and transfers each node counted,
and PASS or FAIL; exit status 0 on PASS. :func:`chaos` is what ``tests/test_chaos.py`` runs for 16 s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import tempfile
import time
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from bench.load.chaos_client import Prompt, complete, get, greedy_pool, request
from bench.load.chaos_nodes import kill_nodes, lost_to_a_killed_node, restart_etcd
from bench.load.chaos_report import LOST_PREFIX, ChaosReport, Kill
from bench.load.etcd_server import EtcdServer
from bench.load.node_process import NodeServer, free_port
from bench.load.soak import STORIES, WORDS, rss_kib

SCENARIOS = ("pooled", "adaptive")
# the peers (other nodes it sends KV to) each node has when all is well: P's is D; D has none (P takes no KV)
PEERS = {"pooled": {"P": ["D"], "D": []}, "adaptive": {"A": ["B"], "B": ["A"]}}
STATUS = "/v1/node?since=1e300"  # the state without the switch and transfer histories (a light poll)


def _node_args(scenario: str, model: str, transport: str, link_gbps: float, request_timeout_s: float,
               etcd_url: str | None = None) -> dict:
    """``{name: serve flags}`` of the scenario's two nodes (see the module docstring); with ``etcd_url`` they
    find each other through etcd instead of ``--peers``."""
    common = ["--model", model, "--peer-secret", "chaos", "--kv-host", "127.0.0.1", "--link-gbps", str(link_gbps),
              "--engine-restart-max", "1000", "--engine-restart-window-s", "20", "--kv-cache-memory", "32MiB",
              "--cpu-threads", "1",
              "--request-timeout-s", str(request_timeout_s), "--kv-transport", transport]
    k1, k2 = free_port(), free_port()

    def found(name: str, peer_kv: int | None) -> list[str]:  # its id (the same after a restart); how it finds its peer
        if etcd_url:
            return ["--node-id", name, "--etcd", etcd_url, "--etcd-prefix", "/chaos", "--etcd-lease-ttl-s", "6"]
        return ["--node-id", name, *(["--peers", f"127.0.0.1:{peer_kv}"] if peer_kv else [])]

    if scenario == "pooled":
        return {"D": [*common, "--mode", "pooled", "--decode-devices", "cpu:0,cpu:1", "--kv-port", str(k1),
                      *found("D", None)],
                "P": [*common, "--mode", "pooled", "--prefill-devices", "cpu:0", "--decode-devices", "cpu:1",
                      *found("P", k1)]}
    if scenario == "adaptive":
        return {name: [*common, "--mode", "adaptive", "--devices", "cpu:0,cpu:1", "--imbalance-threshold", "0.2",
                       "--kv-port", str(mine), *found(name, theirs)]
                for name, mine, theirs in (("A", k1, k2), ("B", k2, k1))}
    raise ValueError(f"unknown scenario {scenario!r}: one of {SCENARIOS}")


def in_flight(statuses: dict[str, dict]) -> list[tuple[str, str, str]]:
    """``(node, device, context)`` for each live device at either end of a KV transfer in ``statuses``
    (``GET /v1/node`` of each node)."""
    out = []
    for name, st in statuses.items():
        up = {d["device"] for d in st["devices"] if d["failure"] is None}
        for d in st["devices"]:
            for dst in d.get("kv_moves_out", []):
                out += [(name, d["device"], "move-src"), (name, dst, "move-dst")]
        net = st.get("network", {})
        out += [(name, dev, "handoff-src") for dev in net.get("sending_from", [])]
        out += [(name, dev, "handoff-dst") for dev in net.get("receiving_on", [])]
        out = [c for c in out if c[0] != name or c[1] in up]
    return out


class Chaos:
    """One scenario's run over started nodes (see the module docstring and :func:`chaos`)."""

    def __init__(self, nodes: dict[str, NodeServer], entry: list[str], pool: list[Prompt], rep: ChaosReport,
                 rng: random.Random, a: argparse.Namespace, victim: str, etcd: EtcdServer | None = None):
        self.nodes, self.entry, self.pool, self.rep, self.rng, self.a = nodes, entry, pool, rep, rng, a
        self.scenario = "pooled" if "P" in nodes else "adaptive"
        self.victim, self.etcd = victim, etcd  # the node --node-kill-every kills; the etcd of --membership etcd
        self.down: set[str] = set()  # nodes killed and not yet back
        self.stalled: set[str] = set()  # nodes SIGSTOPped now
        self.t0 = 0.0

    async def statuses(self, session) -> dict[str, dict]:
        """``GET /v1/node`` of each node that is up and answers (a node may die while it is asked)."""
        names = [n for n in self.nodes if n not in self.down]
        got = await asyncio.gather(*(get(session, self.nodes[n].url + STATUS) for n in names), return_exceptions=True)
        return {n: st for n, st in zip(names, got) if isinstance(st, dict) and n not in self.down}

    async def client(self, session, rng: random.Random, until: float) -> None:
        a, rep = self.a, self.rep
        while time.monotonic() < until:
            greedy = rng.random() < 0.5
            p = rng.choice(self.pool) if greedy else None
            stream = rng.random() >= 0.2
            body = ({"prompt": p.text, "max_tokens": p.max_tokens, "temperature": 0.0} if greedy else
                    {"prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 150))),
                     "max_tokens": rng.randint(16, 160), "temperature": 0.8, "top_p": 0.95})
            body |= {"stream": stream, "return_token_ids": True}
            cut = rng.randint(1, 40) if stream and rng.random() < a.abort else None
            up = [n for n in self.entry if n not in self.down]
            if not up:
                await asyncio.sleep(0.2)
                continue
            target = rng.choice(up)
            start = time.monotonic()
            outcome, ids = await request(session, self.nodes[target].url, body, cut, a.request_timeout_s + 30)
            outcome = lost_to_a_killed_node(outcome, rep.node_kills, target, start - self.t0, time.monotonic() - self.t0)
            rep.requests += 1
            rep.outcomes[outcome] += 1
            if outcome not in ("ok", "aborted", "hung") and not outcome.startswith(LOST_PREFIX):
                await asyncio.sleep(1.0)  # the Retry-After of the node's 503s: a client that honours it
            if greedy and outcome != "hung":
                rep.greedy_compared += 1
                rep.greedy_during_kills += any(k.at_s >= start - self.t0 for k in rep.kills)
                want = p.reference if outcome == "ok" else p.reference[:len(ids)]  # ended early: a prefix
                if ids != want:
                    at = next((i for i, (x, y) in enumerate(zip(ids, want)) if x != y), min(len(ids), len(want)))
                    rep.greedy_mismatches.append(f"{outcome} {p.text[:30]!r}: {len(ids)} tokens, differs at {at}")

    async def killer(self, session) -> None:
        a, rng = self.a, self.rng
        while True:
            await asyncio.sleep(rng.uniform(0.5, 1.5) * a.kill_every)
            if time.monotonic() >= self.t0 + a.kill_window * a.duration:
                return
            targeted = rng.random() < a.targeted
            wait_until = time.monotonic() + (3.0 if targeted else 0.0)
            while True:
                sts = await self.statuses(session)
                cands = in_flight(sts)
                if cands or time.monotonic() >= wait_until:
                    break
                await asyncio.sleep(0.02)
            whole = {n for n, st in sts.items() if all(d["failure"] is None for d in st["devices"])}
            pids = {(n, d["device"]): d["engine"]["pid"] for n, st in sts.items() for d in st["devices"]
                    if n in whole and d["engine"]["pid"]}  # one device down per node at most
            cands = [c for c in cands if c[0] in whole]
            if not pids:
                continue
            if targeted and cands:
                node, dev, context = rng.choice(cands)
            else:
                node, dev = rng.choice(sorted(pids))
                context = ",".join(sorted({c for n, d, c in cands if (n, d) == (node, dev)})) or "no-transfer"
            if node in self.down:  # the whole node was killed since the look: its engines are dying already
                continue
            with contextlib.suppress(ProcessLookupError):
                os.kill(pids[(node, dev)], signal.SIGKILL)
                self.rep.kills.append(Kill(round(time.monotonic() - self.t0, 2), node, dev, pids[(node, dev)], context))

    async def staller(self, until: float) -> None:
        a, rng = self.a, self.rng
        while a.stall_every > 0:
            await asyncio.sleep(a.stall_every)
            if time.monotonic() + 3 >= until:
                return
            name = rng.choice(sorted(set(self.nodes) - self.down))
            proc = self.nodes[name].proc
            self.stalled.add(name)
            proc.send_signal(signal.SIGSTOP)
            try:
                await asyncio.sleep(3.0)
            finally:
                proc.send_signal(signal.SIGCONT)
                self.stalled.discard(name)
            self.rep.stalls.append(f"{time.monotonic() - self.t0 - 3:7.1f} s  SIGSTOP of node {name} for 3 s")

    async def run(self) -> None:
        a, rep = self.a, self.rep
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
            await self.reference(session)
            self.t0 = time.monotonic()
            until = self.t0 + a.duration
            warm = asyncio.create_task(self.sample_rss(session, 0.1 * a.duration))
            await asyncio.gather(*(self.client(session, random.Random(self.rng.random()), until)
                                   for _ in range(a.concurrency)), self.killer(session), self.staller(until),
                                 kill_nodes(self, session, self.victim),
                                 *([restart_etcd(self, self.etcd)] if self.etcd is not None else []))
            rep.seconds = time.monotonic() - self.t0
            await warm
            await self.settle(session)

    async def reference(self, session) -> None:
        """The unkilled reference: each greedy prompt once (the shared cases must equal their file)."""
        url = self.nodes[self.entry[0]].url
        got = await asyncio.gather(*(complete(session, url, p) for p in self.pool))
        for p, ids in zip(self.pool, got):
            if ids is None or (p.reference is not None and ids != p.reference):
                self.rep.greedy_mismatches.append(f"reference run {p.text[:30]!r}: {ids and len(ids)} tokens")
            if p.reference is None:
                p.reference = ids or []

    async def sample_rss(self, session, after_s: float) -> None:
        await asyncio.sleep(after_s)
        for name, n in self.nodes.items():
            if not (self.a.node_kill_every > 0 and name == self.victim):  # a killed node's memory starts again
                self.rep.rss_kib[name] = [rss_kib(n.proc.pid)[0], 0]

    async def settle(self, session) -> None:
        """Wait (``--settle``) for every device to be up and nothing held, then read the end state."""
        rep, deadline = self.rep, time.monotonic() + self.a.settle
        while True:
            sts = await self.statuses(session)
            busy = [(n, d["device"]) for n, st in sts.items() for d in st["devices"]
                    if d["failure"] is not None or d["kv_blocks_used"] or d["running"] or d["waiting"]]
            whole = len(sts) == len(self.nodes) and not any(self._network_gaps(n, st) for n, st in sts.items())
            if (whole and not busy and not any(st["live_requests"] for st in sts.values())) \
                    or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.25)
        for n in self.nodes:
            if n not in sts:
                rep.health_after[n] = "not answering"
        for n, st in sts.items():
            sick, wrong = self._network_gaps(n, st) or ([], "")
            rep.unhealthy_peers_after[n] = sick
            if self.etcd is not None:  # the report says "not used" otherwise
                rep.membership_after[n] = wrong
            rep.live_requests[n] = st["live_requests"]
            for d in st["devices"]:
                key = f"{n} {d['device']}"
                rep.leaked_blocks[key] = d["kv_blocks_used"]
                if d["errors"]:
                    rep.engine_errors[key] = d["errors"]
                if d["failure"] is not None:
                    rep.devices_down_after.append(f"{key}: {d['failure']}")
            rep.counters[n] = _counters(await get(session, self.nodes[n].url + "/metrics", text=True))
            if "nixl" in st["network"]:  # --kv-transport nixl: the layers that went over NIXL, not TCP
                rep.counters[n]["nixl_layers"] = {k: st["network"]["nixl"].get(k)
                                                  for k in ("layers_written", "layers_received")}
            rep.health_after[n] = (await get(session, self.nodes[n].url + "/health")).get("status")
            rep.rss_kib.setdefault(n, [0, 0])[1] = rss_kib(self.nodes[n].proc.pid)[0]
        refs = [p for p in self.pool if p.shared] or self.pool[:2]
        if len(sts) < len(self.nodes):
            return
        answers = await asyncio.gather(*(complete(session, self.nodes[n].url, p) for n in self.entry for p in refs))
        rep.served_after = all(ids == p.reference for ids, p in zip(answers, refs * len(self.entry)))


    def _network_gaps(self, name: str, st: dict) -> tuple[list[str], str] | None:
        """What is missing from node ``name``'s network (its ``GET /v1/node``): its peers without a healthy KV
        link, and with etcd what is wrong with its membership; None when nothing is."""
        healthy = sorted(p["node_id"] for p in st["network"].get("peers", []) if p["healthy"])
        want = PEERS[self.scenario][name]
        sick = sorted(set(want) - set(healthy))
        wrong = ""
        if self.etcd is not None:
            m = st["network"].get("membership") or {}
            others = sorted(set(self.nodes) - {name})
            if m.get("state") != "registered" or m.get("members") != others:
                wrong = f"{m.get('state')} {m.get('reason', '')!r}, members {m.get('members')} (want {others})"
        return (sick, wrong) if sick or wrong else None


def _counters(text: str) -> dict:
    """The restart, resume and transfer counters of one node's ``/metrics``."""
    out: dict = {"restarts": 0, "resumes": 0, "handoff_failures": 0, "transfers": {}}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "shiftnode_engine_restarts_total":
                out["restarts"] += int(s.value)
            elif s.name == "shiftnode_kv_recomputes_total":
                out["resumes"] += int(s.value)
            elif s.name == "shiftnode_kv_handoff_failures_total":
                out["handoff_failures"] += int(s.value)
            elif s.name == "shiftnode_kv_transfers_total" and s.value:
                out["transfers"][s.labels.get("reason", "")] = int(s.value)
    return out


def chaos(scenario: str = "pooled", *, duration_s: float = 60.0, kill_every_s: float = 4.0, kill_window: float = 0.8,
          concurrency: int = 8,
          abort: float = 0.15, targeted: float = 0.7, kv_transport: str = "tcp", link_gbps: float = 0.01,
          stall_every_s: float = 0.0, node_kill_every_s: float = 0.0, node_down_s: float = 1.0,
          membership: str = "peers", etcd_restart_every_s: float = 0.0, etcd_down_s: float = 1.0,
          greedy_prompts: int = 8, request_timeout_s: float = 120.0,
          settle_s: float = 90.0, seed: int = 0, model: str | Path = STORIES,
          log_dir: str | Path | None = None) -> ChaosReport:
    """Run one scenario (see the module docstring) for ``duration_s`` seconds of load; return its report."""
    a = argparse.Namespace(duration=duration_s, kill_every=kill_every_s, kill_window=kill_window,
                           concurrency=concurrency, abort=abort,
                           targeted=targeted, stall_every=stall_every_s, request_timeout_s=request_timeout_s,
                           settle=settle_s, node_kill_every=node_kill_every_s, node_down=node_down_s,
                           etcd_restart_every=etcd_restart_every_s, etcd_down=etcd_down_s)
    if etcd_restart_every_s > 0 and membership != "etcd":
        raise ValueError("etcd restarts need membership='etcd'")
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix=f"chaos-{scenario}-"))
    rng = random.Random(seed)
    rep = ChaosReport(scenario=f"{scenario} ({kv_transport}, {membership})", judge_memory=duration_s >= 300)
    env = {"SHIFTNODE_LEDGER_CHECK": "1"}
    with contextlib.ExitStack() as stack:
        etcd = stack.enter_context(EtcdServer()) if membership == "etcd" else None
        args = _node_args(scenario, str(model), kv_transport, link_gbps, request_timeout_s, etcd and etcd.url)
        nodes = {n: NodeServer(v, log_path=log_dir / f"{n}.log", env=env) for n, v in args.items()}
        for n in nodes.values():
            stack.callback(n.stop)

        async def go() -> None:
            await asyncio.gather(*(asyncio.to_thread(n.start) for n in nodes.values()))
            await _peers_ready(nodes, PEERS[scenario])
            await Chaos(nodes, ["P"] if scenario == "pooled" else ["A", "B"], greedy_pool(str(model), greedy_prompts, rng),
                        rep, rng, a, victim="D" if scenario == "pooled" else "B", etcd=etcd).run()

        asyncio.run(go())
    logs = [n.log_path.read_text(errors="replace").splitlines() for n in nodes.values()]
    rep.ledger_log_lines = sum(line.count("LedgerError") for lines in logs for line in lines)
    # "Future/Task exception was never retrieved" and the like: a failure the node dropped on the floor
    rep.asyncio_error_lines = sum(line.startswith("ERROR:asyncio:") for lines in logs for line in lines)
    rep.notes.append(f"node logs: {log_dir}")
    return rep


async def _peers_ready(nodes: dict[str, NodeServer], peers: dict[str, list[str]], timeout_s: float = 60.0) -> None:
    """Wait until every node sees each of its ``peers`` (node name -> its peers' names) with a healthy link."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while True:
            sts = [await get(session, n.url + STATUS) for n in nodes.values()]
            healthy = [{p["node_id"] for p in st["network"].get("peers", []) if p["healthy"]} for st in sts]
            if all(set(peers[name]) <= h for name, h in zip(nodes, healthy)):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"peers not ready after {timeout_s:.0f} s: {[st['network'].get('peers') for st in sts]}")
            await asyncio.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.load.chaos", description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", choices=[*SCENARIOS, "both"], default="both")
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of load per scenario")
    ap.add_argument("--kill-every", type=float, default=4.0, help="mean seconds between engine kills")
    ap.add_argument("--kill-window", type=float, default=0.8,
                    help="kills happen in this first fraction of the run (the rest: the load goes on while they come back)")
    ap.add_argument("--targeted", type=float, default=0.7, help="fraction of kills aimed at a KV transfer in flight")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--abort", type=float, default=0.15, help="fraction of streams the client closes early")
    ap.add_argument("--kv-transport", choices=["tcp", "nixl"], default="tcp")
    ap.add_argument("--link-gbps", type=float, default=0.01, help="pace of every KV transfer (a window to kill in)")
    ap.add_argument("--stall-every", type=float, default=0.0, help="SIGSTOP a node for 3 s every S seconds (0: never)")
    ap.add_argument("--node-kill-every", type=float, default=0.0,
                    help="kill -9 the peer node (D or B) every S seconds and start it again (0: never)")
    ap.add_argument("--node-down", type=float, default=1.0, help="seconds a killed node stays down")
    ap.add_argument("--membership", choices=["peers", "etcd"], default="peers",
                    help="how the nodes find each other: --peers, or a throwaway etcd")
    ap.add_argument("--etcd-restart-every", type=float, default=0.0,
                    help="kill -9 etcd every S seconds and start it again (--membership etcd; 0: never)")
    ap.add_argument("--etcd-down", type=float, default=1.0, help="seconds a killed etcd stays down")
    ap.add_argument("--greedy-prompts", type=int, default=8, help="seeded greedy prompts beside the shared cases")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=str(STORIES))
    a = ap.parse_args(argv)
    ok = True
    for scenario in SCENARIOS if a.scenario == "both" else [a.scenario]:
        rep = chaos(scenario, duration_s=a.duration, kill_every_s=a.kill_every, kill_window=a.kill_window,
                    concurrency=a.concurrency,
                    abort=a.abort, targeted=a.targeted, kv_transport=a.kv_transport, link_gbps=a.link_gbps,
                    stall_every_s=a.stall_every, node_kill_every_s=a.node_kill_every, node_down_s=a.node_down,
                    membership=a.membership, etcd_restart_every_s=a.etcd_restart_every, etcd_down_s=a.etcd_down,
                    greedy_prompts=a.greedy_prompts, seed=a.seed, model=a.model)
        print("\n".join(rep.lines()), flush=True)
        ok &= rep.ok()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
