"""Wire types, layout check, sequence validation, MACs and the throttle's arithmetic (no I/O)."""

from __future__ import annotations

import msgspec
import pytest

from node.transport import peer_auth
from node.transport import protocol as p
from node.transport.throttle import LinkThrottle
from node.transport.wire import _DEC, encode

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here

LAYOUT = p.Layout(model_id="m", dtype="bfloat16", block_size=16, num_layers=4, num_kv_heads=2, head_dim=64)


def seq(**kw):
    base = dict(request_id="r", seq_id="r-0", token_ids=list(range(21)), prompt_len=20, num_computed=20, max_len=100)
    return p.SeqState(**{**base, **kw})


def test_check_compatible_names_every_differing_field():
    p.check_compatible(LAYOUT, msgspec.structs.replace(LAYOUT))
    other = msgspec.structs.replace(LAYOUT, dtype="float16", head_dim=128)
    with pytest.raises(p.LayoutMismatch) as ei:
        p.check_compatible(LAYOUT, other)
    assert ei.value.fields == ["dtype", "head_dim"]
    assert "dtype: 'bfloat16' != 'float16'" in str(ei.value) and "head_dim: 64 != 128" in str(ei.value)


def test_layout_sizes_and_validation():
    assert LAYOUT.block_bytes == 2 * 16 * 2 * 64 * 2
    assert LAYOUT.layer_bytes(3) == 3 * LAYOUT.block_bytes
    with pytest.raises(ValueError, match="unknown KV dtype"):
        p.Layout(model_id="m", dtype="complex64", block_size=16, num_layers=1, num_kv_heads=1, head_dim=1)
    with pytest.raises(ValueError, match="block_size"):
        p.Layout(model_id="m", dtype="float16", block_size=0, num_layers=1, num_kv_heads=1, head_dim=1)


def test_every_message_round_trips_through_a_frame():
    s = seq()
    msgs = [
        p.Hello(version=1, node_id="a", nonce=b"n" * 32, layout=LAYOUT),
        p.HelloReply(version=1, node_id="b", nonce=b"m" * 32, mac=b"x" * 32),
        p.Hello(version=2, node_id="a", nonce=b"n" * 32, layout=msgspec.structs.replace(LAYOUT, fingerprint=p.Fingerprint(
            weights="w" * 64, tokenizer="t" * 64, config="c" * 64, digest="d" * 64))),
        p.HelloProof(mac=b"y" * 32), p.HelloAck(), p.Goodbye(reason="bye"), p.Goodbye(reason="no", code="weights"),
        p.Heartbeat(n=3),
        p.TransferOffer(transfer_id="t", layout=LAYOUT, seq=s, num_blocks=2, nbytes_per_layer=LAYOUT.layer_bytes(2)),
        p.TransferAccept(transfer_id="t"), p.TransferRefuse(transfer_id="t", code="no_room", reason="full"),
        p.LayerHeader(transfer_id="t", layer=0, nbytes=10, checksum=123), p.TransferDone(transfer_id="t"),
        p.TransferCommitted(transfer_id="t"), p.TransferAbort(transfer_id="t", reason="x"),
    ]
    for m in msgs:
        frame = encode(m)
        assert int.from_bytes(frame[:4], "big") == len(frame) - 4
        assert _DEC.decode(frame[4:]) == m


def test_seq_state_problems():
    assert seq().problems(16, 2) == []
    assert "num_computed 19 != len(token_ids)-1" in seq(num_computed=19).problems(16, 2)[0]
    assert any("num_blocks 1" in x for x in seq().problems(16, 1))  # 20 cached tokens need 2 blocks
    assert any("max_len" in x for x in seq(max_len=10).problems(16, 2))
    assert any("prompt_len" in x for x in seq(prompt_len=0).problems(16, 2))
    # a partially prefilled sequence (no output yet) may carry fewer cached tokens
    assert seq(token_ids=list(range(20)), num_computed=16).problems(16, 1) == []
    offer = p.TransferOffer(transfer_id="t", layout=LAYOUT, seq=seq(), num_blocks=2, nbytes_per_layer=5)
    assert any("nbytes_per_layer 5" in x for x in p.offer_problems(offer))


def test_macs_are_directional_and_keyed():
    a, b = b"a" * 32, b"b" * 32
    assert peer_auth.server_mac(b"k", a, b) != peer_auth.client_mac(b"k", a, b)
    assert peer_auth.server_mac(b"k", a, b) != peer_auth.server_mac(b"K", a, b)
    assert peer_auth.mac_ok(peer_auth.client_mac(b"k", a, b), peer_auth.client_mac(b"k", a, b))
    with pytest.raises(ValueError):
        peer_auth.secret_bytes("")


def test_throttle_paces_to_line_rate_on_a_manual_clock():
    now = [0.0]
    link = LinkThrottle(1.0, clock=lambda: now[0])  # 1 Gb/s = 125e6 B/s
    assert link.take(125_000_000) == pytest.approx(1.0)
    assert link.take(125_000_000) == pytest.approx(2.0)  # queued behind the first
    now[0] = 10.0  # idle: no banked credit without burst_bytes
    assert link.take(12_500_000) == pytest.approx(0.1)
    burst = LinkThrottle(1.0, burst_bytes=125_000_000, clock=lambda: now[0])
    assert burst.take(12_500_000) == pytest.approx(0.1)  # a new link has banked nothing
    now[0] = 20.0  # idle for a while
    assert burst.take(125_000_000) == 0.0  # one burst's worth goes at once after idling
    assert burst.take(125_000_000) == pytest.approx(1.0)
    # a paced sender whose sleeps overshoot catches up within the burst: no drift from line rate
    paced = LinkThrottle(1.0, burst_bytes=1_250_000, clock=lambda: now[0])  # 10 ms of credit
    start = now[0]
    for _ in range(10):
        now[0] += paced.take(12_500_000) + 0.001  # each 100 ms chunk's sleep overshoots by 1 ms
    assert now[0] - start == pytest.approx(1.0 + 0.001)  # only the last overshoot remains
