"""Roofline step-time cost model: a step's time from the bytes it moves and the FLOPs it does.

Pure arithmetic (stdlib + msgspec). :class:`RooflineCost` has the interface of
:class:`node.core.cost.CostModel` (``prefill_step_s``, ``prefill_s``, ``prefill_tokens_within``,
``decode_step_s``, ``mixed_step_s``, ``with_host_overhead``, ``pause_s``), so the role scheduler, the
imbalance policy, the virtual devices and the simulator take either. The geometry terms come from a
model config and the hardware terms from measurements: ``bench/cost/derive_cost.py`` builds one, calibrated
on the H200 runs of ``bench/RESULTS.md``. The method is the roofline of Williams, Waterman and
Patterson (*Roofline: an insightful visual performance model for multicore architectures*, CACM 52(4),
2009): a kernel takes the longer of its bytes over the achieved memory bandwidth and its FLOPs over the
achieved compute rate.

One forward pass (per tensor-parallel rank; all ranks run in parallel, so the rank's time is the
step's) over ``n`` prompt tokens with ``c`` of the prompt already cached, and ``s`` decode sequences
holding ``K`` cached tokens in all (their new tokens included), ``T = n + s`` tokens, ``r`` rows of
logits (``s``, plus 1 when there is prompt work: the prompt's last token), ``D`` the TP degree:

* GEMMs: ``max(weight_bytes / BW, (2 * layer_params * T + 2 * vocab * hidden * r) / D / P_mm)`` — every
  weight read once per pass; 2 FLOP per parameter per token (the embedding table is a gather: neither);
* attention: ``max(kv_bytes_per_token * (c + n + K) / BW, A / P_attn)`` with
  ``A = 4 * layers * q_dim / D * (n*c + n*(n+1)/2 + K)``: QK^T and PV each cost ``2 * q_dim`` FLOP per
  (query token, attended token) pair per layer; a prompt token ``i`` (1-based) attends to the ``c``
  cached tokens and ``i`` of its own (causal), a decode token to its sequence's whole context;
* elementwise passes: ``activation_bytes_per_token * T / BW`` (norms, rotary, SiLU-and-mul, cache
  writes: separate kernels in this node, so not hidden under the GEMMs);
* the three run one after another (separate kernels), so the device time is their **sum**, each its
  own roofline — a single ``max`` over the pass's total bytes and FLOPs would let a prefill's attention
  and elementwise traffic hide under its GEMMs, which they do not;
* launch: a CUDA-graph replay (decode, ``s <= max_graph_batch``) adds ``graph_launch_s``; an eager pass
  (prefill, mixed, decode above the largest bucket) issues the same kernels one launch each, so it takes
  ``max(device + graph_launch_s, eager_launch_s)``: the GPU idles between launches until its work per
  kernel outlasts the host's issue time (H200: eager decode B=16 and B=64 both take ~14-15 ms while
  their graph replays take 5.4 and 6.7 ms; at B=256 eager is within 6% of the graph step);
* piecewise CUDA graphs (vLLM V1's mixed and prefill steps: the model captured in pieces between the
  attention calls, attention run eagerly): a pass of at most ``piecewise_max_tokens`` tokens that is not a
  full graph replay takes ``max(device + graph_launch_s, piecewise_launch_s)``. The host then issues two
  things per layer (the attention call and the next piece's replay) instead of every kernel, so
  :meth:`RooflineCost.with_piecewise_graphs` sets ``piecewise_launch_s = eager_launch_s * 2 /
  EAGER_LAUNCHES_PER_LAYER``: an estimate from the launch count (the node's eager layer issues 11 kernels:
  two norms, four GEMMs, rotary, the cache write, attention, SiLU-and-mul and a copy of V), not a
  measurement; 0 (the default): no piecewise graphs;
* host work outside the forward (inputs, logits to the host, sampling): ``host_s + host_per_seq_s * r``;
* tensor parallel: 2 all-reduces per layer of ``T * hidden * dtype_bytes`` bytes, each over a ring
  ``2 (D-1)/D`` of those bytes on the link plus ``link_latency_s``:
  ``comm = 2 * layers * (2 (D-1)/D * T * hidden * dtype_bytes / link_Bps + link_latency_s)``, 0 for D = 1
  (additive: a collective waits for every rank; the logits' gather is not modelled).

Step = ``host + launch-and-device (above) + comm``, seconds. :meth:`RooflineCost.prefill_step_s` takes the
chunk as a fresh prompt (``c = 0``: its own tokens are its whole context), and so does
:meth:`RooflineCost.prefill_s` for each step of a queue (its callers pass a queue's total, not one
prompt); :meth:`RooflineCost.prompt_prefill_s` charges chunk ``i`` of one prompt's chunked prefill with
the ``i * budget`` tokens before it cached; a mixed step takes its prompt tokens as fresh (the plan's
cost interface does not say how much of the prompt is cached).

:func:`cost_model_from_dict` reads either kind of cost model from its JSON document (``"kind"``:
``"roofline"``, or ``"linear"``/absent for :class:`CostModel`); :func:`cost_model_to_dict` writes one.
"""

