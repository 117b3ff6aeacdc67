"""Two-sided placement of pooled mode, on hand-made snapshots."""

import pytest

from node.core.pooled import PlacePooled, PoolDevice, PooledRouter, PoolSnapshot
from node.core.roles import Reject, WaitingPrompt

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here


def dev(name, free, total=100, **kw):
    return PoolDevice(device_id=name, kv_free_blocks=free, kv_total_blocks=total, block_size=16, **kw)


def test_places_on_least_loaded_prefill_and_roomiest_decode_and_reserves():
    snap = PoolSnapshot(prefill=(dev("p0", 50, queued_tokens=500), dev("p1", 50)),
                        decode=(dev("d0", 20), dev("d1", 60)),
                        waiting=(WaitingPrompt("a", 100, 0.0, 60),))
    (d,) = PooledRouter(8).decide(snap)
    assert d == PlacePooled("a", "p1", "d1", prefill_blocks=7, decode_blocks=10)


def test_decode_saturation_stops_placement_fifo():
    snap = PoolSnapshot(prefill=(dev("p0", 50),), decode=(dev("d0", 12),),
                        waiting=(WaitingPrompt("a", 100, 0.0, 60), WaitingPrompt("b", 100, 0.1, 60), WaitingPrompt("c", 10, 0.2, 1)))
    out = PooledRouter(8).decide(snap)
    assert [d.request_id for d in out] == ["a"]  # b needs 10 more decode blocks; c must not overtake it


def test_unsent_bound_and_reservations_count():
    snap = PoolSnapshot(prefill=(dev("p0", 50, inflight_seqs=2),), decode=(dev("d0", 60, kv_reserved_blocks=55),),
                        waiting=(WaitingPrompt("a", 10, 0.0, 5),))
    assert PooledRouter(2).decide(snap) == []  # the prefill device already holds 2 unsent/in-flight
    assert PooledRouter(8).decide(snap) == [PlacePooled("a", "p0", "d0", 1, 1)]
    tight = PoolSnapshot(prefill=(dev("p0", 50),), decode=(dev("d0", 60, kv_reserved_blocks=60),), waiting=snap.waiting)
    assert PooledRouter(8).decide(tight) == []


def test_prompt_too_big_for_any_device_is_rejected():
    snap = PoolSnapshot(prefill=(dev("p0", 10, total=10),), decode=(dev("d0", 10, total=10),),
                        waiting=(WaitingPrompt("big", 400, 0.0, 5), WaitingPrompt("ok", 10, 0.1, 5)))
    out = PooledRouter(8).decide(snap)
    assert out[0] == Reject("big", "prompt does not fit the KV memory of any device")
    assert isinstance(out[1], PlacePooled) and out[1].request_id == "ok"


def test_more_sequences_than_the_unsent_bound_wait_for_an_empty_prefill_device():
    # n=2 under --max-unsent 1 was never placed and never rejected, and held every prompt behind it.
    two = WaitingPrompt("n2", 10, 0.0, 5, seqs=2)
    busy = PoolSnapshot(prefill=(dev("p0", 50, inflight_seqs=1),), decode=(dev("d0", 60),), waiting=(two,))
    assert PooledRouter(1).decide(busy) == []  # it waits while the device holds anything
    idle = PoolSnapshot(prefill=(dev("p0", 50),), decode=(dev("d0", 60),),
                        waiting=(two, WaitingPrompt("b", 10, 0.1, 5)))
    out = PooledRouter(1).decide(idle)
    assert [d.request_id for d in out] == ["n2"] and isinstance(out[0], PlacePooled)  # b waits behind it


def test_a_backed_up_link_counts_as_prefill_work():
    # Copies overlap prefill, so an idle prefill device may still have KV queued on its link.
    snap = PoolSnapshot(prefill=(dev("p0", 50, outgoing_tokens=900), dev("p1", 50, queued_tokens=100)),
                        decode=(dev("d0", 60),), waiting=(WaitingPrompt("a", 100, 0.0, 5),))
    (d,) = PooledRouter(8).decide(snap)
    assert d.prefill_device == "p1"
