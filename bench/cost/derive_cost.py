"""Build a roofline cost model (:class:`node.core.roofline.RooflineCost`) for a Llama-family geometry,
its hardware terms calibrated on the H200 measurements of ``bench/RESULTS.md``.

``python -m bench.cost.derive_cost --config bench/configs/llama3-70b --tensor-parallel-size 8 --link-GBps 450
--out bench/cost_models/h200_llama3_70b_tp8_roofline.json``

Measured figures (``bench/RESULTS.md``, "2026-11-30 00:31 — end to end on NVIDIA H200" and
"2026-11-30 00:30 — kernels on NVIDIA H200"; Llama-3-8B geometry, bf16, Triton kernels, one H200):
decode steps at B = 1, 16, 64, 256 with 1,024 context tokens per sequence — graph step 5.516, 5.981,
7.738, 18.022 ms, its replay alone 4.697, 5.390, 6.735, 15.353 ms, eager 25.970, 14.985, 14.436,
19.082 ms; one 4,096-token prefill, 107.861 ms (the only prefill point in the H200 sections); the
paged prefill attention kernel at 287.7 TFLOP/s on the same 4,096-token causal shape; the copy and
matmul ceilings 4,257 GB/s and 784 TFLOP/s (reported beside the fit as fractions, not used in it).

Calibration, in this order, each step a closed form or a small least squares on the 8B geometry's own
bytes and FLOPs (:meth:`RooflineCost.pass_work`), ``b_B`` the bytes a decode step reads at batch B
(weights + KV of 1,024 B tokens + elementwise traffic; 15.14 GB at B = 1, 49.37 GB at B = 256, as the
run reports):

1. ``host_s`` and ``host_per_seq_s`` — (graph step - replay) ``= h0 + h1 B``, ordinary least squares
   over the four points (the host's inputs, logits copy and sampling outside the graph);
2. ``hbm_bandwidth_Bps`` and ``graph_launch_s`` — replay ``= m_B / BW + f_B + g``, least squares of the
   relative error over the four replays, where ``m_B`` are the bytes of the replay's memory-bound phases
   and ``f_B`` the FLOP time of its compute-bound ones (``g`` < 0 would be clamped to 0 and ``BW``
   refitted alone). Without a matmul rate every phase counts as memory-bound;
3. ``attention_flops_per_s`` — the measured 287.7 TFLOP/s kernel rate, used as is;
4. ``matmul_flops_per_s`` — closed form from the prefill point: its GEMM time is what the 107.861 ms
   leave after host(1 row), ``g``, attention (4.4 TFLOP at the kernel rate) and elementwise traffic at
   ``BW``; the rate is ``2 * layer_params * 4096 + 2 * vocab * hidden`` FLOP over that time (so the
   model meets the prefill point exactly; one point cannot test it). Steps 2 and 4 alternate until the
   rate stops changing (a few rounds): at the fitted rate the B = 256 replay's GEMMs are compute-bound
   (256 tokens per weight read is past the ridge point, ~155 FLOP/B), which the first, all-memory
   pass of step 2 had charged as bytes;
5. ``eager_launch_s`` — the mean of (eager - host(B)) over the launch-bound eager points, B = 16 and
   B = 64 (eager more than 1.2x the graph step); B = 256 (1.06x the graph step, device-bound) is a check
   of the model, not a sample; B = 1 (25.97 ms, 11 ms more than B = 16 with 1/16 of the work) is left
   out as unexplained by any term here and shown with its residual.

Result (8B, D = 1): ``BW`` 4.31 TB/s (101% of the copy rate, which counts a read and a write per
byte; the paged decode kernel alone read at 4.04 TB/s), ``g`` 1.25 ms (per-pass device time beyond
bytes and FLOPs: ~400 kernels per replay, ~3 us of ramp and tail each — "launch" is a misnomer inside
a graph), ``h0`` 0.60 ms, ``h1`` 7.9 us per sequence, ``P_mm`` 671 TFLOP/s (86% of the 784 peak),
``eager_launch_s`` 13.8 ms. Residuals: graph steps -2.5% (B=1), 0.0%, +2.4%, -0.5% (B=256); replays
+1.5%, -2.5%, +1.2%, -0.4%; eager B=16 -3.1%, B=64 +3.2%, B=256 -6.1% (the check point); eager B=1
-44.5% (left out); prefill 0 by construction. The elementwise traffic of a 4,096-token prefill
(23.6 GB) costs 5.5 ms at ``BW``; the kernel table's own RMSNorm, rotary, SiLU-and-mul and cache-write
timings at that shape add up to 6.5 ms (32 layers), a check of that term.

The evidence — every measured point, the model's value and the relative residual — goes into the
JSON's ``calibration`` record. The same hardware terms serve every geometry: the target's byte and
FLOP terms come from its config (:func:`geometry_terms`), per tensor-parallel rank. That assumes a
smaller model's narrower GEMMs reach the 8B's matmul rate (it flatters small models' prefill) and that
``host_s``/launch costs do not depend on the geometry (a deeper model launches more kernels per eager
pass: ``eager_launch_s`` is scaled by layers / 32, the only geometry scaling of a host term).

Tensor parallel (``--tensor-parallel-size D``): the link defaults to 450 GB/s per direction — NVIDIA's
H200 SXM figure for NVLink 4 (900 GB/s per GPU, both directions together), a specification, not
measured here — and 8 us per all-reduce (an assumption: small-message NCCL all-reduce latency on one
NVSwitch node is of that order; not measured here). Both are options.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import msgspec

from node.core.cost import least_squares
from node.core.roofline import RooflineCost, cost_model_to_dict
from node.plan import DTYPE_BYTES, Geometry, load_config, param_count

REPO = Path(__file__).resolve().parents[2]
REFERENCE_CONFIG = REPO / "bench" / "configs" / "llama3-8b"
SOURCE = ("bench/RESULTS.md, '2026-11-30 00:31 — end to end on NVIDIA H200' (bench.device.e2e: decode steps, "
          "replays, eager passes, prefill) and '2026-11-30 00:30 — kernels on NVIDIA H200' (paged prefill "
          "attention rate)")
COPY_BPS = 4257e9  # d2d copy ceiling, read + write counted (e2e ceilings row)
MATMUL_PEAK = 784e12  # bf16 8192^3 matmul ceiling (e2e ceilings row)
ATTENTION_FLOPS = 287.7e12  # paged prefill, 1 prompt x 4096, H=32/8, D=128 (kernels table)
CONTEXT_PER_SEQ = 1024
# (batch, graph step s, replay only s, eager s) at 1,024 context tokens per sequence
DECODE = [(1, 5.516e-3, 4.697e-3, 25.970e-3), (16, 5.981e-3, 5.390e-3, 14.985e-3),
          (64, 7.738e-3, 6.735e-3, 14.436e-3), (256, 18.022e-3, 15.353e-3, 19.082e-3)]
PREFILL = (4096, 107.861e-3)  # one fresh prompt, eager
EAGER_OUTLIERS = {1}  # batch sizes left out of the eager-launch fit (see the module doc)
MAX_GRAPH_BATCH = 256  # the run's buckets [1, 2, 4, ..., 256]
PAUSE_S = 1e-4  # PREFILL→DECODE switch reusing graphs, 0.1 ms
REFERENCE_LAYERS = 32
LINK_GBPS_DEFAULT = 450.0  # GB/s per direction, NVLink 4 on H200 SXM (specification)
LINK_LATENCY_US_DEFAULT = 8.0  # per all-reduce (assumption)

__all__ = ["geometry_terms", "layer_params", "decode_bytes", "calibrate", "derive", "evidence", "main",
           "HardwarePreset", "H200_NVLINK", "PRESETS", "reference_model", "derive_at"]


@dataclass(frozen=True)
class HardwarePreset:
    """One device kind and its in-node link, for projections at any tensor-parallel degree.

    Attributes:
        name: the preset's name (``h200``).
        hbm_bytes: device memory (bytes).
        memory_utilization: share of ``hbm_bytes`` a node may use for weights, activations and KV
            (the rest: CUDA context, allocator slack, graphs), as the node's ``--gpu-memory-utilization``.
        link_Bps: link bandwidth per device and direction (bytes/s): the all-reduce ring's rate, the
            in-node KV scatter's and the pooled hand-off's.
        allreduce_latency_s: fixed time of one all-reduce call (s), paid twice per layer per pass.
        source: where each figure comes from.
    """

    name: str
    hbm_bytes: float
    memory_utilization: float
    link_Bps: float
    allreduce_latency_s: float
    source: str


# NVIDIA H200 SXM: 141 GB of HBM3e and NVLink 4 at 900 GB/s per GPU, both directions together, i.e.
# 450 GB/s each way (NVIDIA H200 Tensor Core GPU datasheet, specifications, not measured here); every
# GPU of an HGX H200 board reaches every other through the NVSwitches at that rate. The all-reduce
# latency is the project's existing assumption (LINK_LATENCY_US_DEFAULT: small-message NCCL
# all-reduce inside one NVSwitch node is of the order of 10 us); it is neither measured here nor a
# cited figure. 0.9 of HBM is the node's usual memory fraction (bench.sim --memory-fraction default).
H200_NVLINK = HardwarePreset(
    name="h200", hbm_bytes=141e9, memory_utilization=0.9, link_Bps=LINK_GBPS_DEFAULT * 1e9,
    allreduce_latency_s=LINK_LATENCY_US_DEFAULT * 1e-6,
    source="NVIDIA H200 SXM datasheet (141 GB HBM3e, NVLink 4 900 GB/s per GPU = 450 GB/s per direction); "
           "8 us per all-reduce an assumption (not measured); memory utilization 0.9 (the node's default fraction)")
PRESETS = {"h200": H200_NVLINK}


def layer_params(g: Geometry) -> int:
    """Parameters of the decoder layers (no embeddings, no final norm)."""
    untied_head = 0 if g.tied else g.vocab * g.hidden
    return param_count(g) - g.vocab * g.hidden - untied_head - g.hidden


def decode_bytes(g: Geometry, dtype_bytes: int) -> int:
    """Weight bytes one pass reads: all parameters but an untied input embedding table (a gather)."""
    return (param_count(g) - (0 if g.tied else g.vocab * g.hidden)) * dtype_bytes


def geometry_terms(g: Geometry, dtype_bytes: int, tensor_parallel: int = 1) -> dict:
    """The geometry fields of a :class:`RooflineCost` for ``g`` per rank of a ``tensor_parallel`` group.

    Every matrix is split ``D`` ways (column/row parallel layers, a vocab-parallel head; the norms' few KB
    are counted whole). Each rank holds ``kv_heads / D`` KV heads, or one replicated head when ``D`` >
    kv_heads. Elementwise traffic per token and layer (elements, read + write, as the kernels of
    ``bench.device.kernels`` count them): two RMSNorms with residual ``8 hidden``, rotary ``2 (q + kv)``,
    cache writes ``4 kv``, SiLU-and-mul ``3 ffn``, with ``q``, ``kv``, ``ffn`` the rank's widths.

    Raises:
        ValueError: ``D`` < 1, or heads, KV heads or the MLP width not divisible the way TP splits them.
    """
    d = tensor_parallel
    if d < 1 or g.heads % d or g.intermediate % d or (g.kv_heads % d and d % g.kv_heads):
        raise ValueError(f"tensor parallel {d} does not split {g.heads} heads / {g.kv_heads} KV heads / "
                         f"{g.intermediate} MLP width")
    kv_heads_rank = max(1, g.kv_heads // d)
    q_r, kv_r, f_r = g.heads // d * g.head_dim, kv_heads_rank * g.head_dim, g.intermediate // d
    elems = 8 * g.hidden + 2 * (q_r + kv_r) + 4 * kv_r + 3 * f_r
    return dict(layers=g.layers, hidden=g.hidden, q_dim=g.heads * g.head_dim, vocab=g.vocab,
                dtype_bytes=dtype_bytes, layer_params=layer_params(g),
                weight_bytes=decode_bytes(g, dtype_bytes) // d,
                kv_bytes_per_token=2 * g.layers * kv_heads_rank * g.head_dim * dtype_bytes,
                activation_bytes_per_token=g.layers * elems * dtype_bytes, tensor_parallel=d)


def _placeholder(terms: dict) -> RooflineCost:
    """A model of ``terms`` with unit rates, to read bytes and FLOPs off (:meth:`RooflineCost.pass_work`)."""
    return RooflineCost(**terms, hbm_bandwidth_Bps=1.0, matmul_flops_per_s=1.0, attention_flops_per_s=1.0)


def calibrate(reference_config: dict, dtype: str = "bf16") -> RooflineCost:
    """The reference geometry's :class:`RooflineCost`, its hardware terms fitted to the H200 run (module doc)."""
    nb = DTYPE_BYTES[dtype]
    unit = _placeholder(geometry_terms(Geometry.from_config(reference_config), nb))
    bw = 1.0
    works = [unit.pass_work(0, 0, b, b * CONTEXT_PER_SEQ) for b, *_ in DECODE]
    replays = [r for _, _, r, _ in DECODE]
    # 2. Host work outside the graph.
    h0, h1 = least_squares([[1.0, float(b)] for b, *_ in DECODE], [s - r for _, s, r, _ in DECODE])
    h1 = max(0.0, h1)
    n, t = PREFILL
    wp = unit.pass_work(n, 0, 0, 0)
    mm = float("inf")
    for _ in range(20):  # 1 and 4 alternate until the phases' bound (bytes or FLOPs) stops changing
        # 1. Bandwidth and graph launch from the replays (relative least squares), each phase of a replay
        # counted as bytes at 1/BW when memory-bound and as its FLOP time when compute-bound (at B = 256
        # the GEMMs are: 256 tokens per weight is past the ridge point).
        rows, ys = [], []
        for w, r in zip(works, replays):
            mem, fixed = w.activation_bytes, 0.0
            for byts, flops, rate in ((w.weight_bytes, w.gemm_flops, mm),
                                      (w.kv_bytes, w.attention_flops, ATTENTION_FLOPS)):
                if mm != float("inf") and flops / rate > byts / bw:
                    fixed += flops / rate
                else:
                    mem += byts
            rows.append([mem / r, 1.0 / r])
            ys.append(1.0 - fixed / r)
        inv_bw, g = least_squares(rows, ys)
        if g < 0:
            g = 0.0
            inv_bw = sum(x * y for (x, _), y in zip(rows, ys)) / sum(x * x for x, _ in rows)
        bw = 1.0 / inv_bw
        # 4. Matmul rate from the prefill point.
        attn_s = max(wp.kv_bytes / bw, wp.attention_flops / ATTENTION_FLOPS)
        gemm_s = t - (h0 + h1 * wp.rows) - g - attn_s - wp.activation_bytes / bw
        if gemm_s <= wp.weight_bytes / bw:
            raise ValueError("the prefill point leaves less GEMM time than its weight read: the fit is inconsistent")
        if wp.gemm_flops / gemm_s == mm:
            break
        mm = wp.gemm_flops / gemm_s
    # 5. Eager launch floor from the launch-bound eager decodes.
    bound = [(b, e) for b, s, _, e in DECODE if b not in EAGER_OUTLIERS and e > 1.2 * s]
    eager = sum(e - (h0 + h1 * b) for b, e in bound) / len(bound)
    return msgspec.structs.replace(unit, hbm_bandwidth_Bps=bw, matmul_flops_per_s=mm,
                                   attention_flops_per_s=ATTENTION_FLOPS, host_s=h0, host_per_seq_s=h1,
                                   graph_launch_s=g, eager_launch_s=eager, max_graph_batch=MAX_GRAPH_BATCH,
                                   pause_s=PAUSE_S)


