"""Peers found through etcd (``--etcd URL``): register this node under a lease, watch the others.

Each node puts one key, ``{prefix}/nodes/{node_id}``, whose value is a JSON record (its KV
endpoint, node id, model fingerprint, mode and capacity), attached to a lease of ``ttl_s`` seconds
that it keeps alive every ``ttl_s / 3``. It reads the prefix once and then watches it from the
revision it read: a record that appears with a KV endpoint becomes a peer (``on_join``), one
that disappears (deleted on a clean stop, or dropped by etcd when its lease expires after a
``kill -9``) stops being one (``on_leave``). This is how NVIDIA Dynamo registers its workers.
Compatibility is not judged here: a peer with another model or layout is refused by the KV
handshake exactly as a ``--peers`` entry is, and shown as refused in ``/v1/node``.

Client: etcd's own v3 JSON gateway (``/v3/kv/*``, ``/v3/lease/*``, ``/v3/watch``, served by every
etcd >= 3.4 on its client port) over aiohttp, which the node already runs on. The maintained asyncio
gRPC client (aetcd) would add grpcio and protobuf to every install for the six calls used here; the
gateway is the same API, one HTTP request per call and a chunked response of JSON lines for the watch.

Failures: any error of etcd (unreachable, lease lost, watch cancelled or compacted) restarts the
session after a back-off: a new lease, the record put again, the prefix read again and reconciled
(peers that vanished meanwhile leave, new ones join). Peers joined through etcd stay usable while
etcd is away; the KV links' own health checks still judge them.

Under load a keep-alive may be slow: each is bounded by :data:`~node.config.ETCD_KEEPALIVE_TIMEOUT_S`
and one that fails is tried again at once; the session ends only once the lease has run out. So the
TTL is at least three such timeouts (a shorter one is raised, with a warning): one slow call must not
let the record expire and every peer see this node leave and join again.

A watch stream can die silently (a half-open connection: etcd restarted behind a proxy, a dropped
NAT entry); the peer set would then freeze. The watch asks for progress notifications, and a watch
quiet for :data:`QUIET_S` is tested: this node puts its record again (same value, same lease), which
its own watch must report within :data:`ECHO_S`; if it does not, the session ends and a new one
reads the prefix again.
"""
from __future__ import annotations

import asyncio
import base64
import json
import math
import socket
from collections.abc import Callable

import aiohttp
import structlog

from node.config import ETCD_KEEPALIVE_TIMEOUT_S

log = structlog.get_logger("shiftnode.membership")

BACKOFF_S = (0.5, 1.0, 2.0, 5.0)  # between failed sessions with etcd
MIN_TTL_S = 3 * ETCD_KEEPALIVE_TIMEOUT_S  # the shortest lease: three keep-alive tries fit in it
QUIET_S = 30.0  # a watch that reported nothing this long is tested (the echo of this node's own record)
ECHO_S = 5.0  # how long the echo may take before the watch is taken as dead


class EtcdError(RuntimeError):
    """etcd answered with an error, a lost lease, or a watch it cancelled."""


def _b64(s: str) -> str:
    return base64.b64encode(s.encode()).decode()


def _unb64(s: str) -> str:
    return base64.b64decode(s).decode()


def prefix_end(prefix: str) -> str:
    """The ``range_end`` that selects every key starting with ``prefix`` (its last byte plus one),
    as etcd's ``clientv3.GetPrefixRangeEnd``."""
    b = bytearray(prefix.encode())
    for i in range(len(b) - 1, -1, -1):
        if b[i] < 0xFF:
            b[i] += 1
            return bytes(b[: i + 1]).decode("latin-1")
    return "\0"


