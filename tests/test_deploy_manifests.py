"""The Kubernetes example (docs/deploy/kubernetes) parses, and its shiftnode arguments are ones the CLI
accepts and validates (so a renamed or removed flag breaks this test, not a user's rollout)."""
import argparse
import re
from pathlib import Path

import pytest
import yaml

from node.cli import config_from_args, flag_errors, serve_parser

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here

DEPLOY = Path(__file__).resolve().parents[1] / "docs" / "deploy" / "kubernetes"


def _docs() -> list[dict]:
    docs = [d for f in sorted(DEPLOY.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]
    assert docs and all({"apiVersion", "kind", "metadata"} <= d.keys() for d in docs)
    return docs


def test_manifests_parse_and_wire_etcd_probes_and_scrape():
    docs = {(d["kind"], d["metadata"]["name"]): d for d in _docs()}
    assert {("StatefulSet", "shiftnode-etcd"), ("Service", "shiftnode-etcd"), ("Deployment", "shiftnode"),
            ("Service", "shiftnode"), ("Secret", "shiftnode-peer-secret")} <= docs.keys()
    pod = docs[("Deployment", "shiftnode")]["spec"]["template"]
    (c,) = pod["spec"]["containers"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert pod["metadata"]["annotations"]["prometheus.io/path"] == "/metrics"
    etcd_svc = docs[("Service", "shiftnode-etcd")]["spec"]["ports"][0]["port"]
    assert f"--etcd=http://shiftnode-etcd:{etcd_svc}" in c["args"]
    env = {e["name"] for e in c["env"]}
    assert {"POD_IP", "POD_NAME", "SHIFTNODE_PEER_SECRET"} <= env
    for var in re.findall(r"\$\((\w+)\)", " ".join(c["args"])):
        assert var in env, f"{var} is used in args but not defined in env"


def test_container_args_are_valid_shiftnode_flags(monkeypatch):
    (c,) = [d for d in _docs() if d["kind"] == "Deployment"][0]["spec"]["template"]["spec"]["containers"]
    monkeypatch.setenv("SHIFTNODE_PEER_SECRET", "s")  # the Secret, as the pod's env gives it
    parser = argparse.ArgumentParser(prog="shiftnode")
    serve_parser(parser.add_subparsers(dest="command", required=True))
    args = [re.sub(r"\$\((\w+)\)", lambda m: {"POD_IP": "10.0.0.7", "POD_NAME": "shiftnode-0"}[m.group(1)], a)
            for a in c["args"]]
    # the pods have a GPU, this machine may not: the device check alone looks at the machine
    args = [a.replace("cuda:", "cpu:") if a.startswith("--devices=") else a for a in args]
    a = parser.parse_args(args)  # an unknown flag exits here
    assert flag_errors(a) is None
    cfg = config_from_args(a)
    cfg.validate()
    assert cfg.etcd == "http://shiftnode-etcd:2379" and cfg.advertise_host == "10.0.0.7" and cfg.kv_port == 9000


def test_split_scaling_scales_prefill_and_decode_on_metrics_the_node_exports(monkeypatch):
    """docs/deploy/kubernetes/split-scaling.yaml: a pooled prefill and a pooled decode Deployment with valid
    flags, each scaled by its own KEDA ScaledObject on shiftnode metrics that exist."""
    from node.runtime import metrics

    docs = {(d["kind"], d["metadata"]["name"]): d for d in _docs()}
    source = Path(metrics.__file__).read_text()
    monkeypatch.setenv("SHIFTNODE_PEER_SECRET", "s")  # the Secret, as the pod's env gives it
    parser = argparse.ArgumentParser(prog="shiftnode")
    serve_parser(parser.add_subparsers(dest="command", required=True))
    for role, flag in (("prefill", "--prefill-devices="), ("decode", "--decode-devices=")):
        (c,) = docs[("Deployment", f"shiftnode-{role}")]["spec"]["template"]["spec"]["containers"]
        args = [re.sub(r"\$\((\w+)\)", lambda m: {"POD_IP": "10.0.0.7", "POD_NAME": "p-0"}[m.group(1)], a)
                .replace("cuda:", "cpu:") for a in c["args"]]
        a = parser.parse_args(args)
        assert flag_errors(a) is None and any(x.startswith(flag) for x in args)
        config_from_args(a).validate()
        scaled = docs[("ScaledObject", f"shiftnode-{role}")]["spec"]
        assert scaled["scaleTargetRef"]["name"] == f"shiftnode-{role}"
        queries = [t["metadata"]["query"] for t in scaled["triggers"]]
        assert all(f'app="shiftnode-{role}"' in q for q in queries)
        for name in re.findall(r"shiftnode_\w+", " ".join(queries)):
            assert f'"{name.removesuffix("_total")}"' in source, name  # registered under that name
    names = {role: " ".join(t["metadata"]["query"] for t in docs[("ScaledObject", f"shiftnode-{role}")]["spec"]["triggers"])
             for role in ("prefill", "decode")}
    assert "shiftnode_prefill_queued_tokens" in names["prefill"] and "shiftnode_prompt_tokens_total" in names["prefill"]
    assert "shiftnode_decoding_sequences" in names["decode"] and "shiftnode_kv_usage_ratio" in names["decode"]
