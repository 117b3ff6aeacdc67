"""bench.load.host_overhead's bookkeeping: CPU read from /proc, old-against-new rounds paired, the sampled
against greedy ratio, tok/s against --api-processes, the 128k-vocabulary model folder; the load client split
over processes (bench.load.stream_client) against a small streaming server."""

import json
import os
import subprocess
import sys
import time

import pytest

from support import require_shared

from bench.load.host_compare import _tree_cpu_s, against_baseline, api_against_single, api_scaling, sampled_vs_greedy
from bench.load.host_cells import Cell, _runner_ms, target
from bench.load.host_overhead import LLAMA3_VOCAB, STORIES, llama3_vocab_model
from bench.load.stream_client import GAPS_KEPT, Counts, auto_processes, run_load, split


def test_tree_cpu_counts_the_process_and_its_children_apart():
    if not os.path.isdir("/proc"):  # off Linux there is nothing to read: zeros, never an error
        assert _tree_cpu_s(os.getpid()) == (0.0, 0.0)
        return
    # The child burns 0.4 s of its own CPU time (not of wall time: on a loaded machine it may get far less
    # CPU in a wall-clock window), says so, and stays alive until told to go, so it is measured alive.
    burn = "import sys, time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass\nprint('burnt', flush=True)\nsys.stdin.read()"
    child = subprocess.Popen([sys.executable, "-c", burn], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        own0, kids0 = _tree_cpu_s(os.getpid())
        t = time.process_time()
        while time.process_time() - t < 0.3:
            pass
        assert child.stdout.readline().strip() == "burnt"
        own1, kids1 = _tree_cpu_s(os.getpid())
    finally:
        child.stdin.close()
        child.wait()
    assert own1 - own0 >= 0.2
    assert kids1 - kids0 >= 0.2  # the busy child, counted while it runs
    assert _tree_cpu_s(None) == (0.0, 0.0)


def _cell(tree: str, pair: int, node_cpu_s: float, tokens: int) -> Cell:
    return Cell("process", "zero", "1 col", 256, "greedy", wall_s=1.0, tokens=tokens, node_cpu_s=node_cpu_s,
                tree=tree, pair=pair)


@pytest.mark.quick
def test_baseline_ratios_pair_each_round_with_its_own_baseline_run():
    cells = [_cell("baseline", 0, 1.0, 10_000), _cell("this", 0, 0.8, 10_000),  # round 0: 0.80x CPU/token
             _cell("baseline", 1, 2.0, 10_000), _cell("this", 1, 1.8, 10_000),  # a slow phase: 0.90x
             _cell("baseline", 2, 1.0, 10_000), _cell("this", 2, 0.7, 12_500)]  # 0.56x, 1.25x tok/s
    (line,) = against_baseline(cells)
    assert "3 rounds" in line and "node CPU per token 0.80x [0.80 0.90 0.56]" in line
    assert "tok/s 1.00x [1.00 1.00 1.25]" in line
    assert against_baseline([c for c in cells if c.tree == "this"]) == []


@pytest.mark.quick
def test_baseline_ratios_pair_runs_of_the_same_api_processes():
    def cell(tree, api, cpu):
        return Cell("process", "zero", "1 col", 256, "greedy", wall_s=1.0, tokens=10_000, node_cpu_s=cpu,
                    tree=tree, api_processes=api)

    lines = against_baseline([cell("baseline", 1, 3.0), cell("this", 1, 2.4),  # one process: 0.80x
                              cell("baseline", 2, 1.0), cell("this", 2, 0.5)])  # two front ends: 0.50x
    assert len(lines) == 2
    assert "api1" in lines[0] and "node CPU per token 0.80x" in lines[0]
    assert "api2" in lines[1] and "node CPU per token 0.50x" in lines[1]


@pytest.mark.quick
def test_sampled_against_greedy_pairs_the_same_point_and_flags_the_target():
    def cell(model, sampling, steps, pair=0):
        return Cell("process", model, "1 col", 256, sampling, wall_s=2.0, tokens=1, steps=[steps], pair=pair)

    lines = sampled_vs_greedy([cell("llama3-vocab", "greedy", 20), cell("llama3-vocab", "t0.8", 18),  # 1.11x
                               cell("zero", "greedy", 100), cell("zero", "t0.8", 50),  # 2.00x, no target
                               cell("llama3-vocab", "t0.8", 10, pair=1)])  # no greedy in its round: no line
    assert len(lines) == 2
    assert "llama3-vocab" in lines[0] and "1.11x (target <= 1.2x: ok)" in lines[0]
    assert "zero" in lines[1] and lines[1].endswith("2.00x")


@pytest.mark.quick
def test_llama3_vocab_model_is_stories_with_llama3s_vocabulary(tmp_path):
    require_shared()
    folder = llama3_vocab_model(tmp_path)
    cfg, base = json.loads((folder / "config.json").read_text()), json.loads((STORIES / "config.json").read_text())
    assert cfg == base | {"vocab_size": LLAMA3_VOCAB} and LLAMA3_VOCAB == 128256
    assert (folder / "tokenizer.json").read_bytes() == (STORIES / "tokenizer.json").read_bytes()
    assert not list(folder.glob("*.safetensors"))


@pytest.mark.quick
def test_itl_p50_and_the_compiled_runner_step_beside_the_eager_one():
    cell = Cell("process", "stories-c", "1 ts", 1, "greedy", wall_s=1.0, tokens=4, steps=[4],
                gaps=[0.0004, 0.0005, 0.0009], startup_s=30.0)
    assert cell.itl_p50_ms() == 0.5
    runner = {("none", 1): 1.5, ("inductor", 1): 0.4, ("inductor", 64): 6.0}
    assert _runner_ms(runner, cell) == 0.4
    assert _runner_ms(runner, Cell("process", "stories", "1 ts", 1, "greedy")) == 1.5
    assert _runner_ms(runner, Cell("process", "stories-c", "2 ts", 1, "greedy")) is None
    assert target(cell, runner) == "ITL p50 <=0.8 ms: ok"
    cell.gaps = [0.001, 0.002]
    assert target(cell, runner) == "ITL p50 <=0.8 ms: MISS"


@pytest.mark.quick
def test_api_processes_are_compared_with_the_one_process_run_of_the_same_round():
    def cell(api, pair, ctl_s, api_s, tokens):
        return Cell("process", "zero", "1 col", 256, "greedy", wall_s=1.0, tokens=tokens, node_cpu_s=ctl_s,
                    api_cpu_s=api_s, engine_cpu_s=0.1, pair=pair, api_processes=api)

    cells = [cell(1, 0, 0.30, 0.0, 10_000), cell(2, 0, 0.04, 0.20, 10_000),  # control 4 us, all 34 vs 40 us
             cell(1, 1, 0.30, 0.0, 10_000), cell(2, 1, 0.06, 0.30, 12_000)]  # 5 us, 38.3 vs 40 us; 1.2x tok/s
    (line,) = api_against_single(cells)
    assert "--api-processes 2 vs 1" in line and "2 rounds" in line
    assert "control loop 4.5 vs 30.0 us/token (target <= 5: ok)" in line
    assert "whole node 36.2 vs 40.0 us/token (0.90x, target <= 1: ok)" in line and "tok/s 1.10x [1.00 1.20]" in line
    assert api_against_single([c for c in cells if c.api_processes == 1]) == []


@pytest.mark.quick
def test_api_scaling_is_tok_s_over_n_times_one_process_with_the_targets_beside():
    def cell(api, sampling, tokens, ctl_s):
        return Cell("process", "zero", "1 col", 1024, sampling, wall_s=2.0, tokens=tokens, node_cpu_s=ctl_s,
                    api_processes=api, client_cpu_s=1.0, client_cpu_max_s=0.4, client_processes=4)

    cells = [cell(1, "greedy", 100_000, 2.0), cell(2, "greedy", 180_000, 0.8),  # 0.90 of linear, 4.4 us
             cell(4, "greedy", 240_000, 1.5), cell(8, "greedy", 320_000, 1.0),  # 0.60 (a miss), 0.40 (no target)
             cell(1, "t0.8", 100_000, 2.0)]  # t0.8 has no other value: no lines
    lines = api_scaling(cells)
    assert len(lines) == 4 and all("greedy" in x for x in lines)
    assert "--api-processes  1:    50000 tok/s, 1.00 of linear; control loop 20.0 us/token (target <= 5: MISS)" in lines[0]
    assert "--api-processes  2:    90000 tok/s, 0.90 of linear (target >= 0.7: ok); control loop 4.4" in lines[1]
    assert "0.60 of linear (target >= 0.7: MISS); control loop 6.2 us/token (target <= 5: MISS)" in lines[2]
    assert "0.40 of linear; control loop 3.1 us/token (target <= 5: ok)" in lines[3]
    assert "clients 50% CPU in 4 process(es) (busiest 20%)" in lines[3]


@pytest.mark.quick
def test_streams_split_over_processes_and_their_counts_merge():
    assert split(10, 4) == [3, 3, 2, 2] and split(2, 4) == [1, 1] and split(5, 1) == [5]
    assert auto_processes(2) == 1 and auto_processes(16) == 4 and auto_processes(128) == 8
    a = Counts(tokens=10, gap_s=0.5, gap_tokens=8, gaps=[0.1] * 3, requests=2, cpu_s=0.3, cpu_max_s=0.3)
    a.merge(Counts(tokens=5, gap_s=0.25, gap_tokens=4, gaps=[0.2] * (GAPS_KEPT + 5), requests=1, errors=1,
                   error="HTTP 503", cpu_s=0.5, cpu_max_s=0.5))
    assert (a.tokens, a.gap_s, a.gap_tokens, a.requests, a.errors, a.error) == (15, 0.75, 12, 3, 1, "HTTP 503")
    assert (a.cpu_s, a.cpu_max_s, len(a.gaps)) == (0.8, 0.5, GAPS_KEPT)


def _streaming_server(sent: list[float]):
    """A node stand-in on a free port in a thread: ``POST /v1/completions`` streams ``max_tokens`` one-token
    SSE events as fast as it can (every third one written in two halves, so a client sees events cut
    across reads), noting each event's send time in ``sent``; ``GET /v1/node`` gives the events sent so far
    as one device's steps. Returns ``(url, stop)``."""
    import asyncio
    import threading

    from aiohttp import web

    async def complete(request):
        body = await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(body["max_tokens"]):
            event = b'data: {"choices": [{"text": "x", "token_ids": [%d]}]}\n\n' % (3 + i)
            if i % 3 == 0:
                await resp.write(event[:30])
                await asyncio.sleep(0.0005)
                event = event[30:]
            await resp.write(event)
            sent.append(time.monotonic())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def node(request):
        return web.json_response({"devices": [{"steps": len(sent)}]})

    loop, ready = asyncio.new_event_loop(), threading.Event()
    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    app.router.add_get("/v1/node", node)
    runner = web.AppRunner(app)
    port = []

    def serve():
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        port.append(site._server.sockets[0].getsockname()[1])
        ready.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(10)

    def stop():
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)

    return f"http://127.0.0.1:{port[0]}", stop


def test_the_load_client_in_two_processes_counts_what_the_server_sent_in_the_window():
    sent: list[float] = []
    url, stop = _streaming_server(sent)
    try:
        r = run_load(url, {"max_tokens": 64, "stream": True}, 6, processes=2, warmup_s=0.3, duration_s=1.0)
    finally:
        stop()
    k = r.counts
    assert k.processes == 2 and k.errors == 0, k.error
    assert abs(r.wall_s - 1.0) < 1e-6 and r.steps[0] > 0 and r.cpu == (0.0, 0.0, 0.0)  # no node pid: no node CPU read
    # both processes' tokens are merged: about every event the server stamped inside the window (an event is
    # received a little after it is stamped, so the two counts differ by what was in flight at the edges)
    window = [t for t in sent if t in r.window]
    assert abs(k.tokens - len(window)) <= 0.05 * len(window) + 50, (k.tokens, len(window))
    assert k.requests > 0 and 0 < k.gap_tokens <= k.tokens and len(k.gaps) == min(k.gap_tokens, len(k.gaps))
    assert 0 < k.cpu_max_s <= k.cpu_s  # each process's CPU in the window, summed; the busiest one's