class EtcdGateway:
    """The five etcd v3 calls membership needs, through etcd's JSON gateway.

    Args:
        url: etcd's client URL, e.g. ``http://127.0.0.1:2379``.
        timeout_s: bound on each unary call (the watch has none: it streams until closed).
    Raises:
        EtcdError / aiohttp.ClientError / asyncio.TimeoutError from each call.
    """

    def __init__(self, url: str, timeout_s: float = 5.0):
        self.url = url.rstrip("/")
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None  # made on first use, inside the event loop

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    async def _call(self, path: str, body: dict) -> dict:
        async with self.session.post(f"{self.url}/v3/{path}", json=body, timeout=self.timeout) as r:
            data = await r.json(content_type=None)
            if r.status != 200 or "error" in data or "code" in data:
                raise EtcdError(f"etcd {path}: HTTP {r.status} {data}")
            return data

    async def grant(self, ttl_s: int) -> str:
        """A new lease of ``ttl_s`` seconds; returns its id."""
        return (await self._call("lease/grant", {"TTL": ttl_s}))["ID"]

    async def keepalive(self, lease: str, timeout_s: float | None = None) -> int:
        """Refresh ``lease``; returns its remaining TTL in seconds (0: the lease has expired). ``timeout_s``
        bounds the call (default: the gateway's)."""
        if timeout_s is None:
            data = await self._call("lease/keepalive", {"ID": lease})
        else:
            data = await asyncio.wait_for(self._call("lease/keepalive", {"ID": lease}), timeout_s)
        return int(data.get("result", {}).get("TTL", 0))

    async def revoke(self, lease: str) -> None:
        """Drop ``lease`` and every key attached to it (a clean stop: watchers see the delete at once)."""
        await self._call("lease/revoke", {"ID": lease})

    async def put(self, key: str, value: str, lease: str | None = None) -> None:
        body = {"key": _b64(key), "value": _b64(value)}
        if lease is not None:
            body["lease"] = lease
        await self._call("kv/put", body)

    async def get_prefix(self, prefix: str) -> tuple[int, dict[str, str]]:
        """Every key under ``prefix``: (the store's revision at the read, {key: value})."""
        data = await self._call("kv/range", {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))})
        kvs = {_unb64(kv["key"]): _unb64(kv.get("value", "")) for kv in data.get("kvs", [])}
        return int(data["header"]["revision"]), kvs

    async def watch(self, prefix: str, start_revision: int, on_event: Callable[[str, str, str | None], None],
                    heard: Callable[[], None] | None = None) -> None:
        """Call ``on_event(kind, key, value)`` (``PUT`` with the value, ``DELETE`` with None) for every
        change under ``prefix`` from ``start_revision`` on, and ``heard()`` for every message of the
        stream (events, progress notifications); returns only by raising (stream closed, watch
        cancelled or compacted)."""
        body = {"create_request": {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix)),
                                   "start_revision": str(start_revision), "progress_notify": True}}
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.timeout.total)
        async with self.session.post(f"{self.url}/v3/watch", json=body, timeout=timeout) as r:
            if r.status != 200:
                raise EtcdError(f"etcd watch: HTTP {r.status}")
            while line := await r.content.readline():
                if heard is not None:
                    heard()
                result = json.loads(line).get("result")
                if result is None or result.get("canceled") or int(result.get("compact_revision", 0) or 0):
                    raise EtcdError(f"etcd cancelled the watch: {line[:200]!r}")
                for ev in result.get("events", []):
                    kv = ev["kv"]
                    kind = ev.get("type", "PUT")  # the JSON mapping omits the enum's zero value, PUT
                    on_event(kind, _unb64(kv["key"]), _unb64(kv["value"]) if kind == "PUT" else None)
        raise EtcdError("etcd closed the watch stream")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


