"""Benchmark models (``--benchmark-model``): stand-ins for :class:`~node.worker.model.CausalLM` that
cost (almost) nothing, to measure the node's own host overhead. Their outputs are meaningless.

* ``zero``: no compute. ``forward`` writes each token's position into a preallocated hidden buffer;
  ``compute_logits`` looks up one of ``CYCLE`` fixed float32 logit rows by that position. Row ``p``'s
  argmax is the ``p``-th of a list of ordinary text tokens (never EOS or special), so greedy streams
  run to ``max_tokens`` and decode to real text; every ordinary token has a finite, spread-out logit,
  so sampling at ``temperature > 0`` (and ``top_p``) has a non-degenerate distribution. Other tokens
  sit ``EXCLUDED_LOGIT`` below and are practically never drawn.
* ``sleep:MS``: the same, but every ``forward`` first sleeps ``MS`` milliseconds (``time.sleep``
  releases the GIL, so it behaves like a device step seen from the host).
* ``timed:PATH``: the same model as ``zero``; the engine core then makes every step last the time the
  cost model in ``PATH`` gives its work, counted from the step's start (:mod:`node.worker.timed_step`,
  the idea of NVIDIA Dynamo's mocker engine), and the loader allocates a KV pool of one element per
  block, layer and K/V while the ledger counts the geometry's blocks (:func:`node.worker.loader.build_runner`).

No weights are loaded; the KV pool is still allocated (tiny for ``timed``) and the batcher's accounting is real.
"""

from __future__ import annotations

import time
from typing import Any

import structlog
import torch
from torch import nn

from node.config import benchmark_sleep_ms
from node.worker.model_config import ModelConfig

log = structlog.get_logger("shiftnode.benchmark_model")

CYCLE = 64  # distinct logit rows; greedy output repeats with this period (tokens)
MAX_CANDIDATES = 4096  # token ids inspected for "ordinary text" (spread over the tokenizer's vocabulary)
TOP_MARGIN = 3.0  # argmax logit above the largest other logit
EXCLUDED_LOGIT = -30.0  # EOS, special and non-text tokens (finite: logprobs stay defined)


class BenchmarkLM(nn.Module):
    """A ``CausalLM``-shaped module with no weights (see the module docstring).

    Args:
        cfg: the real model's config (``vocab_size`` and ``hidden_size`` are used).
        token_ids: ordinary text tokens, in the order greedy decoding cycles through them.
        device: where the buffers live.
        sleep_ms: milliseconds each ``forward`` sleeps (0: none).
        ops: the node's kernel ops (kept as ``ops`` for the CUDA-graph code, never called).
        rows: initial hidden-buffer rows (tokens per step; grows on demand).
    """

    def __init__(self, cfg: ModelConfig, token_ids: list[int], device: torch.device, *, sleep_ms: float = 0.0,
                 ops: Any = None, rows: int = 2048, seed: int = 0):
        super().__init__()
        if not token_ids:
            raise ValueError("the benchmark model needs at least one ordinary text token")
        self.cfg = cfg
        self.ops = ops
        self.sleep_s = sleep_ms / 1e3
        self.device = device
        self._hidden = torch.zeros(rows, cfg.hidden_size, dtype=torch.float32, device=device)
        self.logit_table = _logit_table(cfg.vocab_size, token_ids, seed).to(device)  # [CYCLE, V] float32

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, meta: Any) -> torch.Tensor:
        """→ hidden ``[T, hidden_size]`` float32 whose column 0 is ``position % CYCLE`` (a view of a
        buffer reused by the next call). Sleeps ``sleep_ms`` first."""
        if self.sleep_s:
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("the sleep benchmark model cannot be captured in a CUDA graph (steps run eagerly)")
            time.sleep(self.sleep_s)
        t = positions.shape[0]
        if t > self._hidden.shape[0]:
            self._hidden = torch.zeros(t, self._hidden.shape[1], dtype=torch.float32, device=self.device)
        hidden = self._hidden[:t]
        hidden[:, 0].copy_(positions % CYCLE)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden rows ``[N, hidden_size]`` → a new float32 ``[N, vocab_size]`` (fixed rows by position)."""
        return self.logit_table.index_select(0, hidden[:, 0].long())


def _logit_table(vocab_size: int, token_ids: list[int], seed: int) -> torch.Tensor:
    """``[CYCLE, vocab_size]`` float32: ordinary tokens get N(0, 1) noise, others ``EXCLUDED_LOGIT``;
    row ``p``'s argmax is ``token_ids[p % len(token_ids)]``, ``TOP_MARGIN`` above the rest."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor(token_ids, dtype=torch.int64)
    base = torch.full((vocab_size,), EXCLUDED_LOGIT)
    base[ids] = torch.randn(len(token_ids), generator=g)
    table = base.repeat(CYCLE, 1)
    top = ids[torch.arange(CYCLE) % len(token_ids)]
    table[torch.arange(CYCLE), top] = float(base.max()) + TOP_MARGIN
    return table


def ordinary_tokens(tokenizer: Any, vocab_size: int, stop_ids: set[int]) -> list[int]:
    """Ids whose text is a plain word or letter (printable, alphabetic once stripped, not special, not in
    ``stop_ids``) among ``MAX_CANDIDATES`` spread evenly over the vocabulary; multi-letter ones first."""
    n = min(vocab_size, tokenizer.vocab_size)
    stride = max(1, n // MAX_CANDIDATES)
    skip = set(stop_ids) | set(getattr(tokenizer, "special_ids", ()))
    out = []
    for i in range(0, n, stride):
        if i in skip:
            continue
        text = tokenizer.decode([i], skip_special_tokens=False)
        if text.isprintable() and text.strip().isalpha():
            out.append((len(text.strip()) < 2, i))
    return [i for _, i in sorted(out)]  # words before single letters: greedy text reads more like text


def build_benchmark_model(spec: str, cfg: ModelConfig, tokenizer: Any, device: torch.device, *, ops: Any = None,
                          rows: int = 2048, seed: int = 0, device_id: str = "") -> BenchmarkLM:
    """The ``--benchmark-model`` ``spec`` for one device (logs a warning: outputs are meaningless)."""
    sleep_ms = benchmark_sleep_ms(spec)
    stop = set(tokenizer.eos_token_ids) | set(cfg.eos_token_ids)
    ids = ordinary_tokens(tokenizer, cfg.vocab_size, stop)
    model = BenchmarkLM(cfg, ids, device, sleep_ms=sleep_ms, ops=ops, rows=rows, seed=seed)
    log.warning("BENCHMARK_MODEL", device=device_id, benchmark_model=spec, sleep_ms=sleep_ms,
                vocab_size=cfg.vocab_size, text_tokens=len(ids),
                message="BENCHMARK MODEL IN USE: no weights, fixed logits; outputs are meaningless (bench tool only)")
    return model
