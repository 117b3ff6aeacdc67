"""``--scheduling-policy priority`` (a request's ``priority`` orders admission into a device's batch and
the placement queue) and CORS (``--allowed-origins`` and the related flags), on real stories260k nodes."""

import threading
import time

import httpx
import pytest

from support import STORIES, NodeProcess, require_shared

pytestmark = pytest.mark.slow_only("its priority and CORS tests start nodes of their own with those flags")

ORIGIN = "https://app.example"
KEY = "sk-test"


@pytest.fixture(scope="module", params=["colocated", "adaptive"])
def priority_node(request):
    require_shared()
    node = NodeProcess("--model", str(STORIES), "--mode", request.param, "--max-num-seqs", "1",
                       "--scheduling-policy", "priority", "--allowed-origins", f'["{ORIGIN}"]', "--api-key", KEY)
    node.client.headers["Authorization"] = f"Bearer {KEY}"
    yield node
    node.close()


def test_lower_priority_value_is_served_first(priority_node):
    url = priority_node.url + "/v1/completions"
    first_token: dict[str, float] = {}

    def run(name: str, priority: int, max_tokens: int) -> None:
        body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
                "stream": True, "priority": priority}
        with httpx.stream("POST", url, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {") and name not in first_token:
                    first_token[name] = time.monotonic()

    blocker = threading.Thread(target=run, args=("blocker", 0, 400))
    blocker.start()
    while "blocker" not in first_token:  # it holds the one sequence slot now
        time.sleep(0.005)
    late = [threading.Thread(target=run, args=("low", 10, 4))]
    late[0].start()
    time.sleep(0.2)  # "low" is queued first
    late.append(threading.Thread(target=run, args=("high", -10, 4)))
    late[1].start()
    for t in [blocker, *late]:
        t.join(60)
    assert first_token["high"] < first_token["low"]


def test_priority_needs_the_policy(stories_node):
    r = stories_node.client.post("/v1/completions", json={"prompt": "a", "priority": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"


def test_cors_preflight_and_responses(priority_node):
    c = httpx.Client(base_url=priority_node.url)  # no key: a browser's preflight carries none
    pre = c.options("/v1/chat/completions", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                                                     "Access-Control-Request-Headers": "authorization,content-type"})
    assert pre.status_code == 200
    assert pre.headers["Access-Control-Allow-Origin"] == ORIGIN and "POST" in pre.headers["Access-Control-Allow-Methods"]
    assert "authorization" in pre.headers["Access-Control-Allow-Headers"]
    other = c.options("/v1/chat/completions", headers={"Origin": "https://evil.example",
                                                       "Access-Control-Request-Method": "POST"})
    assert other.status_code == 400 and "Access-Control-Allow-Origin" not in other.headers
    body = {"prompt": "Once upon a time", "max_tokens": 2}
    denied = c.post("/v1/completions", json=body, headers={"Origin": ORIGIN})
    assert denied.status_code == 401 and denied.headers["Access-Control-Allow-Origin"] == ORIGIN  # readable error
    ok = c.post("/v1/completions", json=body, headers={"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200 and ok.headers["Access-Control-Allow-Origin"] == ORIGIN and ok.headers["Vary"] == "Origin"
    with c.stream("POST", "/v1/completions", json={**body, "stream": True},
                  headers={"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"}) as s:
        assert s.headers["Access-Control-Allow-Origin"] == ORIGIN
    assert "Access-Control-Allow-Origin" not in c.get("/health", headers={"Origin": "https://evil.example"}).headers
    assert c.post("/tokenize", json={"prompt": "a"}).status_code == 401  # --api-key covers /tokenize too


def test_no_cors_headers_without_allowed_origins(stories_node):
    r = stories_node.client.get("/health", headers={"Origin": ORIGIN})
    assert "Access-Control-Allow-Origin" not in r.headers
