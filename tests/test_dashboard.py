"""GET /dashboard (issue 28): the page behind --api-key, and /v1/node's incremental history."""

import httpx
import pytest

from support import STORIES, NodeProcess, require_shared

KEY = "dash-key"
ARGS = ("--model", str(STORIES), "--devices", "cpu:0,cpu:1", "--reconfig-pause-ms", "10", "--api-key", KEY,
        "--tpot-slo-ms", "200", "--ttft-slo-ms", "2000")
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def node():
    """A time-shared node on two CPU devices, behind an API key."""
    require_shared()
    n = NodeProcess(*ARGS, wait=False)
    yield n
    n.close()


def test_dashboard_page_is_behind_the_key_and_node_history_is_incremental(node):
    node.wait_up()
    url = node.url + "/dashboard"
    assert httpx.get(url).status_code == 401
    assert httpx.get(url).json()["error"]["code"] == "invalid_api_key"
    form = httpx.get(url, headers={"Accept": "text/html"})
    assert form.status_code == 401 and 'name="key"' in form.text  # a browser gets a form asking for the key
    assert httpx.get(url + "?key=wrong").status_code == 401
    for ok in (httpx.get(url + f"?key={KEY}"), httpx.get(url, headers=AUTH)):
        assert ok.status_code == 200 and ok.headers["Content-Type"].startswith("text/html")
        assert "default-src 'none'" in ok.headers["Content-Security-Policy"]  # it loads nothing from elsewhere
        assert "<script" in ok.text and "src=" not in ok.text.split("<script", 1)[1].split(">", 1)[0]

    c = httpx.Client(base_url=node.url, headers=AUTH, timeout=30)
    assert c.get("/v1/node?since=soon").status_code == 400
    assert c.get("/v1/node?since=nan").json()["error"]["param"] == "since"
    for i in range(6):
        assert c.post("/v1/completions", json={"prompt": "Once upon a time" * (1 + i), "max_tokens": 12}).status_code == 200
    full = c.get("/v1/node").json()
    lat = full["latency"]
    assert lat["ttft"]["count"] >= 6 and lat["ttft"]["counts"][-1] == lat["ttft"]["count"] and lat["ttft"]["le"][-1] is None
    assert lat["itl"]["count"] >= 6 * 11
    assert full["started_wall_s"] > 0
    switches = [s for d in full["devices"] for s in d["switches"]]
    assert switches, "six requests on a time-shared node switched no role"
    later = c.get("/v1/node", params={"since": full["clock_s"]}).json()
    assert all(s["end_s"] > full["clock_s"] for d in later["devices"] for s in d["switches"])
    cut = min(s["end_s"] for s in switches)  # since the earliest end: all but that one
    some = c.get("/v1/node", params={"since": cut}).json()
    assert sum(len(d["switches"]) for d in some["devices"]) >= len(switches) - 1
