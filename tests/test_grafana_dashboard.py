"""docs/grafana/shiftnode.json (issue 28): it has the shape Grafana imports, and every PromQL query names
only metrics a live node exports (a renamed metric breaks this test, not an operator's board)."""

import json
import re

from prometheus_client.parser import text_string_to_metric_families
import pytest

from support import REPO

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here

BOARD = REPO / "docs" / "grafana" / "shiftnode.json"
PANEL_TYPES = {"row", "timeseries", "state-timeline", "stat", "gauge", "bargauge", "table", "text"}
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "gauge": ("",), "info": ("_info",), "summary": ("_sum", "_count", "_created")}
# PromQL words that look like metric names: functions are followed by "(", these are not always.
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
            "offset", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects: identifiers outside strings, label matchers, ranges and
    grouping clauses, not called as functions, not keywords or numbers."""
    e = re.sub(r'"(?:\\.|[^"\\])*"', '""', expr)  # strings
    e = re.sub(r"\{[^}]*\}", "", e)  # label matchers
    e = re.sub(r"\[[^\]]*\]", "", e)  # range selectors ([$__rate_interval], [5m])
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", e):
        word, rest = m.group(0), e[m.end():].lstrip()
        if rest.startswith("(") or word.lower() in KEYWORDS or word.startswith("$"):
            continue
        if m.start() > 0 and e[m.start() - 1] == "$":  # a Grafana variable
            continue
        names.add(word)
    return names


def exported(node) -> set[str]:
    """Every series name the node's /metrics can carry, from its families' types (labelled families
    with no sample yet still announce themselves)."""
    out = set()
    for fam in text_string_to_metric_families(node.client.get("/metrics").text):
        out |= {fam.name + s for s in SUFFIXES.get(fam.type, ("",))} | {s.name for s in fam.samples}
    return out


def test_metric_names_parser():
    got = metric_names('histogram_quantile(0.9, sum by (le, device) (rate(a_bucket{instance=~"$x", b="c"}[$__rate_interval])))'
                       " / on(device) group_left b_total + 2 * max by (instance) (c)")
    assert got == {"a_bucket", "b_total", "c"}


def test_grafana_board_parses_and_queries_exported_metrics(stories_node):
    board = json.loads(BOARD.read_text())
    assert board["title"] and board["uid"] and isinstance(board["schemaVersion"], int)
    variables = {v["name"] for v in board["templating"]["list"]}
    panels = board["panels"]
    assert len({p["id"] for p in panels}) == len(panels), "panel ids must be unique"
    names = set()
    for p in panels:
        assert p["type"] in PANEL_TYPES, p["type"]
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in "hwxy") and g["x"] + g["w"] <= 24, (p["title"], g)
        if p["type"] == "row":
            continue
        assert p["title"] and p["targets"], p
        for t in p["targets"]:
            expr = t["expr"]
            assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
            used = set(re.findall(r"\$(?:\{)?([A-Za-z_]\w*)", expr)) - {"__rate_interval", "__interval", "__range"}
            assert used <= variables, (expr, used - variables)
            found = metric_names(expr)
            assert found, expr
            names |= found
    missing = names - exported(stories_node)
    assert not missing, f"the board queries metrics the node does not export: {sorted(missing)}"
    for want in ("shiftnode_device_role", "shiftnode_kv_usage_ratio", "shiftnode_queue_depth",
                 "shiftnode_role_switches_total", "shiftnode_time_to_first_token_seconds_bucket",
                 "shiftnode_inter_token_latency_seconds_bucket", "shiftnode_kv_transfers_total", "shiftnode_peers"):
        assert want in names, f"the board lacks a panel on {want}"
