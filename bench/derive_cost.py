"""Derive a step-time cost model for a Llama-family geometry from the H200-measured one, by roofline scaling.

``python -m bench.derive_cost --config bench/configs/llama3.2-1b --out bench/cost_models/h200_llama3_1b_roofline.json``

Not a measurement. The reference is ``bench/cost_models/h200_llama3_8b.json`` (CUDA-graph decode steps of
the Llama-3-8B geometry on one H200, fitted by ``bench/e2e.py``'s run; prefill linear through one measured
4,096-token prefill with an assumed 2 ms fixed part) and two figures of that same run
(``bench/RESULTS.md``): the host time of a decode step outside its CUDA graph, ``h`` = 5.516 - 4.697 =
0.819 ms at B=1, and the bandwidth a B=1 graph replay achieved, ``BW`` = 15.14 GB / 4.697 ms = 3.22 TB/s
(76% of the measured copy rate). For a geometry ``G`` (``R`` the reference), with ``Wd`` the weight
bytes a decode step reads (every parameter but an untied input embedding table), ``L`` the layer
parameters (what prefill GEMMs multiply: ``2 L`` FLOP per token) and ``kv`` the KV bytes per token:

* ``decode_fixed_s(G) = h + (decode_fixed_s(R) - h) * Wd(G) / Wd(R)`` — the weight read scales with bytes;
* ``decode_per_context_token_s(G) = kv(G) / BW`` — each cached token's KV is read once per step (the
  reference fit has no context term: its samples held 1,024 tokens per sequence, so context and batch
  were collinear; this splits the per-sequence term into that KV read and a rest);
* ``decode_per_seq_s(G) = max(0, decode_per_seq_s(R) - 1024 kv(R) / BW) * L(G) / L(R)`` — the rest,
  scaled like per-token compute;
* ``prefill_per_token_s(G) = prefill_per_token_s(R) * L(G) / L(R)`` — the same matmul efficiency (the
  reference's 68% of the measured rate; a smaller model's narrower GEMMs would likely do worse, so this
  flatters small models' prefill), ``prefill_fixed_s`` and ``pause_s`` unchanged.

Applied to the reference geometry itself it returns the reference with its per-sequence term split into
a context term and a rest (identical at 1,024 tokens per sequence, larger for longer contexts).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from node.core.cost import CostModel
from node.plan import DTYPE_BYTES, Geometry, kv_bytes_per_token, load_config, param_count

REPO = Path(__file__).resolve().parents[1]
REFERENCE_COST = REPO / "bench" / "cost_models" / "h200_llama3_8b.json"
REFERENCE_CONFIG = REPO / "bench" / "configs" / "llama3-8b"
HOST_S = 5.516e-3 - 4.697e-3  # decode step B=1 minus its graph replay (bench/RESULTS.md, H200 e2e)
REPLAY_BW = 15.14e9 / 4.697e-3  # bytes read by a B=1 step / its graph replay time (B/s)
REF_CONTEXT = 1024  # tokens per sequence in the reference's decode samples

__all__ = ["derive", "decode_bytes", "layer_params", "main"]


def layer_params(g: Geometry) -> int:
    """Parameters of the decoder layers (no embeddings, no final norm)."""
    untied_head = 0 if g.tied else g.vocab * g.hidden
    return param_count(g) - g.vocab * g.hidden - untied_head - g.hidden


def decode_bytes(g: Geometry, dtype_bytes: int) -> int:
    """Weight bytes one decode step reads: all parameters but an untied input embedding table."""
    return (param_count(g) - (0 if g.tied else g.vocab * g.hidden)) * dtype_bytes


def derive(config: dict, reference: CostModel, reference_config: dict, dtype: str = "bf16") -> CostModel:
    """The cost model of ``config`` scaled from ``reference`` (see the module doc)."""
    nb = DTYPE_BYTES[dtype]
    g, r = Geometry.from_config(config), Geometry.from_config(reference_config)
    kv_g, kv_r = kv_bytes_per_token(g, nb), kv_bytes_per_token(r, nb)
    w = decode_bytes(g, nb) / decode_bytes(r, nb)
    lay = layer_params(g) / layer_params(r)
    rest = max(0.0, reference.decode_per_seq_s - REF_CONTEXT * kv_r / REPLAY_BW)
    return CostModel(
        prefill_fixed_s=reference.prefill_fixed_s,
        prefill_per_token_s=reference.prefill_per_token_s * lay,
        prefill_per_token2_s=reference.prefill_per_token2_s * lay,
        decode_fixed_s=HOST_S + (reference.decode_fixed_s - HOST_S) * w,
        decode_per_seq_s=rest * lay,
        decode_per_context_token_s=kv_g / REPLAY_BW,
        pause_s=reference.pause_s,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.derive_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="config.json or model folder of the target geometry")
    ap.add_argument("--reference", default=str(REFERENCE_COST), help="measured cost model JSON")
    ap.add_argument("--reference-config", default=str(REFERENCE_CONFIG))
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    ref_doc = json.loads(Path(a.reference).read_text())
    ref = CostModel(**{k: v for k, v in ref_doc.items() if k in CostModel.__struct_fields__})
    cfg = load_config(a.config)
    cost = derive(cfg, ref, load_config(a.reference_config), a.dtype)
    g = Geometry.from_config(cfg)
    nb = DTYPE_BYTES[a.dtype]
    doc = {f: getattr(cost, f) for f in CostModel.__struct_fields__}
    doc["calibration"] = {
        "derived": "roofline scaling of a measured model, not a measurement (bench/derive_cost.py)",
        "reference": str(Path(a.reference).relative_to(REPO)) if Path(a.reference).resolve().is_relative_to(REPO)
        else a.reference,
        "config": str(a.config), "params": param_count(g), "layer_params": layer_params(g),
        "decode_weight_bytes": decode_bytes(g, nb), "kv_bytes_per_token": kv_bytes_per_token(g, nb),
        "host_s": HOST_S, "replay_bandwidth_Bps": REPLAY_BW,
        "command": "python -m bench.derive_cost " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    text = json.dumps(doc, indent=1) + "\n"
    if a.out:
        Path(a.out).write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