from __future__ import annotations

import msgspec

from node.core.cost import CostModel, chunked_s, tokens_within
from node.core.role_config import scatter_bytes

__all__ = ["RooflineCost", "PassWork", "cost_model_from_dict", "cost_model_to_dict", "sum_max_linear",
           "ring_allreduce_link_bytes", "kv_scatter_bytes", "kv_scatter_s", "EAGER_LAUNCHES_PER_LAYER",
           "PIECEWISE_MAX_TOKENS"]

# Kernels the node's eager decoder layer issues (node/worker/model.py: input norm, fused QKV GEMM, rotary,
# cache write, attention, output GEMM, post-attention norm with the residual, fused gate/up GEMM,
# SiLU-and-mul, down GEMM, and the copy of V made contiguous): the eager launch floor is spread over them.
EAGER_LAUNCHES_PER_LAYER = 11
# vLLM V1's largest piecewise CUDA-graph capture size by default (tokens per step); larger steps run without.
PIECEWISE_MAX_TOKENS = 512


class PassWork(msgspec.Struct, frozen=True, kw_only=True):
    """What one forward pass does on one rank: bytes, FLOPs, tokens, logit rows."""

    weight_bytes: float
    gemm_flops: float
    kv_bytes: float
    attention_flops: float
    activation_bytes: float
    tokens: int
    rows: int


