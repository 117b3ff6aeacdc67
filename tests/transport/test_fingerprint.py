"""The handshake fingerprint: what it hashes (weights, tokenizer, config), that one changed weight in a
same-named folder changes it, that sampled hashing still sees every tensor's header and windows, and
that a TCP handshake between different fingerprints is refused by both sides with a reason code."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import msgspec
import pytest
import torch

from node.transport import KVClient, LayoutMismatch, PeerRefused
from node.transport import fingerprint as fp
from node.transport import protocol as p
from node.transport.peer_auth import client_mac, server_mac
from node.transport.wire import encode, read_msg
from model_copies import change_one_weight, copy_model
from support import STORIES
from transport_fakes import HOST, SECRET, FakeReceiver, random_cache, run

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here


def folder_fingerprint(folder: Path, **kw) -> p.Fingerprint:
    cfg = json.loads((folder / "config.json").read_text())
    return fp.model_fingerprint(folder=folder, checkpoint_files=[folder / "model.safetensors"], model=None, config=cfg,
                                eos_token_ids=[2], dtype="float32", block_size=16, **kw)


def test_one_changed_weight_in_a_same_named_folder_changes_only_the_weights(tmp_path):
    same, changed = copy_model(tmp_path, "a"), copy_model(tmp_path, "b")
    change_one_weight(changed)
    ref, a, b = folder_fingerprint(STORIES), folder_fingerprint(same), folder_fingerprint(changed)
    assert a == ref  # an identical copy elsewhere is the same model
    assert b.weights != ref.weights and (b.tokenizer, b.config) == (ref.tokenizer, ref.config)
    assert b.digest != ref.digest
    with pytest.raises(LayoutMismatch) as ei:
        lay = p.Layout(model_id="stories260k", dtype="float32", block_size=16, num_layers=5, num_kv_heads=4, head_dim=8)
        p.check_compatible(msgspec.structs.replace(lay, fingerprint=ref), msgspec.structs.replace(lay, fingerprint=b))
    assert ei.value.fields == ["weights"] and ei.value.code == "weights"


def test_tokenizer_config_dtype_and_block_size_are_covered(tmp_path):
    ref = folder_fingerprint(STORIES)
    other = copy_model(tmp_path, "t")
    tok = json.loads((other / "tokenizer.json").read_text())
    first = next(iter(tok["model"]["vocab"]))
    tok["model"]["vocab"][first + "x"] = tok["model"]["vocab"].pop(first)
    (other / "tokenizer.json").write_text(json.dumps(tok))
    assert folder_fingerprint(other).tokenizer != ref.tokenizer
    cfg = json.loads((STORIES / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(cfg, indent=4))  # formatting only: the same config
    assert folder_fingerprint(other).config == ref.config
    (other / "config.json").write_text(json.dumps({**cfg, "rope_theta": 500000.0}))
    assert folder_fingerprint(other).config != ref.config
    kw = dict(weights=ref.weights, tokenizer=ref.tokenizer, config=ref.config)
    assert fp.combine(**kw, dtype="float32", block_size=16).digest == ref.digest
    assert fp.combine(**kw, dtype="float16", block_size=16).digest != ref.digest
    assert fp.combine(**kw, dtype="float32", block_size=32).digest != ref.digest


def test_sampled_hashing_above_the_bound_sees_windows_and_headers(tmp_path):
    """With the full-hash bound below the checkpoint size, each tensor contributes its header entry and
    windows at fixed spots (first and last bytes included); a changed dtype/shape header is seen too."""
    folder = copy_model(tmp_path, "s")
    files = [folder / "model.safetensors"]
    ref = fp.safetensors_digest(files, full_max_bytes=1)
    assert ref != fp.safetensors_digest(files)  # the mode is part of the hash
    header, start = fp.read_safetensors_header(files[0])
    name, entry = max(header.items(), key=lambda kv: kv[1]["data_offsets"][1] - kv[1]["data_offsets"][0])
    begin, end = entry["data_offsets"]
    assert end - begin > fp.SAMPLE_WINDOWS * fp.SAMPLE_BYTES  # a tensor that is really sampled
    last = start + end - 1  # inside the last window
    with open(files[0], "r+b") as f:
        f.seek(last)
        byte = f.read(1)
        f.seek(last)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert fp.safetensors_digest(files, full_max_bytes=1) != ref
    windows = fp._windows(end - begin)
    assert windows[0][0] == 0 and windows[-1][1] == end - begin and len(windows) == fp.SAMPLE_WINDOWS


def test_random_weights_hash_what_was_drawn():
    def model(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))

    a, b, c = (fp.tensors_digest(model(s).named_parameters()) for s in (0, 0, 1))
    assert a == b and a != c
    big = model(0)
    sampled = fp.tensors_digest(big.named_parameters(), full_max_bytes=1)
    with torch.no_grad():
        big[0].weight.view(-1)[0] += 1  # the first window of the largest tensor
    assert fp.tensors_digest(big.named_parameters(), full_max_bytes=1) != sampled


def test_a_handshake_between_different_weights_is_refused_on_both_sides():
    fa = fp.combine(weights="a" * 64, tokenizer="t" * 64, config="c" * 64, dtype="float16", block_size=16)
    fb = msgspec.structs.replace(fa, weights="b" * 64)

    async def main():
        refused = []
        rx = FakeReceiver(random_cache())
        rx.layout = msgspec.structs.replace(rx.layout, fingerprint=fa)
        server = rx.server(on_refused=lambda *a: refused.append(a))
        async with server:
            theirs = msgspec.structs.replace(rx.layout, fingerprint=fb)
            with pytest.raises(LayoutMismatch) as ei:  # we see it first and say why
                await KVClient.connect(HOST, server.port, SECRET, node_id="other-weights", layout=theirs)
            assert ei.value.code == "weights" and "weights" in str(ei.value)
            # a client that does not check (hello carries its layout): the server refuses after the proof
            reader, writer = await asyncio.open_connection(HOST, server.port)
            hello = p.Hello(version=p.PROTOCOL_VERSION, node_id="raw", nonce=b"n" * 32, layout=theirs)
            writer.write(encode(hello))
            reply = await read_msg(reader, 1 << 20, 2.0)
            writer.write(encode(p.HelloProof(mac=client_mac(SECRET.encode(), hello.nonce, reply.nonce))))
            bye = await read_msg(reader, 1 << 20, 2.0)
            assert isinstance(bye, p.Goodbye) and bye.code == "weights" and "KV layout mismatch" in bye.reason
            writer.close()
            # the same fingerprint is accepted, with the HelloAck
            async with await KVClient.connect(HOST, server.port, SECRET, layout=rx.layout) as ok:
                assert ok.peer_layout == rx.layout
            await asyncio.sleep(0.05)
        assert [(r[1], r[2]) for r in refused] == [("other-weights", "weights"), ("raw", "weights")]

    run(main())


def test_a_server_refusal_reaches_the_client_as_peer_refused_with_its_code():
    """A server that refuses after the proof (here a raw one that sent no layout, so the client could
    not check first): the client raises PeerRefused carrying the server's code."""
    async def serve(reader, writer):
        hello = await read_msg(reader, 1 << 20, 2.0)
        nonce = b"s" * 32
        writer.write(encode(p.HelloReply(version=p.PROTOCOL_VERSION, node_id="strict", nonce=nonce,
                                         mac=server_mac(SECRET.encode(), hello.nonce, nonce))))
        await read_msg(reader, 1 << 20, 2.0)  # the proof
        writer.write(encode(p.Goodbye(reason="KV layout mismatch (tokenizer: ...)", code="tokenizer")))
        writer.close()

    async def main():
        server = await asyncio.start_server(serve, HOST, 0)
        async with server:
            port = server.sockets[0].getsockname()[1]
            lay = FakeReceiver(random_cache()).layout
            with pytest.raises(PeerRefused) as ei:
                await KVClient.connect(HOST, port, SECRET, layout=lay)
            assert ei.value.code == "tokenizer" and "tokenizer" in str(ei.value)

    run(main())
    assert p.AuthError("a").code == "auth" and p.VersionMismatch("v").code == "version"
    assert p.mismatch_code(["head_dim", "weights"]) == "layout" and p.mismatch_code(["config", "weights"]) == "config"
