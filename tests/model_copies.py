"""Copies of the shared stories260k model for tests that need a same-named folder with other contents."""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

from node.transport.fingerprint import read_safetensors_header
from support import STORIES


def copy_model(tmp_path: Path, where: str) -> Path:
    """A copy of stories260k in ``tmp_path/where/stories260k`` (same basename as the original)."""
    dst = tmp_path / where / STORIES.name
    shutil.copytree(STORIES, dst, ignore=shutil.ignore_patterns("tiny_configs"))
    return dst


def change_one_weight(folder: Path, tensor: str = "model.layers.0.mlp.down_proj.weight", element: int = 17) -> None:
    """Add 1 to one element of one tensor, in place in the safetensors file."""
    path = folder / "model.safetensors"
    header, start = read_safetensors_header(path)
    entry = header[tensor]
    size = {"F32": 4, "F16": 2}[entry["dtype"]]
    fmt = {"F32": "<f", "F16": "<e"}[entry["dtype"]]
    with open(path, "r+b") as f:
        f.seek(start + entry["data_offsets"][0] + element * size)
        (x,) = struct.unpack(fmt, f.read(size))
        f.seek(-size, 1)
        f.write(struct.pack(fmt, x + 1.0))