class Membership:
    """This node's registration in etcd and the peer set it derives from the others'.

    Args:
        url: etcd's client URL.
        prefix: the deployment's key prefix (nodes of one deployment share it).
        node_id: this node's id (its record's key; its own record never becomes a peer).
        record: this node's record (JSON-able): ``kv`` (``host:port`` of its KV listener, or None when
            it takes no KV), ``node_id``, ``fingerprint``, ``mode``, ``capacity``.
        ttl_s: lease TTL in seconds (rounded up to a whole second, at least :data:`MIN_TTL_S`: a shorter
            one is raised to it with a warning); a node killed without a clean stop disappears from
            every peer set within about this long.
        on_join / on_leave: called with a peer's ``host:port`` KV endpoint.
    """

    def __init__(self, url: str, prefix: str, node_id: str, record: dict, ttl_s: float,
                 on_join: Callable[[str], object], on_leave: Callable[[str], object]):
        self.gateway = EtcdGateway(url)
        self.url = url
        self.prefix = prefix.rstrip("/") + "/nodes/"
        self.key = self.prefix + node_id
        self.record = record
        self.ttl_s = math.ceil(max(ttl_s, MIN_TTL_S))
        if ttl_s < MIN_TTL_S:
            log.warning("etcd_lease_ttl_raised", asked_s=ttl_s, ttl_s=self.ttl_s,
                        why=f"at least 3 keep-alive timeouts of {ETCD_KEEPALIVE_TIMEOUT_S:g} s, or it flaps under load")
        self._heard = 0.0  # loop time of the watch's last message
        self.on_join, self.on_leave = on_join, on_leave
        self._raw: dict[str, str] = {}  # key → JSON record, every node under the prefix but this one
        self.members: dict[str, dict] = {}  # the same, parsed
        self.joined: dict[str, str] = {}  # key → the KV endpoint given to on_join
        self.state = "starting"  # starting | registered | unreachable
        self.reason = ""
        self.sessions = 0
        self._task: asyncio.Task | None = None
        self._lease: str | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="etcd-membership")

    async def close(self) -> None:
        """Stop, and revoke the lease so that every peer drops this node at once."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._lease is not None:
            try:
                await self.gateway.revoke(self._lease)
            except (aiohttp.ClientError, asyncio.TimeoutError, EtcdError) as e:
                log.warning("etcd_revoke_failed", error=str(e))  # the lease expires by itself
        await self.gateway.close()

    def status(self) -> dict:
        """``network.membership`` of ``GET /v1/node``."""
        return {"etcd": self.url, "key": self.key, "state": self.state, "reason": self.reason,
                "lease_ttl_s": self.ttl_s, "sessions": self.sessions,
                "members": sorted(r.get("node_id", k) for k, r in self.members.items())}

    async def _run(self) -> None:
        failures = 0
        while True:
            sessions = self.sessions
            try:
                await self._session()
            except (aiohttp.ClientError, asyncio.TimeoutError, EtcdError, OSError, ValueError) as e:
                self.state, self.reason = "unreachable", f"{type(e).__name__}: {e}"
                log.warning("etcd_session_failed", etcd=self.url, error=self.reason)
            self._lease = None
            failures = 0 if self.sessions > sessions else failures + 1  # a session that registered resets it
            await asyncio.sleep(BACKOFF_S[min(failures, len(BACKOFF_S) - 1)])

    async def _session(self) -> None:
        """One lease: register, read, reconcile, then keep alive and watch until either fails."""
        self._lease = await self.gateway.grant(self.ttl_s)
        await self.gateway.put(self.key, json.dumps(self.record), self._lease)
        revision, kvs = await self.gateway.get_prefix(self.prefix)
        self._raw = {k: v for k, v in kvs.items() if k != self.key}
        self._reconcile()
        self.state, self.reason = "registered", ""
        self.sessions += 1
        log.info("etcd_registered", etcd=self.url, key=self.key, members=len(self.members))
        self._heard = asyncio.get_running_loop().time()
        watch = asyncio.ensure_future(self.gateway.watch(self.prefix, revision + 1, self._on_event, self._on_heard))
        tasks = {watch, asyncio.ensure_future(self._keepalive()), asyncio.ensure_future(self._guard_watch())}
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                t.result()  # raises the failure that ended the session
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _keepalive(self) -> None:
        """Refresh the lease every third of its TTL; a call that fails or takes longer than
        ETCD_KEEPALIVE_TIMEOUT_S is tried again at once, until the lease has run out."""
        loop = asyncio.get_running_loop()
        refreshed = loop.time()
        while True:
            await asyncio.sleep(max(0.0, refreshed + self.ttl_s / 3 - loop.time()))
            while True:
                try:
                    ttl = await self.gateway.keepalive(self._lease, ETCD_KEEPALIVE_TIMEOUT_S)
                    break
                except (aiohttp.ClientError, asyncio.TimeoutError, EtcdError, OSError) as e:
                    if loop.time() - refreshed >= self.ttl_s:
                        raise EtcdError(f"the lease ran out: keep-alives failed for {self.ttl_s} s ({e})") from e
                    log.warning("etcd_keepalive_retry", error=f"{type(e).__name__}: {e}")
                    await asyncio.sleep(0.05)
            if ttl <= 0:
                raise EtcdError("the lease expired (etcd was out of reach longer than its TTL)")
            refreshed = loop.time()

    def _on_heard(self) -> None:
        self._heard = asyncio.get_running_loop().time()

    async def _guard_watch(self) -> None:
        """End the session when the watch is silently dead: quiet for QUIET_S, and this node's own
        record, put again, not echoed within ECHO_S (the module's docstring)."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(max(0.0, self._heard + QUIET_S - loop.time()))
            if loop.time() - self._heard < QUIET_S:
                continue
            asked = loop.time()
            await self.gateway.put(self.key, json.dumps(self.record), self._lease)
            while self._heard < asked:
                if loop.time() - asked > ECHO_S:
                    raise EtcdError(f"the watch is silent: no echo of this node's own record within {ECHO_S:g} s")
                await asyncio.sleep(0.05)

    def _on_event(self, kind: str, key: str, value: str | None) -> None:
        if key == self.key:
            return
        if kind == "PUT":
            self._raw[key] = value
        else:
            self._raw.pop(key, None)
        self._reconcile()

    def _reconcile(self) -> None:
        """Make the joined peers match the records read (``_raw``): leave the gone or changed, join the new."""
        members = {}
        for k, v in self._raw.items():
            try:
                members[k] = json.loads(v)
            except ValueError:
                log.warning("etcd_bad_record", key=k)
        wanted = {k: r["kv"] for k, r in members.items() if isinstance(r, dict) and r.get("kv")}
        for k, addr in list(self.joined.items()):
            if wanted.get(k) != addr:
                del self.joined[k]
                log.info("etcd_peer_left", key=k, peer=addr)
                self.on_leave(addr)
        for k, addr in wanted.items():
            if k not in self.joined:
                try:
                    self.on_join(addr)
                except ValueError as e:  # a malformed endpoint in someone's record: not a peer
                    log.warning("etcd_bad_endpoint", key=k, peer=addr, error=str(e))
                    continue
                self.joined[k] = addr
                log.info("etcd_peer_joined", key=k, peer=addr)
        self.members = members


def advertised_host(kv_host: str | None, host: str, advertise_host: str | None) -> str:
    """The host other nodes dial for this node's KV listener: ``--advertise-host``, else the listener's
    address, or this machine's name when that is a wildcard (``0.0.0.0``, ``::``, empty)."""
    if advertise_host:
        return advertise_host
    h = kv_host or host
    return socket.gethostname() if h in ("", "0.0.0.0", "::") else h


def join(config, links, kv_port: int | None, fingerprint: dict | None, kv_blocks: int) -> Membership:
    """Start this node's membership (``--etcd``) feeding ``links`` (the node's :class:`PeerLinks`).

    Args:
        config: the :class:`NodeConfig` (etcd URL and prefix, node id, mode, hosts, ``peer_stale_s``).
        links: the peer set; joined peers are ``links.add``-ed and removed again when they leave,
            except those also given as ``--peers``, which stay.
        kv_port: this node's bound KV listener port, or None when it takes no KV (then it registers
            for visibility but is nobody's peer).
        fingerprint: the model and layout fingerprint (JSON-able), shown in the record.
        kv_blocks: the KV blocks of all its devices, shown as capacity.
    """
    static = set(config.peers)
    host = advertised_host(config.kv_host, config.host, config.advertise_host)
    record = {"node_id": config.name, "kv": f"{host}:{kv_port}" if kv_port is not None else None,
              "api": f"{host}:{config.port}", "model": config.model_name, "mode": config.mode,
              "fingerprint": fingerprint, "capacity": {"kv_blocks": kv_blocks}}

    def leave(addr: str) -> None:
        if addr not in static:
            links.remove(addr)

    m = Membership(config.etcd, config.etcd_prefix, config.name, record, config.etcd_lease_ttl_s, links.add, leave)
    m.start()
    return m
