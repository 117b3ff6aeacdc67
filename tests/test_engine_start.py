"""How engine processes start (node.worker.engine_start): CPU engines started after the node has
computed are forked from a fork server; what such a child runs with is what a spawned one would.

That a forked-from-server engine still dies with the node (SIGKILL included) is checked on a real
node in tests/test_engine_process.py::test_engines_exit_with_the_node_on_sigterm_and_on_sigkill."""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os

import pytest

from node.worker import engine_start
from node.worker.engine_main import parent_alive
from node.worker.engine_start import process_target, start_method


@pytest.mark.quick
def test_cpu_engines_start_from_the_fork_server_and_cuda_engines_spawn():
    assert start_method(["cpu:0"]) == "forkserver"
    assert start_method(["cpu:0", "cpu:1"]) == "forkserver"  # a tensor-parallel group on the CPU
    assert start_method(["cuda:0"]) == "spawn"  # a fork after CUDA initialisation is unsafe
    assert start_method(["cuda:0", "cuda:1"]) == "spawn"
    assert process_target("spawn", print, (1,)) == (print, (1,))


def _report(conn, node_pid: int) -> None:
    """Runs in the forked child: what it inherited and whether it sees the node above it."""
    import sys

    server = multiprocessing.forkserver._forkserver
    kernels = [sys.modules.get(f"shiftnode_kernels.{name}") for name in ("cpu_decode_numba", "cpu_sampling_numba")]
    built = all(m is not None and (m._lazy.kernel is not None or m._lazy.error is not None) for m in kernels)
    conn.send((os.environ.get("SHIFTNODE_TEST_MARK"), os.getcwd(), server._forkserver_alive_fd,
               parent_alive(node_pid), parent_alive(node_pid + 1), os.getppid(), built))
    conn.close()


def test_a_child_of_the_fork_server_has_the_nodes_environment_and_directory_and_lets_go_of_the_server(
        monkeypatch, tmp_path):
    """The server was started before the environment and the directory changed (as a server started by
    an earlier node of the same process is): the child still runs with the node's current ones, holds no
    copy of the server's alive pipe (else the server would outlive the node), and finds the node as its
    parent's parent. The CPU kernels were built by the server (node.worker.fork_server_init)."""
    ctx = multiprocessing.get_context("forkserver")
    process_target("forkserver", _report, ())  # names the preload, as an engine's start does
    multiprocessing.forkserver.ensure_running()
    server = engine_start.server_pid()
    assert len(os.listdir(f"/proc/{server}/task")) == 1  # torch and the engine's modules imported, no thread
    monkeypatch.setenv("SHIFTNODE_TEST_MARK", "after the server started")
    monkeypatch.chdir(tmp_path)
    mine, child_end = ctx.Pipe(duplex=False)
    target, args = process_target("forkserver", _report, (child_end, os.getpid()))
    p = ctx.Process(target=target, args=args, daemon=True)
    p.start()
    child_end.close()
    try:
        assert mine.poll(60), "the child did not report"
        mark, cwd, alive_fd, node_above, other_above, parent, kernels_built = mine.recv()
    finally:
        p.join(10)
    assert (mark, cwd) == ("after the server started", str(tmp_path))
    assert alive_fd is None
    assert parent == server and node_above and not other_above
    assert kernels_built  # by the server, once (node.worker.fork_server_init), not by each engine
    assert p.exitcode == 0
