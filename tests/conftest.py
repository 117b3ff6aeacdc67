import os

# Triton kernels run under the interpreter on the CPU (set before anything imports triton).
os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# One intra-op thread in the test process. Its models are tiny (a stories260k step is ~3.5 ms of CPU), and
# the node processes that tests start need the other core. With two threads on a loaded 2-core machine,
# OpenMP's spinning workers wait on each other: tests/test_cpu_attention.py's greedy run took 124-190 s of
# wall time for ~1.2 s of CPU. A test that needs more threads sets them itself (test_tensor_parallel).
torch.set_num_threads(1)

from support import STORIES, NodeProcess, require_shared  # noqa: E402

STORIES_NODE_ARGS = ("--model", str(STORIES))
_early: list[NodeProcess] = []  # the stories_node launched at session start, until the fixture takes it


def _runs_tests(config) -> bool:
    """Whether this process runs tests: not the controller of a ``pytest -n N`` run (pytest-xdist),
    which only hands test files to its workers, each of them a pytest session of its own."""
    return hasattr(config, "workerinput") or config.getoption("dist", "no") == "no"


def pytest_sessionstart(session):
    """A run over whole test folders (the suite) launches the shared stories260k node at once, so it
    starts while the tests are collected; ``stories_node`` then waits for it. A run of single files
    starts it on first use. Under ``-n N`` each worker launches its own (the controller none)."""
    args = [a.split("::")[0] for a in session.config.args]
    if (not session.config.option.collectonly and _runs_tests(session.config) and any(Path(a).is_dir() for a in args)
            and (STORIES / "model.safetensors").is_file()):
        _early.append(NodeProcess(*STORIES_NODE_ARGS, wait=False))


def pytest_collection_modifyitems(config, items):
    """Under ``-n N`` (``bash scripts/test``: 2 workers), the modules marked ``slow_only`` (each
    starts nodes of its own) come first, in their own order, so that the workers take the long files early and
    the run does not end waiting on one of them. Every worker sorts the same way (xdist requires one order)."""
    if hasattr(config, "workerinput"):
        items.sort(key=lambda item: item.get_closest_marker("slow_only") is None)  # stable: files stay whole


def pytest_collection_finish(session):
    if _early and not any("stories_node" in getattr(item, "fixturenames", ()) for item in session.items):
        _early.pop().close()  # nothing selected needs it


def pytest_sessionfinish(session):
    while _early:
        _early.pop().close()


@pytest.fixture(scope="session")
def stories_node():
    """One stories260k node shared by the API tests (float32, one CPU device)."""
    require_shared()
    node = _early.pop() if _early else NodeProcess(*STORIES_NODE_ARGS, wait=False)
    try:
        node.wait_up()
        yield node
    finally:
        node.close()


@pytest.fixture(scope="session")
def keyed_node():
    """One stories260k node behind ``--api-key sekrit``, shared by the API-key tests of test_api_errors and
    test_user_faults (they only read: a key's refusals and acceptances)."""
    require_shared()
    node = NodeProcess(*STORIES_NODE_ARGS, "--api-key", "sekrit")
    yield node
    node.close()


LIMITS_NODE_ARGS = ("--model", str(STORIES), "--max-queue", "4", "--max-num-seqs", "2", "--body-timeout-s", "1")


@pytest.fixture(scope="session")
def limits_node():
    """One stories260k node with small admission limits (``--max-queue 4 --max-num-seqs 2``, a 1 s body
    timeout), shared by test_time_shared's overload test and test_api_hardening's queue and body-timeout
    test: each leaves it idle (checked) and counts its counters from before its requests."""
    require_shared()
    node = NodeProcess(*LIMITS_NODE_ARGS)
    yield node
    node.close()


@pytest.fixture(scope="session")
def pooled_node():
    """One pooled node (prefill on cpu:0, KV handed to decode on cpu:1) shared by test_pooled and
    test_prefix_caching. Their tests compare outputs, and transfers and cache hits counted from
    before each request (``kv_transfers`` lists the last 200 moves; both modules make under 100)."""
    require_shared()
    node = NodeProcess("--model", str(STORIES), "--mode", "pooled", "--prefill-devices", "cpu:0",
                       "--decode-devices", "cpu:1")
    yield node
    node.close()


@pytest.fixture(scope="session")
def peer_pair():
    """A prefill-only node and its decode-only peer node (pooled mode across nodes, over TCP), as
    (prefill, decode), shared by test_peers and test_prefix_caching. Their tests compare outputs, and
    count transfers from before each request (``kv_transfers`` lists the last 200; they make under 100)."""
    from support import free_port, up
    from test_peers import decode_node, prefill_node, wait_peers

    port = free_port()
    d, p = up(decode_node(port, wait=False), prefill_node([port], wait=False))
    try:
        wait_peers(p, 1)
        yield p, d
    finally:
        p.close()
        d.close()
