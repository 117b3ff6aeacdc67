"""Fingerprint of what decides a node's KV bytes: weights, tokenizer and config, hashed once at load.

Two nodes may exchange a sequence's KV cache only if the receiver would have computed the same bytes
and will continue the sequence the same way. The cache geometry (:class:`~node.transport.Layout`)
is not enough: a node serving a checkpoint with one changed weight, in a folder of the same name,
has the same geometry and would silently continue sequences with another model (vLLM #42895). The
:class:`~node.transport.protocol.Fingerprint` in every handshake closes that gap.

Weights (``weights``), SHA-256 over, per tensor in name order: name, dtype, shape, byte length, then
its bytes. Tensors are hashed in name order rather than file order, so the same tensors sharded
differently hash the same.

* Checkpoints up to :data:`FULL_HASH_MAX_BYTES` (256 MiB) hash every byte (SHA-256 measured at
  ~0.9 GB/s on this project's CPU box, so at most ~0.3 s, from the page cache the loader just
  filled; stories260k takes 2 ms): any change is caught.
* Larger checkpoints hash each tensor's safetensors header entry (dtype, shape, byte range) and
  :data:`SAMPLE_WINDOWS` windows of :data:`SAMPLE_BYTES` spread evenly over its bytes (first and
  last included). The cost is bounded by the number of tensors, not by the checkpoint's size (a 70B
  checkpoint's ~700 tensors read ~23 MB instead of 140 GB), and it still tells apart any two real
  checkpoints: another model, a fine-tune or a further training step changes essentially every
  element, so every window differs; a re-quantisation or dtype change alters headers. What it can
  miss is a deliberate edit confined to bytes outside every window of a checkpoint above the bound.
* Random weights (``--load-format dummy``) hash the parameters the
  node actually drew, the same way (all bytes up to the bound, windows above it). Hashing the seed
  and config instead would not be sound: the same seed draws different weights on the CPU and on a
  GPU, and on a GPU the draw depends on the device's SM count and the torch version.

Tokenizer (``tokenizer``): SHA-256 of tokenizer.json's bytes (the byte-level tokenizer a benchmark
model's config-only folder gets, which is built by code: its name) and the end-of-sequence ids, which decide where the receiver stops.
Config (``config``): SHA-256 of config.json as canonical JSON (sorted keys), so formatting does not
matter. ``digest`` covers the three plus the KV dtype, the block size and the protocol version.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any, Iterable

from node.transport.protocol import PROTOCOL_VERSION, Fingerprint

FULL_HASH_MAX_BYTES = 256 << 20  # checkpoints up to this size hash every byte
SAMPLE_WINDOWS = 8  # per tensor, above the bound
SAMPLE_BYTES = 4096
_CHUNK_BYTES = 8 << 20


class FingerprintError(ValueError):
    """A checkpoint file cannot be read as safetensors."""


def _windows(nbytes: int) -> list[tuple[int, int]]:
    """Byte ranges ``[start, end)`` sampled from a tensor of ``nbytes`` bytes (all of it if small)."""
    if nbytes <= SAMPLE_WINDOWS * SAMPLE_BYTES:
        return [(0, nbytes)]
    span = nbytes - SAMPLE_BYTES
    return [(span * k // (SAMPLE_WINDOWS - 1), span * k // (SAMPLE_WINDOWS - 1) + SAMPLE_BYTES)
            for k in range(SAMPLE_WINDOWS)]


def _tensor_head(h: Any, name: str, dtype: str, shape: list[int], nbytes: int) -> None:
    h.update(json.dumps([name, dtype, list(shape), nbytes]).encode() + b"\0")


def read_safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    """The JSON header of a safetensors file and the offset (bytes) where its data starts.

    Format: an 8-byte little-endian header length N, N bytes of JSON mapping each tensor name to
    ``{"dtype", "shape", "data_offsets": [begin, end]}`` (relative to the data start), then the data.

    Raises:
        FingerprintError: the file is too short or its header is not such JSON.
    """
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise FingerprintError(f"{path} is too short for a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > 100 << 20:
            raise FingerprintError(f"{path}: safetensors header of {n} bytes is implausible")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise FingerprintError(f"{path}: safetensors header is not JSON: {e}") from e
    if not isinstance(header, dict):
        raise FingerprintError(f"{path}: safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    return header, 8 + n


def safetensors_digest(files: list[Path], full_max_bytes: int = FULL_HASH_MAX_BYTES) -> str:
    """SHA-256 hex of a checkpoint's tensors (see the module docstring: every byte when the files
    total at most ``full_max_bytes``, else header entries plus sampled windows per tensor).

    Raises:
        FingerprintError: a file's header cannot be read; OSError: a file cannot be opened.
    """
    tensors = []  # (name, path, data start, entry)
    for path in files:
        header, start = read_safetensors_header(path)
        tensors += [(name, path, start, entry) for name, entry in header.items()]
    full = sum(p.stat().st_size for p in files) <= full_max_bytes
    h = hashlib.sha256(b"safetensors|full" if full else b"safetensors|sampled")
    handles: dict[Path, Any] = {}
    try:
        for name, path, start, entry in sorted(tensors, key=lambda t: t[0]):
            try:
                begin, end = (int(x) for x in entry["data_offsets"])
                dtype, shape = str(entry["dtype"]), [int(x) for x in entry["shape"]]
            except (KeyError, TypeError, ValueError) as e:
                raise FingerprintError(f"{path}: malformed header entry for {name!r}: {e}") from e
            _tensor_head(h, name, dtype, shape, end - begin)
            f = handles.get(path) or handles.setdefault(path, open(path, "rb"))
            ranges = [(0, end - begin)] if full else _windows(end - begin)
            for a, b in ranges:
                f.seek(start + begin + a)
                left = b - a
                while left > 0:
                    chunk = f.read(min(_CHUNK_BYTES, left))
                    if not chunk:
                        raise FingerprintError(f"{path}: tensor {name!r} runs past the end of the file")
                    h.update(chunk)
                    left -= len(chunk)
    finally:
        for f in handles.values():
            f.close()
    return h.hexdigest()


def tensors_digest(named: Iterable[tuple[str, Any]], full_max_bytes: int = FULL_HASH_MAX_BYTES) -> str:
    """SHA-256 hex of in-memory torch tensors (any device; e.g. ``model.named_parameters()``): every
    byte when they total at most ``full_max_bytes``, else ``SAMPLE_WINDOWS`` windows per tensor.
    Only the sampled bytes are copied to host memory."""
    import torch

    items = sorted(((n, t.detach()) for n, t in named), key=lambda x: x[0])
    full = sum(t.numel() * t.element_size() for _, t in items) <= full_max_bytes
    h = hashlib.sha256(b"tensors|full" if full else b"tensors|sampled")
    for name, t in items:
        flat = t.contiguous().reshape(-1).view(torch.uint8)
        _tensor_head(h, name, str(t.dtype).removeprefix("torch."), list(t.shape), flat.numel())
        for a, b in ([(0, flat.numel())] if full else _windows(flat.numel())):
            h.update(flat[a:b].cpu().numpy().tobytes())
    return h.hexdigest()


def config_digest(config: dict[str, Any]) -> str:
    """SHA-256 hex of a model config as canonical JSON (sorted keys, no whitespace)."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def tokenizer_digest(tokenizer_json: bytes, eos_token_ids: list[int]) -> str:
    """SHA-256 hex of a tokenizer's serialisation and its end-of-sequence ids."""
    return hashlib.sha256(tokenizer_json + b"\0eos=" + json.dumps(sorted(eos_token_ids)).encode()).hexdigest()


