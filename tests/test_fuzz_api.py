"""Generated requests against the node's own OpenAPI document (``/openapi.json``): no 5xx, no hang,
the node alive and its KV back to zero afterwards.

Schemathesis reads the document (made from the msgspec types that validate requests, so what is
fuzzed is what is accepted) and Hypothesis generates bodies for every operation, valid and not. A
bounded run (``MAX_EXAMPLES`` per operation, derandomized so a failure reproduces); ``bench/load/fuzz.py``
runs the long one. Two things are shaped before sending, and only these: ``max_tokens``/``n``
are capped (and set for chat, whose default is the context left) so that a valid request costs milliseconds, and peers to add point at loopback (a
generated host would send traffic elsewhere). ``POST /v1/node/drain`` is left out: it ends the
node's intake for good by design, after which every request is a correct 503.
"""
import os

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from node.api.openapi import openapi_document
from support import STORIES, NodeProcess

pytestmark = pytest.mark.slow_only("schemathesis generates hundreds of requests against a node of its own")

MAX_EXAMPLES = int(os.environ.get("SHIFTNODE_FUZZ_EXAMPLES", "30"))
DERANDOMIZE = os.environ.get("SHIFTNODE_FUZZ_RANDOM") != "1"  # bench.load.fuzz --seed-random: new inputs each run


@pytest.fixture(scope="module")
def fuzz_node():
    node = NodeProcess("--model", str(STORIES), "--peer-secret", "fuzz", "--max-num-seqs", "16",
                       "--request-timeout-s", "60")
    yield node
    node.close()


# The document as the node builds it (test_served_document_is_this_one checks the node serves it):
# loaded at import, as Schemathesis' pytest plugin needs the operations at collection.
schema = schemathesis.openapi.from_dict(openapi_document(STORIES.name, "test"))


def test_served_document_is_this_one(fuzz_node):
    served = fuzz_node.client.get("/openapi.json").json()
    assert served["paths"] == schema.raw_schema["paths"] and served["components"] == schema.raw_schema["components"]


def shape(case) -> None:
    """Cap the cost of valid generation requests; keep generated peers on loopback."""
    body = case.body
    if not isinstance(body, dict):
        return
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(key), int) and body[key] > 8:
            body[key] = 8
    if case.path == "/v1/chat/completions" and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 8  # chat's default is the whole context left
    if isinstance(body.get("n"), int) and body["n"] > 2:
        body["n"] = 2
    if case.path == "/v1/node/peers" and isinstance(body.get("add"), list):
        body["add"] = [f"127.0.0.1:{9 + i}" for i, _ in enumerate(body["add"][:4])]  # port 9+: refused at once


@schema.exclude(path="/v1/node/drain").parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=DERANDOMIZE,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.function_scoped_fixture])
def test_generated_requests_never_get_a_server_error(case, fuzz_node):
    shape(case)
    response = case.call(base_url=fuzz_node.url, timeout=60)  # a hang fails here
    case.validate_response(response, checks=[not_a_server_error])


def test_the_node_is_alive_and_holds_no_kv_after_the_fuzzing(fuzz_node):
    assert fuzz_node.alive()
    st = fuzz_node.wait_idle(timeout_s=30)
    assert all(d["kv_blocks_used"] == 0 and d["failure"] is None for d in st["devices"])
    assert st["live_requests"] == 0