def derive(config: dict, reference: RooflineCost, dtype: str = "bf16", tensor_parallel: int = 1,
           link_Bps: float = LINK_GBPS_DEFAULT * 1e9, link_latency_s: float = LINK_LATENCY_US_DEFAULT * 1e-6
           ) -> RooflineCost:
    """``config``'s roofline model per rank of a ``tensor_parallel`` group, with ``reference``'s hardware
    terms (eager launch scaled by layers / 32; the link terms only matter for D > 1)."""
    terms = geometry_terms(Geometry.from_config(config), DTYPE_BYTES[dtype], tensor_parallel)
    hw = {f: getattr(reference, f) for f in ("hbm_bandwidth_Bps", "matmul_flops_per_s", "attention_flops_per_s",
                                             "host_s", "host_per_seq_s", "graph_launch_s", "max_graph_batch",
                                             "pause_s")}
    hw["eager_launch_s"] = reference.eager_launch_s * terms["layers"] / REFERENCE_LAYERS
    hw["piecewise_launch_s"] = reference.piecewise_launch_s * terms["layers"] / REFERENCE_LAYERS  # per-layer issue
    hw["piecewise_max_tokens"] = reference.piecewise_max_tokens
    if tensor_parallel > 1:
        hw.update(link_bandwidth_Bps=link_Bps, link_latency_s=link_latency_s)
    return RooflineCost(**terms, **hw)


