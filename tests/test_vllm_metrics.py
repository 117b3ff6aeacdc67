"""vLLM-compatible names on /metrics (issue 28): what an inference gateway scrapes is there, carries
``model_name``, and moves under requests in step with shiftnode's own families."""

import time

from prometheus_client.parser import text_string_to_metric_families
import pytest

from support import raw_stream

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here

# What the Gateway API inference extension's endpoint picker reads by default (its
# --total-queued-requests-metric, --total-running-requests-metric, --kv-cache-usage-percentage-metric and
# --cache-info-metric flags), what llm-d's scorers and predictor add (prefix cache, TTFT, ITL), and
# what vLLM's own Grafana dashboard plots (E2E, TPOT, request success, token counters).
GATEWAY_SCRAPED = {
    "vllm:num_requests_waiting": "gauge",
    "vllm:num_requests_running": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:cache_config_info": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_success": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
}


def families(node) -> dict:
    return {f.name: f for f in text_string_to_metric_families(node.client.get("/metrics").text)}


def value(fams: dict, sample: str, **labels) -> float:
    """Sum of the samples named ``sample`` whose labels include ``labels``."""
    name = next(n for n in fams if sample.startswith(n))
    return sum(s.value for s in fams[name].samples
               if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))


def test_gateway_metric_names_are_exported_and_move(stories_node):
    model = stories_node.client.get("/v1/models").json()["data"][0]["id"]
    before = families(stories_node)
    for name, kind in GATEWAY_SCRAPED.items():
        assert name in before, f"{name} missing from /metrics"
        assert before[name].type == kind, (name, before[name].type)
        assert all(s.labels.get("model_name") == model for s in before[name].samples), name
    info = before["vllm:cache_config_info"].samples[0].labels
    assert int(info["block_size"]) > 0 and int(info["num_gpu_blocks"]) > 0

    # Under load: streams held open keep sequences resident and KV blocks used.
    body = b'{"prompt": "Once upon a time", "max_tokens": 300, "ignore_eos": true, "stream": true}'
    socks = [raw_stream(stories_node.port, body) for _ in range(3)]
    try:
        deadline = time.monotonic() + 10
        while True:
            busy = families(stories_node)
            if value(busy, "vllm:num_requests_running") >= 3 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert value(busy, "vllm:num_requests_running") >= 3
        assert 0 < value(busy, "vllm:kv_cache_usage_perc") <= 1
        assert value(busy, "vllm:num_requests_waiting") == value(busy, "shiftnode_queue_depth")
    finally:
        for s in socks:
            s.close()

    r = stories_node.client.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 6,
                                                          "temperature": 0})
    assert r.status_code == 200
    stories_node.wait_idle(10)
    after = families(stories_node)
    assert value(after, "vllm:num_requests_running") == 0 and value(after, "vllm:kv_cache_usage_perc") == 0
    delta = {s: value(after, s) - value(before, s) for s in (
        "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:prefix_cache_queries_total",
        "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
        "vllm:e2e_request_latency_seconds_count", "vllm:request_time_per_output_token_seconds_count")}
    assert all(v > 0 for v in delta.values()), delta
    assert value(after, "vllm:request_success_total", finished_reason="length") \
        - value(before, "vllm:request_success_total", finished_reason="length") >= 1
    # the same numbers as shiftnode's own families (renamed, not counted twice)
    for vllm_name, own in (("vllm:generation_tokens_total", "shiftnode_generation_tokens_total"),
                           ("vllm:prompt_tokens_total", "shiftnode_prompt_tokens_total"),
                           ("vllm:time_to_first_token_seconds_count", "shiftnode_time_to_first_token_seconds_count"),
                           ("vllm:prefix_cache_hits_total", "shiftnode_prefix_cache_hits_tokens_total")):
        assert value(after, vllm_name) == value(after, own), vllm_name
