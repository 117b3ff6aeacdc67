"""Node ids and transfer ids (issue 45 item 8): nodes started with ``--host 0.0.0.0`` and no ``--node-id``
do not share an id (they would overwrite one etcd key and evict each other's NIXL agents), and transfer
ids cannot be guessed from others."""

import re
import subprocess
import sys

import pytest

from node.config import NodeConfig
from node.transport.protocol import new_transfer_id

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here

_NAME = "from node.config import NodeConfig; print(NodeConfig(host='{}', port=8000).name)"


def _name_in_a_new_process(host: str) -> str:
    return subprocess.run([sys.executable, "-c", _NAME.format(host)], capture_output=True, text=True,
                          check=True).stdout.strip()


def test_two_nodes_on_a_wildcard_host_have_different_ids():
    for host in ("0.0.0.0", "::", "127.0.0.1"):
        a, b = _name_in_a_new_process(host), _name_in_a_new_process(host)
        assert a != b and host not in a.rpartition(":")[0], (a, b)
        assert re.fullmatch(r".+:8000-[0-9a-f]{6}", a), a
    cfg = NodeConfig(host="0.0.0.0", port=8000)
    assert cfg.name == cfg.name  # drawn once per process: stable while it runs
    assert NodeConfig(host="10.1.2.3", port=8000).name == "10.1.2.3:8000"  # an address that names the machine
    assert NodeConfig(host="0.0.0.0", port=8000, node_id="decode-1").name == "decode-1"


def test_transfer_ids_are_not_guessable():
    ids = [new_transfer_id("node/seq-0") for _ in range(64)]
    assert len(set(ids)) == 64
    suffixes = [i.rpartition("/")[2] for i in ids]
    assert all(re.fullmatch(r"[0-9a-f]{32}", s) for s in suffixes)  # 128 random bits each
    assert len({s[:8] for s in suffixes}) > 60  # not a counter under a fixed prefix