@functools.lru_cache(maxsize=4)
def reference_model(dtype: str = "bf16") -> RooflineCost:
    """The calibrated Llama-3-8B, D = 1 model (:func:`calibrate` on :data:`REFERENCE_CONFIG`), computed once."""
    return calibrate(load_config(REFERENCE_CONFIG), dtype)


def derive_at(config: dict, tensor_parallel: int, preset: HardwarePreset = H200_NVLINK,
              dtype: str = "bf16") -> RooflineCost:
    """``config``'s roofline model per rank at degree ``tensor_parallel`` on ``preset``: one per-device
    model (the calibrated reference's hardware terms) with the geometry split ``D`` ways
    (:func:`geometry_terms`) and the preset's link (:func:`derive`). So a decode step at degree ``D``
    reads ``(weight bytes + KV bytes) / D`` at the HBM rate and pays ``2 x layers`` all-reduces of
    ``2 (D-1)/D x tokens x hidden x dtype_bytes`` bytes at ``link_Bps`` plus ``allreduce_latency_s``
    each; a prefill at degree ``P`` does ``1/P`` of the FLOPs and the same all-reduce terms at ``P``
    (:class:`node.core.roofline.RooflineCost`, its module doc). D = 1 gives exactly :func:`derive`'s
    D = 1 model (no link terms)."""
    return derive(config, reference_model(dtype), dtype, tensor_parallel, preset.link_Bps, preset.allreduce_latency_s)


