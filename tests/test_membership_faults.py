"""etcd membership under faults, in-process against a scripted gateway (issue 45 item 8): a slow or failed
lease keep-alive is tried again within the lease instead of ending the session (a new lease, the record
deleted and put again: every peer would see this node leave and join); a watch that went silently dead
is found and the session ends; a lease shorter than three keep-alive timeouts is refused or raised.
The same code against a real etcd: tests/test_membership.py."""

import asyncio

import pytest

from node.config import ConfigError, NodeConfig
from node.runtime import membership
from node.runtime.membership import EtcdError, Membership

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here


class ScriptedGateway:
    """The calls Membership makes, answered from memory: ``keepalive_failures`` keep-alives fail first;
    the watch reports each put of the prefix unless ``dead`` (then it stays silent, as a half-open stream)."""

    def __init__(self, keepalive_failures: int = 0, dead: bool = False):
        self.keepalive_failures = keepalive_failures
        self.dead = dead
        self.grants = self.keepalives = 0
        self.puts: list[str] = []
        self._on_event = self._heard = None

    async def grant(self, ttl_s):
        self.grants += 1
        return str(self.grants)

    async def keepalive(self, lease, timeout_s=None):
        self.keepalives += 1
        if self.keepalive_failures:
            self.keepalive_failures -= 1
            raise asyncio.TimeoutError()
        return 6

    async def put(self, key, value, lease=None):
        self.puts.append(key)
        if not self.dead and self._heard is not None:
            self._heard()
            self._on_event("PUT", key, value)

    async def get_prefix(self, prefix):
        return 1, {}

    async def watch(self, prefix, start_revision, on_event, heard=None):
        self._on_event, self._heard = on_event, heard
        await asyncio.Event().wait()

    async def revoke(self, lease):
        pass

    async def close(self):
        pass


def _membership(gateway, ttl_s: float = 6) -> Membership:
    m = Membership("http://etcd.invalid:2379", "/t", "a", {"node_id": "a", "kv": None}, ttl_s, lambda _: None, lambda _: None)
    m.gateway = gateway
    return m


def test_a_failed_keepalive_is_tried_again_within_the_lease():
    async def main():
        gw = ScriptedGateway(keepalive_failures=2)
        m = _membership(gw)
        m.start()
        await asyncio.sleep(m.ttl_s / 3 + 1.0)  # the first keep-alive round: two failures, then a success
        assert gw.keepalives >= 3
        assert (m.sessions, gw.grants, m.state) == (1, 1, "registered")  # the same lease: no leave and join
        await m.close()

    asyncio.run(main())


def test_a_silently_dead_watch_ends_the_session(monkeypatch):
    monkeypatch.setattr(membership, "QUIET_S", 0.3, raising=False)
    monkeypatch.setattr(membership, "ECHO_S", 0.3, raising=False)

    async def main():
        dead, alive = ScriptedGateway(dead=True), ScriptedGateway()
        m, ok = _membership(dead), _membership(alive)
        m.start()
        ok.start()
        await asyncio.sleep(2.0)
        assert dead.grants >= 2 and m.sessions >= 2  # quiet, no echo of its own put: a new session read the prefix again
        assert alive.grants == 1 and ok.sessions == 1 and len(alive.puts) >= 3  # quiet but echoed: kept
        await m.close()
        await ok.close()

    asyncio.run(main())


def test_a_lease_shorter_than_three_keepalive_timeouts_is_refused_or_raised():
    base = dict(mode="pooled", prefill_devices=["cpu:0"], etcd="http://127.0.0.1:2379", peer_secret="s")
    with pytest.raises(ConfigError, match="--etcd-lease-ttl-s must be at least 3 keep-alive timeouts"):
        NodeConfig(**base, etcd_lease_ttl_s=5).validate()
    NodeConfig(**base, etcd_lease_ttl_s=6).validate()
    assert _membership(ScriptedGateway(), ttl_s=2).ttl_s == 6  # in-process callers: raised, with a warning