class RooflineCost(msgspec.Struct, frozen=True, kw_only=True):
    """Geometry and hardware terms of the roofline step time (see the module doc for the formulas).

    Geometry (counts, or bytes per rank where said): ``layers``, ``hidden``, ``q_dim`` (query heads x
    head_dim), ``vocab``, ``dtype_bytes``, ``layer_params`` (decoder layers' parameters, whole model),
    ``weight_bytes`` (bytes of weights one pass reads per rank: all but the input embedding table),
    ``kv_bytes_per_token`` (per rank, all layers), ``activation_bytes_per_token`` (per rank, all layers,
    elementwise passes), ``tensor_parallel`` (D).

    Hardware: ``hbm_bandwidth_Bps`` (achieved B/s), ``matmul_flops_per_s`` and ``attention_flops_per_s``
    (achieved FLOP/s), ``host_s`` and ``host_per_seq_s`` (s, s per logit row), ``graph_launch_s`` and
    ``eager_launch_s`` (s), ``max_graph_batch`` (largest CUDA-graph bucket; 0: no graphs),
    ``piecewise_max_tokens`` and ``piecewise_launch_s`` (piecewise graphs for prefill and mixed passes of at
    most that many tokens, and their host issue floor, s; 0: none),
    ``link_bandwidth_Bps`` and ``link_latency_s`` (per all-reduce; needed when D > 1), ``pause_s`` (a
    role switch, s).

    Raises:
        ValueError: a non-positive bandwidth or compute rate, D < 1, D > 1 without a link bandwidth, or
            a negative size or time.
    """

    layers: int
    hidden: int
    q_dim: int
    vocab: int
    dtype_bytes: int
    layer_params: int
    weight_bytes: int
    kv_bytes_per_token: int
    activation_bytes_per_token: int
    tensor_parallel: int = 1
    hbm_bandwidth_Bps: float
    matmul_flops_per_s: float
    attention_flops_per_s: float
    host_s: float = 0.0
    host_per_seq_s: float = 0.0
    graph_launch_s: float = 0.0
    eager_launch_s: float = 0.0
    max_graph_batch: int = 0
    piecewise_max_tokens: int = 0
    piecewise_launch_s: float = 0.0
    link_bandwidth_Bps: float = 0.0
    link_latency_s: float = 0.0
    pause_s: float = 0.0

    def __post_init__(self) -> None:
        for f in ("hbm_bandwidth_Bps", "matmul_flops_per_s", "attention_flops_per_s"):
            if not getattr(self, f) > 0:
                raise ValueError(f"{f} must be > 0, got {getattr(self, f)!r}")
        if self.tensor_parallel < 1:
            raise ValueError(f"tensor_parallel must be >= 1, got {self.tensor_parallel}")
        if self.tensor_parallel > 1 and not self.link_bandwidth_Bps > 0:
            raise ValueError("tensor_parallel > 1 needs link_bandwidth_Bps > 0")
        for f in ("layers", "hidden", "q_dim", "vocab", "dtype_bytes", "layer_params", "weight_bytes",
                  "kv_bytes_per_token", "activation_bytes_per_token", "host_s", "host_per_seq_s",
                  "graph_launch_s", "eager_launch_s", "max_graph_batch", "piecewise_max_tokens",
                  "piecewise_launch_s", "link_bandwidth_Bps",
                  "link_latency_s", "pause_s"):
            if getattr(self, f) < 0:
                raise ValueError(f"{f} must be >= 0, got {getattr(self, f)!r}")

    # -- one pass -------------------------------------------------------------------------------------

    def pass_work(self, prompt_tokens: int, prompt_cached: int, decode_seqs: int, context_tokens: int) -> PassWork:
        """Bytes and FLOPs of one pass on one rank (module doc: ``n, c, s, K``)."""
        n, c, s, k = max(0, prompt_tokens), max(0, prompt_cached), max(0, decode_seqs), max(0, context_tokens)
        d = self.tensor_parallel
        t = n + s
        rows = s + (1 if n else 0)
        pairs = n * c + n * (n + 1) / 2 + k  # (query token, attended token) pairs per layer
        return PassWork(
            weight_bytes=float(self.weight_bytes),
            gemm_flops=(2.0 * self.layer_params * t + 2.0 * self.vocab * self.hidden * rows) / d,
            kv_bytes=float(self.kv_bytes_per_token) * (c + n + k),
            attention_flops=4.0 * self.layers * self.q_dim / d * pairs,
            activation_bytes=float(self.activation_bytes_per_token) * t,
            tokens=t, rows=rows,
        )

    def device_s(self, w: PassWork) -> float:
        """Seconds the device spends on ``w`` (no launch, host or link): GEMMs + attention + elementwise."""
        bw = self.hbm_bandwidth_Bps
        return (max(w.weight_bytes / bw, w.gemm_flops / self.matmul_flops_per_s)
                + max(w.kv_bytes / bw, w.attention_flops / self.attention_flops_per_s)
                + w.activation_bytes / bw)

    def comm_s(self, tokens: int) -> float:
        """Seconds of the pass's tensor-parallel all-reduces (0 for D = 1 or no tokens)."""
        d = self.tensor_parallel
        if d == 1 or tokens <= 0:
            return 0.0
        ring_bytes = 2.0 * (d - 1) / d * tokens * self.hidden * self.dtype_bytes
        return 2 * self.layers * (ring_bytes / self.link_bandwidth_Bps + self.link_latency_s)

    def host_step_s(self, rows: int) -> float:
        """Host seconds of a step sampling ``rows`` logit rows."""
        return self.host_s + self.host_per_seq_s * rows

    def pass_s(self, prompt_tokens: int, prompt_cached: int, decode_seqs: int, context_tokens: int, *,
               graph: bool) -> float:
        """Seconds of one step (host + launch-and-device + comm); 0 for no work. ``graph``: a replay."""
        w = self.pass_work(prompt_tokens, prompt_cached, decode_seqs, context_tokens)
        if w.tokens == 0:
            return 0.0
        dev = self.device_s(w) + self.graph_launch_s
        run = dev if graph else max(dev, self.launch_floor_s(w.tokens))
        return self.host_step_s(w.rows) + run + self.comm_s(w.tokens)

    def launch_floor_s(self, tokens: int) -> float:
        """Host issue time of a pass of ``tokens`` tokens that is not a full graph replay (s): the piecewise
        floor up to ``piecewise_max_tokens``, else the eager one."""
        if self.piecewise_launch_s > 0 and tokens <= self.piecewise_max_tokens:
            return self.piecewise_launch_s
        return self.eager_launch_s

    def with_piecewise_graphs(self, max_tokens: int = PIECEWISE_MAX_TOKENS) -> RooflineCost:
        """This model with piecewise CUDA graphs for prefill and mixed passes of at most ``max_tokens``
        tokens, as vLLM V1 runs them (module doc): ``piecewise_launch_s = eager_launch_s * 2 /
        EAGER_LAUNCHES_PER_LAYER``. Decode replays and the device terms are unchanged.

        Raises:
            ValueError: ``max_tokens`` < 1.
        """
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        return msgspec.structs.replace(self, piecewise_max_tokens=max_tokens,
                                       piecewise_launch_s=self.eager_launch_s * 2 / EAGER_LAUNCHES_PER_LAYER)

    # -- the CostModel interface ----------------------------------------------------------------------

    def prefill_step_s(self, tokens: int) -> float:
        """Seconds of one eager prefill step over ``tokens`` prompt tokens of a fresh prompt (0 for none)."""
        return self.pass_s(tokens, 0, 0, 0, graph=False)

    def prefill_s(self, tokens: int, token_budget: int) -> float:
        """Seconds to prefill ``tokens`` queued prompt tokens in eager steps of at most ``token_budget``
        tokens, each step priced as fresh prompt tokens (:meth:`prefill_step_s`), as
        :meth:`CostModel.prefill_s` does.

        The callers (the role scheduler, the imbalance policy) pass a queue's total, which may be many
        short prompts: charging later steps with the whole queue as cached context would inflate their
        attention without bound. For one prompt, :meth:`prompt_prefill_s` charges that context.
        """
        return chunked_s(self.prefill_step_s, tokens, token_budget)

    def prompt_prefill_s(self, tokens: int, token_budget: int) -> float:
        """Seconds to prefill one ``tokens``-token prompt in eager chunks of at most ``token_budget``
        tokens, chunk ``i`` attending to the ``i * budget`` tokens before it.

        Closed form (:func:`sum_max_linear`): every full chunk costs the same but for its attention term,
        which is linear in ``i``, so the sum is a sum of a maximum of linear functions of ``i``.
        """
        if tokens <= 0:
            return 0.0
        b = max(1, token_budget)
        full, rest = divmod(tokens, b)
        total = self.pass_s(rest, full * b, 0, 0, graph=False) if rest else 0.0
        if full:
            w0, w1 = self.pass_work(b, 0, 0, 0), self.pass_work(b, b, 0, 0)
            bw, pa = self.hbm_bandwidth_Bps, self.attention_flops_per_s
            fixed = (max(w0.weight_bytes / bw, w0.gemm_flops / self.matmul_flops_per_s)
                     + w0.activation_bytes / bw + self.graph_launch_s)
            lines = [(self.launch_floor_s(b), 0.0),  # the launch floor
                     (fixed + w0.kv_bytes / bw, (w1.kv_bytes - w0.kv_bytes) / bw),  # KV-read-bound attention
                     (fixed + w0.attention_flops / pa, (w1.attention_flops - w0.attention_flops) / pa)]
            total += full * (self.host_step_s(w0.rows) + self.comm_s(b)) + sum_max_linear(lines, full)
        return total

    def prefill_tokens_within(self, seconds: float, token_budget: int) -> int:
        """Most prompt tokens whose chunked prefill (:meth:`prefill_s`) fits in ``seconds``
        (:func:`node.core.cost.tokens_within`: ``prefill_s`` is monotone in its token count)."""
        return tokens_within(lambda n: self.prefill_s(n, token_budget), seconds)

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        """Seconds of one decode step of ``batch`` sequences with ``context_tokens`` cached in all: a graph
        replay up to ``max_graph_batch`` sequences, an eager pass above (0 for an empty batch)."""
        if batch <= 0:
            return 0.0
        return self.pass_s(0, 0, batch, context_tokens, graph=batch <= self.max_graph_batch)

    def mixed_step_s(self, prompt_tokens: int, decode_seqs: int, context_tokens: int) -> float:
        """Seconds of one colocated step: ``prompt_tokens`` (fresh) prompt tokens and ``decode_seqs``
        decode sequences with ``context_tokens`` cached — one eager pass over the union of the work.
        A pure decode step is :meth:`decode_step_s` (graphs), a pure prompt step :meth:`prefill_step_s`."""
        if decode_seqs <= 0:
            return self.prefill_step_s(prompt_tokens)
        if prompt_tokens <= 0:
            return self.decode_step_s(decode_seqs, context_tokens)
        return self.pass_s(prompt_tokens, 0, decode_seqs, context_tokens, graph=False)

    def with_host_overhead(self, seconds: float) -> RooflineCost:
        """This model with ``seconds`` of host work added to every step (``host_s``); itself for <= 0."""
        if seconds <= 0:
            return self
        return msgspec.structs.replace(self, host_s=self.host_s + seconds)