def evidence(ref: RooflineCost) -> list[dict]:
    """Every measured point against ``ref`` (the calibrated reference model): what, measured, model, residual."""
    rows = []

    def add(case: str, measured: float, model: float, role: str) -> None:
        rows.append({"case": case, "measured_s": measured, "model_s": model,
                     "rel_residual": (model - measured) / measured, "role": role})

    for b, step, replay, eager in DECODE:
        k = b * CONTEXT_PER_SEQ
        w = ref.pass_work(0, 0, b, k)
        add(f"decode B={b} graph replay", replay, ref.device_s(w) + ref.graph_launch_s, "fit: bandwidth, graph launch")
        add(f"decode B={b} graph step", step, ref.decode_step_s(b, k), "fit: host")
        role = ("left out (unexplained)" if b in EAGER_OUTLIERS
                else "fit: eager launch" if eager > 1.2 * step else "check")
        add(f"decode B={b} eager", eager, ref.pass_s(0, 0, b, k, graph=False), role)
    add(f"prefill {PREFILL[0]} tokens", PREFILL[1], ref.prefill_step_s(PREFILL[0]), "fit: matmul rate (exact)")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cost.derive_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="config.json or model folder of the target geometry")
    ap.add_argument("--reference-config", default=str(REFERENCE_CONFIG), help="the measured geometry (8B)")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--link-GBps", type=float, default=LINK_GBPS_DEFAULT,
                    help="all-reduce link bandwidth per direction, GB/s (default: NVLink 4 specification)")
    ap.add_argument("--link-latency-us", type=float, default=LINK_LATENCY_US_DEFAULT, help="per all-reduce, us")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    try:
        ref = calibrate(load_config(a.reference_config), a.dtype)
        cost = derive(load_config(a.config), ref, a.dtype, a.tensor_parallel_size, a.link_GBps * 1e9,
                      a.link_latency_us * 1e-6)
    except (OSError, ValueError, KeyError) as e:
        print(f"bench.cost.derive_cost: {e}", file=sys.stderr)
        return 2
    g = Geometry.from_config(load_config(a.config))
    doc = cost_model_to_dict(cost)
    doc["calibration"] = {
        "derived": "roofline model; hardware terms fitted to the H200 Llama-3-8B run (bench/cost/derive_cost.py)",
        "source": SOURCE, "device": "NVIDIA H200",
        "config": str(a.config), "params": param_count(g), "tensor_parallel": a.tensor_parallel_size,
        "link": ("NVLink 4 per direction (NVIDIA H200 SXM specification, not measured); latency an assumption"
                 if a.tensor_parallel_size > 1 else "none (D = 1)"),
        "fractions_of_ceilings": {"bandwidth_of_copy": ref.hbm_bandwidth_Bps / COPY_BPS,
                                  "matmul_of_peak": ref.matmul_flops_per_s / MATMUL_PEAK,
                                  "attention_of_matmul_peak": ATTENTION_FLOPS / MATMUL_PEAK},
        "evidence_reference_model": "residuals of the calibrated Llama-3-8B, D = 1 model (the measured geometry)",
        "evidence": evidence(ref),
        "command": "python -m bench.cost.derive_cost " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    text = json.dumps(doc, indent=1) + "\n"
    if a.out:
        Path(a.out).write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