def combine(*, weights: str, tokenizer: str, config: str, dtype: str, block_size: int) -> Fingerprint:
    """The :class:`Fingerprint` of these parts; ``digest`` also covers ``dtype`` (KV), ``block_size``
    (tokens) and :data:`PROTOCOL_VERSION`."""
    whole = f"shiftnode-kv/{PROTOCOL_VERSION}|{dtype}|{block_size}|{weights}|{tokenizer}|{config}"
    return Fingerprint(weights=weights, tokenizer=tokenizer, config=config,
                       digest=hashlib.sha256(whole.encode()).hexdigest())


def model_fingerprint(*, folder: str | Path | None, checkpoint_files: list[Path] | None, model: Any,
                      config: dict[str, Any], eos_token_ids: list[int], dtype: str, block_size: int,
                      full_max_bytes: int = FULL_HASH_MAX_BYTES) -> Fingerprint:
    """A node's fingerprint, computed once after its weights were loaded.

    Args:
        folder: the model folder (its ``tokenizer.json`` is hashed); None, or a folder without one (a
            benchmark model's config-only folder), for the byte-level tokenizer.
        checkpoint_files: the safetensors files the weights were loaded from, or None when the
            weights are random (``--load-format dummy``): then ``model``'s
            parameters are hashed.
        model: a loaded ``torch.nn.Module`` (one device's replica).
        config: the model's config.json as a dict.
        eos_token_ids: the ids at which the node stops a sequence.
        dtype: the KV dtype name (e.g. ``"bfloat16"``); block_size: tokens per KV block.

    Raises:
        FingerprintError, OSError: a checkpoint or tokenizer file cannot be read.
    """
    if checkpoint_files is not None:
        weights = safetensors_digest(checkpoint_files, full_max_bytes)
    else:
        weights = tensors_digest(model.named_parameters(), full_max_bytes)
    tok_file = Path(folder) / "tokenizer.json" if folder is not None else None
    has_file = tok_file is not None and tok_file.is_file()
    tok_bytes = tok_file.read_bytes() if has_file else b"shiftnode-byte-level"
    return combine(weights=weights, tokenizer=tokenizer_digest(tok_bytes, eos_token_ids), config=config_digest(config),
                   dtype=dtype, block_size=block_size)


def node_fingerprint(config: Any, info: Any, model: Any) -> Fingerprint:
    """:func:`model_fingerprint` of a node: ``config`` a :class:`~node.config.NodeConfig`, ``info`` its
    :class:`~node.worker.loader.LoadedModel`, ``model`` one device's loaded model."""
    from node.worker.weights import _tensor_files  # the shards the loader read, in the loader's own resolution

    fmt = "safetensors" if config.load_format == "auto" else config.load_format
    files = _tensor_files(Path(config.model)) if fmt == "safetensors" else None
    eos = info.tokenizer.eos_token_ids or list(info.cfg.eos_token_ids)
    return model_fingerprint(folder=config.model, checkpoint_files=files, model=model, config=info.cfg.raw,
                             eos_token_ids=list(eos), dtype=str(info.dtype).removeprefix("torch."),
                             block_size=config.block_size)
