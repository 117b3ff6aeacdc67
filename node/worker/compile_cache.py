"""Where compiled steps persist between starts: a cache directory per model, configuration and versions.

Inductor keeps what it generates on disk (its FX graph cache, the AOTAutograd cache, the compiled C++
libraries and, on CUDA, Triton's kernels) under ``TORCHINDUCTOR_CACHE_DIR`` (``/tmp/torchinductor_$USER``
by default). An engine that compiles points that directory into ``--compile-cache-dir`` (default
``~/.cache/shiftnode``, or ``$XDG_CACHE_HOME/shiftnode``), under ``inductor/<key>``, so a second start
with the same model and configuration finds its graphs there and compiles nothing (a warm start: tracing
and a cache load per bucket).

The key (:func:`cache_key`) is a hash of what makes a graph differ: the model's ``config.json`` (its
geometry; the weights are inputs of the graph, not constants, so other weights of the same geometry share
it), the dtype, the KV pool's shape (static shapes: the block count is in every graph), the attention
backend, the inductor options, the device kind and CPU capability, and the torch, triton and shiftnode
versions. Inductor's own cache keys stay the judge of correctness (they hash the graph itself); the
directory keeps starts of different models or versions apart, so an old one can be deleted as a whole.
``key.json`` beside the artifacts says what a directory holds.

Engines of one node (and nodes on one host) sharing ``--compile-cache-dir`` compile one bucket at a time
(:func:`compile_lock`, an advisory ``flock`` on ``compile.lock`` there): a second engine of the same model
then loads what the first compiled instead of compiling it again beside it, and engines of different
models do not compile at once on the same cores.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from importlib import metadata
from pathlib import Path
from typing import Any, Iterator

import torch

CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
"""Inductor's cache directory (read by ``torch._inductor.runtime.cache_dir_utils.cache_dir`` at each use)."""


def default_cache_root() -> Path:
    """``$XDG_CACHE_HOME/shiftnode`` when that variable is set, else ``~/.cache/shiftnode``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "shiftnode"


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def cache_facts(model_folder: str, dtype: torch.dtype, kv_shape: tuple[int, ...], backend: str,
                options: dict, device: torch.device) -> dict[str, Any]:
    """What :func:`cache_key` hashes (module doc), as a JSON-ready dict. ``model_folder``: the checkpoint
    folder (its ``config.json`` is read; a folder without one keys by its path)."""
    cfg = Path(model_folder) / "config.json"
    model = hashlib.sha256(cfg.read_bytes()).hexdigest()[:16] if cfg.is_file() else str(Path(model_folder).resolve())
    return {
        "model": Path(model_folder).name, "model_config": model, "dtype": str(dtype).removeprefix("torch."),
        "kv_shape": list(kv_shape), "attention_backend": backend,
        "inductor_options": {k: options[k] for k in sorted(options)},
        "device": device.type, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__, "triton": _version("triton"), "shiftnode": _version("shiftnode"),
    }


def cache_key(facts: dict[str, Any]) -> str:
    """16 hex digits of the SHA-256 of ``facts`` (:func:`cache_facts`) as canonical JSON."""
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]


def use_cache_dir(root: str | Path, facts: dict[str, Any]) -> Path:
    """Make ``root/inductor/<key>`` (:func:`cache_key` of ``facts``) this process's inductor cache (and
    Triton's, under it) and write its ``key.json``. Call before the first compilation in the process:
    a few of inductor's paths (its lock directory) are fixed at their first use. Returns the directory.

    Raises:
        OSError: the directory cannot be created or written.
    """
    path = Path(root).expanduser() / "inductor" / cache_key(facts)
    path.mkdir(parents=True, exist_ok=True)
    key_file = path / "key.json"
    if not key_file.exists():
        tmp = path / f".key.{os.getpid()}.json"
        tmp.write_text(json.dumps(facts, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, key_file)
    os.environ[CACHE_ENV] = str(path)
    os.environ["TRITON_CACHE_DIR"] = str(path / "triton")
    return path


LOCK_FILE = "compile.lock"


@contextlib.contextmanager
def compile_lock(root: str | Path | None) -> Iterator[None]:
    """Hold ``root/compile.lock`` (``root``: the ``--compile-cache-dir``; an exclusive ``flock``, released by
    the kernel if the process dies) while compiling one bucket; without a directory, nothing.

    Raises:
        OSError: the lock file cannot be created.
    """
    if root is None:
        yield
        return
    Path(root).mkdir(parents=True, exist_ok=True)
    fd = os.open(Path(root) / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock
