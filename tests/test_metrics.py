"""/metrics in Prometheus text format; gauges fall back to idle after aborts (B27)."""

import re
import time

from prometheus_client.parser import text_string_to_metric_families
import pytest

from support import STORIES, NodeProcess, raw_stream


def scrape_until(node, ready, timeout_s: float = 60.0) -> dict[str, float]:
    """Scrape until ``ready(metrics)`` holds (the streams a test opened have all arrived: on a loaded machine
    that takes longer than any fixed sleep), or return the last scrape after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = scrape(node)
        if ready(m) or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def scrape(node) -> dict[str, float]:
    text = node.client.get("/metrics").text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}" if s.labels else "")
            out[key] = s.value
    return out


@pytest.mark.quick
def test_metrics_count_requests_and_tokens(stories_node):
    before = scrape(stories_node)
    for _ in range(3):
        stories_node.client.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 10, "temperature": 0})
    after = scrape(stories_node)
    key = "shiftnode_requests_total{finish_reason=length}"
    assert after[key] - before.get(key, 0) == 3
    assert after["shiftnode_generation_tokens_total"] - before.get("shiftnode_generation_tokens_total", 0) == 30
    assert after["shiftnode_prompt_tokens_total"] - before.get("shiftnode_prompt_tokens_total", 0) == 15
    assert after["shiftnode_time_to_first_token_seconds_count"] - before.get("shiftnode_time_to_first_token_seconds_count", 0) == 3
    assert after["shiftnode_inter_token_latency_seconds_count"] - before.get("shiftnode_inter_token_latency_seconds_count", 0) == 27


@pytest.mark.quick
def test_requests_are_counted_once_whatever_n(stories_node):
    """shiftnode_requests_total counts requests; choices have shiftnode_request_choices_total."""
    before = scrape(stories_node)
    r = stories_node.client.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 5, "n": 3,
                                                         "temperature": 1, "seed": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 3
    after = scrape(stories_node)
    delta = {k: after[k] - before.get(k, 0) for k in after}
    assert sum(v for k, v in delta.items() if k.startswith("shiftnode_requests_total{")) == 1
    assert sum(v for k, v in delta.items() if k.startswith("shiftnode_request_choices_total{")) == 3
    assert delta["shiftnode_requests_total{finish_reason=length}"] == 1


@pytest.mark.quick
def test_request_outcome_is_the_worst_choice():
    from node.runtime.metrics import request_outcome

    assert request_outcome(["stop", "length", "stop"]) == "length"
    assert request_outcome(["stop", "abort"]) == "abort"
    assert request_outcome(["error", "abort"]) == "error"
    assert request_outcome(["stop"]) == "stop"


@pytest.fixture(scope="module")
def four_slot_node():
    """A stories260k node with 4 sequence slots, shared by the two load tests below: each leaves it idle
    (checked), and each counts its counters from a scrape taken before its load."""
    node = NodeProcess("--model", str(STORIES), "--max-num-seqs", "4")
    yield node
    node.close()


def _delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after[key] - before.get(key, 0)


def test_b27_gauges_fall_to_idle_after_aborts(four_slot_node):
    node = four_slot_node
    before = scrape(node)
    body = b'{"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": true, "stream": true}'
    socks = [raw_stream(node.port, body) for _ in range(12)]
    try:
        busy = scrape_until(node, lambda m: m.get("shiftnode_running_sequences{device=cpu:0}") == 4
                            and m.get("shiftnode_queue_depth") == 8)
        assert busy["shiftnode_running_sequences{device=cpu:0}"] == 4
        assert busy["shiftnode_queue_depth"] == 8
        assert busy["shiftnode_kv_blocks_used{device=cpu:0}"] > 0
        # the vLLM names a gateway routes on (test_vllm_metrics) say the same
        assert busy["vllm:num_requests_running{model_name=stories260k}"] == 4
        assert busy["vllm:num_requests_waiting{model_name=stories260k}"] == 8
        assert busy["vllm:kv_cache_usage_perc{model_name=stories260k}"] > 0
    finally:  # the node is shared: a failure above must not leave its streams running into the next test
        for s in socks:
            s.close()
    node.wait_idle(5)
    idle = scrape(node)
    assert idle["shiftnode_running_sequences{device=cpu:0}"] == 0
    assert idle["shiftnode_queue_depth"] == 0
    assert idle["shiftnode_kv_blocks_used{device=cpu:0}"] == 0
    assert _delta(idle, before, "shiftnode_requests_total{finish_reason=abort}") == 12
    assert _delta(idle, before, "vllm:request_success_total{finished_reason=abort,model_name=stories260k}") == 12
    assert idle["vllm:num_requests_waiting{model_name=stories260k}"] == 0
    assert re.search(r"^# TYPE shiftnode_kv_usage_ratio gauge$", node.client.get("/metrics").text, re.M)


def test_prefill_and_decode_load_are_exported_apart(four_slot_node):
    """The scaling signals (docs/operations.md): with 4 sequence slots and 12 streams of a 40-token prompt
    (token ids, so the count is exact), 4 sequences decode and the other 8 prompts, 320 tokens, wait to be
    computed; the prompt tokens/s counter counts the admitted ones; all fall to 0 once the streams close."""
    node = four_slot_node
    before = scrape(node)
    prompt = [1] + [300 + i for i in range(39)]
    body = ('{"prompt": %s, "max_tokens": 400, "ignore_eos": true, "stream": true}' % prompt).encode()
    socks = [raw_stream(node.port, body) for _ in range(12)]
    try:
        busy = scrape_until(node, lambda m: _delta(m, before, "shiftnode_prompt_tokens_total") == 12 * 40
                            and m.get("shiftnode_decoding_sequences{device=cpu:0}") == 4)
        queued = {k: v for k, v in busy.items() if k.startswith("shiftnode_prefill_queued_tokens{")}
        assert set(queued) == {"shiftnode_prefill_queued_tokens{device=unplaced}",
                               "shiftnode_prefill_queued_tokens{device=cpu:0}"}
        assert sum(queued.values()) == 8 * 40
        assert busy["shiftnode_decoding_sequences{device=cpu:0}"] == 4
        assert _delta(busy, before, "shiftnode_prompt_tokens_total") == 12 * 40
        assert busy["shiftnode_kv_usage_ratio{device=cpu:0}"] > 0
    finally:  # the node is shared: see above
        for s in socks:
            s.close()
    node.wait_idle(5)
    idle = scrape(node)
    assert idle["shiftnode_decoding_sequences{device=cpu:0}"] == 0
    assert sum(v for k, v in idle.items() if k.startswith("shiftnode_prefill_queued_tokens{")) == 0