def ring_allreduce_link_bytes(message_bytes: float, degree: int) -> float:
    """Bytes each rank sends (and receives) in a ring all-reduce of ``message_bytes`` over ``degree``
    ranks: ``2 (D-1)/D x message`` (a reduce-scatter then an all-gather, each ``(D-1)/D`` of the
    message; the bandwidth-optimal all-reduce of Patarasuk and Yuan, "Bandwidth optimal all-reduce
    algorithms for clusters of workstations", J. Parallel Distrib. Comput. 69(2), 2009). 0 for D = 1.
    :meth:`RooflineCost.comm_s` charges the same formula."""
    if degree <= 1:
        return 0.0
    return 2.0 * (degree - 1) / degree * message_bytes


def kv_scatter_bytes(tokens: int, kv_bytes_per_token_rank: int, prefill_tp: int, decode_tp: int) -> float:
    """Bytes one device sends after prefilling ``tokens`` prompt tokens at degree ``P = prefill_tp``
    inside a time-shared group that decodes at degree ``D = decode_tp`` (``P`` divides ``D``).

    At degree ``P`` a device computes ``K/P`` of the ``K`` KV heads; at degree ``D`` it owns ``K/D`` of
    them (strided instances, :mod:`node.core.role_config`: its ``D`` heads lie inside its ``P`` heads),
    so ``1 - P/D`` of the KV it computed belongs to other devices of the group and is written to them:
    ``tokens x kv_bytes_per_token_rank x (1 - P/D)``, ``kv_bytes_per_token_rank`` the device's KV per
    token at degree ``P`` (all layers). 0 when ``P == D``.

    Raises:
        ValueError: ``P`` < 1 or ``P`` does not divide ``D``.
    """
    if prefill_tp < 1 or decode_tp % prefill_tp:
        raise ValueError(f"prefill degree {prefill_tp} must divide the decode degree {decode_tp}")
    # one device's share of its instance's scatter (node.core.role_config.scatter_bytes, all heads)
    return scatter_bytes(max(0, tokens), kv_bytes_per_token_rank * prefill_tp, prefill_tp, decode_tp) / prefill_tp


