"""Speculative decoding's draft model (``--speculative-config '{"model": PATH, "num_speculative_tokens": k}'``):
a small model with the target's vocabulary, run in the engine process beside the target, that proposes
each verify item's ``k`` draft tokens just before the target verifies them.

**Its KV shares the target's block ids.** The draft has its own paged pool,
``[draft layers, 2, num_blocks, block_size, draft KV heads, draft head_dim]``, with the target pool's
``num_blocks`` and ``block_size``, and reads and writes it through the *target's* block tables. So the
node's one block ledger covers both: a block allocated for a sequence holds its target KV in one pool
and its draft KV in the other; the blocks of rejected drafts go back with
:func:`~node.core.spec_plan.roll_back`, and frees, preemptions, moves and hand-offs need no second
ledger. The draft's pool is private to the engine process (not shared with the node), so in-node KV
moves and peer hand-offs copy the target's KV only.

**The draft sees every token the target sees, lazily.** Per sequence it keeps how many leading tokens
have their draft KV in its pool (:attr:`DraftModel.known`). Before it proposes, one batched forward
catches each verify item up from there to its last token (prompt chunks, the tokens kept by earlier
verify steps, tokens decoded while speculation was off); its last row's argmax is the first draft, and
``k - 1`` batched one-token steps give the others. Steps that do not speculate cost the draft nothing.
A sequence new to the engine (an arrival by move or hand-off, a recompute after preemption, an engine
revived after a crash) starts at 0, so its draft KV is recomputed on arrival, at its first verify step;
a diff that cuts a sequence's tokens or block table cuts :attr:`known` with it.

**Greedy drafts.** Each draft token is the draft model's argmax. Its draft distribution is then a point
mass, under which the target's verification (:mod:`node.worker.spec_verify`: draw from the target, keep
the draft when they agree) is exact speculative sampling for sampled rows, and gives the target's own
tokens for greedy ones; the draft's quality only changes how many drafts are kept.
"""

from __future__ import annotations

import mmap
from typing import NamedTuple

import structlog
import torch

from node.config import NodeConfig
from node.core.sequence import SamplingParams
from node.worker.loader import LoadedModel, StartupError, attach_packed_weights, torch_device
from node.worker.model_config import ModelConfig, ModelConfigError
from node.worker.runner import ModelRunner, SeqInput, StepInput, kv_bytes_per_token_per_rank
from node.worker.sample_request import SampleRequest
from node.worker.weights import build_model, dtype_from_name

log = structlog.get_logger("shiftnode.draft_model")

_GREEDY = SamplingParams(max_tokens=1, temperature=0.0)
_KEY = "--speculative-config model"


class DraftRequest(NamedTuple):
    """One verify item's proposal: ``token_ids`` is the sequence so far (its last token not yet computed
    by the target), ``block_ids`` its block table (covering ``len(token_ids) + k - 1`` tokens), ``k``
    the drafts wanted."""

    seq_id: str
    token_ids: list[int]
    block_ids: list[int]
    k: int


def check_draft_model(config: NodeConfig, info: LoadedModel) -> None:
    """Refuse, before any engine loads, a draft model the target cannot verify: no readable
    ``config.json``, a vocabulary size other than the target's (its token ids would mean other tokens),
    or fewer positions than ``--max-model-len``; and the combinations not built: tensor-parallel groups
    (a group's ranks would each need the draft, and composite prefill steps a draft per instance) and
    ``--benchmark-model`` (no real logits). Nothing to check without the draft-model method.

    Raises:
        StartupError: naming ``--speculative-config model`` and the numbers.
    """
    spec = config.speculative_config
    if spec is None or not spec.uses_draft_model:
        return
    if max(config.tensor_parallel_size, config.decode_tp, config.prefill_tp) > 1:
        raise StartupError(f"{_KEY}: a draft model runs on single-device engines only (not with "
                           "--tensor-parallel-size, --decode-tp or --prefill-tp above 1)")
    if config.benchmark_model:
        raise StartupError(f"{_KEY}: a draft model needs the target's real steps, not --benchmark-model")
    try:
        cfg = ModelConfig.from_folder(spec.model)
    except (ModelConfigError, OSError, ValueError) as e:
        raise StartupError(f"{_KEY} {spec.model!r}: {e}") from e
    if cfg.vocab_size != info.cfg.vocab_size:
        raise StartupError(f"{_KEY} {spec.model!r}: its vocab_size {cfg.vocab_size} differs from the target's "
                           f"{info.cfg.vocab_size}; a draft model must share the target's tokenizer")
    if cfg.max_position_embeddings < info.max_model_len:
        raise StartupError(f"{_KEY} {spec.model!r}: its max_position_embeddings {cfg.max_position_embeddings} is "
                           f"below --max-model-len {info.max_model_len}")


