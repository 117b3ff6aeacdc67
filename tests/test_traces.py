"""bench.traffic.traces on the shared trace files: row counts and the statistics in shared/traces/stats.json."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from bench.traffic.traces import TraceRequest, load_trace, poisson_requests, read_azure_csv, read_mooncake_jsonl

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here

SHARED = Path(os.environ.get("SHIFTNODE_SHARED") or Path(__file__).resolve().parents[1].parent / "shared")
TRACES = SHARED / "traces"


def stats(file: str) -> dict:
    path = TRACES / "stats.json"
    assert path.is_file(), f"shared traces missing: {path} (set SHIFTNODE_SHARED)"
    return next(s for s in json.loads(path.read_text()) if s["file"] == file)


@pytest.mark.parametrize("file,reader", [
    ("azure_llm_2023/AzureLLMInferenceTrace_code.csv", read_azure_csv),
    ("mooncake/conversation_trace.jsonl", read_mooncake_jsonl),
])
def test_first_file_of_each_kind_matches_stats(file, reader):
    st = stats(file)
    rows = reader(TRACES / file)
    assert len(rows) == st["rows"]
    arrivals = [r.arrival_s for r in rows]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)
    assert arrivals[-1] - arrivals[0] == pytest.approx(st["duration_s"], abs=1e-3)
    gaps = np.diff(arrivals)
    assert gaps.std() / gaps.mean() == pytest.approx(st["interarrival_cv"], abs=1e-3)
    for key, values in (("prompt", [r.prompt_tokens for r in rows]), ("output", [r.output_tokens for r in rows])):
        assert np.mean(values) == pytest.approx(st[key]["mean"], abs=1e-3)
        for q in (50, 90, 99):
            assert float(np.percentile(values, q)) == pytest.approx(st[key][f"p{q}"], abs=0.01)
        assert (min(values), max(values)) == (st[key]["min"], st[key]["max"])


def test_other_files_row_counts():
    for file in ("azure_llm_2023/AzureLLMInferenceTrace_conv.csv", "mooncake/synthetic_trace.jsonl"):
        assert len(load_trace(TRACES / file)) == stats(file)["rows"]


def test_azure_timestamps_are_exact():
    rows = read_azure_csv(TRACES / "azure_llm_2023/AzureLLMInferenceTrace_code.csv")
    # rows 1-2: 18:17:03.9799600 and 18:17:04.0319600
    assert rows[1].arrival_s == pytest.approx(0.052, abs=1e-9)
    assert (rows[0].prompt_tokens, rows[0].output_tokens) == (4808, 10)


def test_window_scale_and_caps():
    path = TRACES / "mooncake/conversation_trace.jsonl"
    full = read_mooncake_jsonl(path)
    win = load_trace(path, start_s=600, duration_s=300, time_scale=0.5, max_prompt_tokens=4096, max_output_tokens=256)
    inside = [r for r in full if 600 <= r.arrival_s < 900]
    assert len(win) == len(inside) > 0
    assert all(0 <= r.arrival_s < 150 for r in win)
    assert win[0].arrival_s == pytest.approx((inside[0].arrival_s - 600) * 0.5)
    assert max(r.prompt_tokens for r in win) == 4096 and max(r.output_tokens for r in win) <= 256
    dropped = load_trace(path, start_s=600, duration_s=300, max_prompt_tokens=4096, drop_over_cap=True)
    assert len(dropped) == sum(1 for r in inside if r.prompt_tokens <= 4096)
    hashed = load_trace(path, duration_s=1, keep_hashes=True)
    assert all(len(r.hash_ids) == -(-r.prompt_tokens // 512) for r in hashed)


def test_poisson_generator():
    src = [TraceRequest(0.0, 100 * (i + 1), i + 1) for i in range(10)]
    a = poisson_requests(5.0, lengths_from=src, num_requests=4000, seed=7)
    assert a == poisson_requests(5.0, lengths_from=src, num_requests=4000, seed=7)
    assert a != poisson_requests(5.0, lengths_from=src, num_requests=4000, seed=8)
    gaps = np.diff([r.arrival_s for r in a])
    assert gaps.mean() == pytest.approx(0.2, rel=0.05) and gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)
    assert {(r.prompt_tokens, r.output_tokens) for r in a} == {(s.prompt_tokens, s.output_tokens) for s in src}
    b = poisson_requests(5.0, lengths_from=src, duration_s=10.0, seed=1)
    assert all(r.arrival_s < 10.0 for r in b) and 25 < len(b) < 80