def kv_scatter_s(tokens: int, kv_bytes_per_token_rank: int, prefill_tp: int, decode_tp: int,
                 link_Bps: float) -> float:
    """Seconds of the in-node KV scatter of :func:`kv_scatter_bytes` over a device's link at
    ``link_Bps`` bytes/s per direction (every device of an instance sends its own share at once, over
    its own link, so one device's bytes over one link is the scatter's time). 0 when nothing moves.

    Raises:
        ValueError: as :func:`kv_scatter_bytes`, or bytes to move and ``link_Bps`` <= 0.
    """
    nbytes = kv_scatter_bytes(tokens, kv_bytes_per_token_rank, prefill_tp, decode_tp)
    if nbytes <= 0:
        return 0.0
    if not link_Bps > 0:
        raise ValueError("a KV scatter needs link_Bps > 0")
    return nbytes / link_Bps


def sum_max_linear(lines: list[tuple[float, float]], n: int) -> float:
    """``sum(max(a + b*i for a, b in lines) for i in range(n))`` in O(len(lines)^2 log) time.

    The maximum of lines is convex and piecewise linear; between consecutive crossings one line is on
    top, so each integer run between crossings sums as an arithmetic series.
    """
    if n <= 0 or not lines:
        return 0.0
    cuts = {0, n}
    for i, (a1, b1) in enumerate(lines):
        for a2, b2 in lines[i + 1:]:
            if b1 != b2:
                x = (a2 - a1) / (b1 - b2)
                if 0 < x < n:
                    j = int(x)
                    cuts.update((j, j + 1))  # the crossing lies in [j, j+1]: both sides start a run
    bounds = sorted(cuts)
    total = 0.0
    for lo, hi in zip(bounds, bounds[1:]):
        cnt = hi - lo
        # The top line at lo (ties: the steeper, which stays on top after lo).
        a, b = max(lines, key=lambda ln: (ln[0] + ln[1] * lo, ln[1]))
        total += a * cnt + b * (lo + hi - 1) * cnt / 2
    return total


def cost_model_from_dict(doc: dict) -> CostModel | RooflineCost:
    """The cost model a JSON document describes, by its ``"kind"``: ``"roofline"`` → :class:`RooflineCost`,
    ``"linear"`` or absent → :class:`CostModel`. Keys that are not fields (``kind``, ``calibration``)
    are ignored.

    Raises:
        ValueError: an unknown kind, or fields of the wrong type (msgspec.ValidationError is a
            ValueError) or out of range.
    """
    kind = doc.get("kind", "linear")
    cls = {"linear": CostModel, "roofline": RooflineCost}.get(kind)
    if cls is None:
        raise ValueError(f"unknown cost model kind {kind!r}; one of linear, roofline")
    return msgspec.convert({k: v for k, v in doc.items() if k in cls.__struct_fields__}, cls)


def cost_model_to_dict(cost: CostModel | RooflineCost) -> dict:
    """The fields of ``cost`` plus its ``"kind"`` (the inverse of :func:`cost_model_from_dict`)."""
    kind = "roofline" if isinstance(cost, RooflineCost) else "linear"
    return {"kind": kind, **msgspec.structs.asdict(cost)}