def _zeroed(shape: tuple, dtype: torch.dtype, device: torch.device, keep: list) -> torch.Tensor:
    """A zeroed pool: on the CPU in anonymous pages the kernel zeroes as they are first touched (a pool
    sized for the target's block count costs memory only where blocks are used), kept alive in ``keep``."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
    buf = mmap.mmap(-1, max(nbytes, 1))
    keep.append(buf)
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)


class DraftModel:
    """The draft model of one engine: its runner (weights and paged pool over the target's block ids)
    and, per sequence, how many leading tokens have their draft KV in the pool.

    Args:
        runner: a :class:`ModelRunner` of the draft model whose ``num_blocks`` and ``block_size`` are the
            target runner's.
        pages: what the pool's memory lives in (a CPU pool's anonymous mapping), kept while the draft is.
    """

    def __init__(self, runner: ModelRunner, pages: list | None = None):
        self.runner = runner
        self.known: dict[str, int] = {}
        self._pages = pages or []

    def clear(self) -> None:
        """The engine's state was reset: no sequence's draft KV is known."""
        self.known.clear()

    def forget(self, seq_id: str) -> None:
        """A sequence left the engine or arrived anew (its draft KV, if any, is recomputed)."""
        self.known.pop(seq_id, None)

    def cut(self, seq_id: str, tokens: int) -> None:
        """At most the first ``tokens`` tokens of ``seq_id`` keep their draft KV (its tokens or its block
        table were cut to that many)."""
        if self.known.get(seq_id, 0) > tokens:
            self.known[seq_id] = tokens

    def propose(self, reqs: list[DraftRequest]) -> list[list[int]]:
        """Each request's ``k`` greedy draft tokens, batched over the requests: one catch-up forward over
        every token a sequence's draft KV lacks (its last token's row gives the first draft), then one
        step per further draft. Afterwards every request's tokens are known to the draft (the drafts'
        own KV is counted by :meth:`verified`).

        Returns:
            per request, ``k`` token ids, in request order.
        """
        known = self.known
        rows = []
        for r in reqs:
            n = len(r.token_ids)
            start = min(known.get(r.seq_id, 0), n - 1)  # at least the last token: its row drafts the first
            rows.append(SeqInput(r.seq_id, r.token_ids[start:], start, r.block_ids,
                                 SampleRequest(_GREEDY, r.token_ids, n, 0)))
        drafts: list[list[int]] = [[] for _ in reqs]
        j = 0
        while rows:
            outs = self.runner.execute(StepInput(rows))
            nxt = []
            for i, r in enumerate(reqs):
                if len(drafts[i]) == r.k:  # done (or not asked: k == 0)
                    continue
                drafts[i].append(outs[r.seq_id].token_id)
                if len(drafts[i]) < r.k:
                    n = len(r.token_ids)
                    nxt.append(SeqInput(r.seq_id, [drafts[i][-1]], n + j, r.block_ids,
                                        SampleRequest(_GREEDY, r.token_ids, n, j + 1)))
            rows = nxt
            j += 1
        for r in reqs:
            known[r.seq_id] = len(r.token_ids)
        return drafts

    def verified(self, seq_id: str, length: int, proposed: int, accepted: int) -> None:
        """A verify step of ``seq_id`` (``length`` tokens before it) kept ``accepted`` of its ``proposed``
        drafts: the draft KV of the kept ones that the draft computed (all but the last draft) counts too."""
        if seq_id in self.known:
            self.known[seq_id] = length + min(accepted, proposed - 1)


def build_draft_model(config: NodeConfig, info: LoadedModel, device_id: str, ops: object, num_blocks: int) -> DraftModel:
    """Load ``--speculative-config``'s draft model on ``device_id`` (same ``--load-format``, ``--dtype`` rule
    and ``--seed`` as the target; the target's ``ops``) with a pool of ``num_blocks`` blocks of
    ``--block-size`` tokens in its own geometry. Its steps run eagerly (on a CPU with oneDNN-packed weights
    where they are large enough, :func:`~node.worker.loader.attach_packed_weights`; no compiled buckets,
    no CUDA graphs in this slice).

    Raises:
        StartupError: the draft cannot be loaded (the message names ``--speculative-config model``).
    """
    spec = config.speculative_config
    dev = torch_device(device_id)
    fmt = "safetensors" if config.load_format == "auto" else config.load_format
    try:
        cfg = ModelConfig.from_folder(spec.model)
        dtype = dtype_from_name(config.dtype, cfg)
        model = build_model(cfg, folder=spec.model, load_format=fmt, dtype=dtype, device=dev,
                            max_positions=info.max_model_len, ops=ops, seed=config.seed)
    except (ModelConfigError, OSError, ValueError, KeyError, RuntimeError) as e:
        raise StartupError(f"{_KEY} {spec.model!r}: cannot load it: {type(e).__name__}: {e}") from e
    pages: list = []
    runner = ModelRunner(model, cfg, dev, num_blocks, config.block_size, dtype, seed=config.seed,
                         kv_alloc=lambda shape, dt, d: _zeroed(shape, dt, d, pages))
    attach_packed_weights(runner, config, device_id)
    draft = DraftModel(runner, pages)
    log.info("draft_model_loaded", device=device_id, model=spec.model, layers=cfg.num_layers,
             hidden=cfg.hidden_size, weight_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
             kv_bytes_per_token=kv_bytes_per_token_per_rank(cfg, dtype), kv_blocks=num_blocks,
             num_speculative_tokens=spec.num_speculative_tokens)
    return draft
