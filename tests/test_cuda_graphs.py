"""CUDA-graph decode: bucketing, padding into static buffers, the runner/engine integration and
``--enforce-eager``. Everything runs on the CPU: ``DecodeGraphs(use_cuda_graph=False)`` runs the same
static buffers, padding and split-K choice eagerly (torch references, and the Triton kernels under the
interpreter); only the capture itself needs CUDA (one test, skipped without it)."""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from types import SimpleNamespace

import pytest
import torch

from shiftnode_kernels.ops import get_ops
from node.cli import config_from_args, serve_parser
from node.config import NodeConfig
from node.core.batcher import BatchConfig, Batcher
from node.core.ledger import BlockLedger
from node.core.roles import Role
from node.core.sequence import SamplingParams
from node.runtime.engine import DeviceEngine
from node.runtime.switching import DeviceRole
from node.worker.cuda_graphs import (
    DEFAULT_BUCKETS, DecodeGraphs, StaticDecodeInputs, decode_buckets, decode_graphs_unsupported, decode_lists,
    graph_decode_splits, pack_decode_batch, pick_bucket,
)
from node.worker.engine_core import EngineCore
from node.worker.local_engine import LocalEngine
from node.worker.loader import attach_decode_graphs
from node.worker.model_config import ModelConfig
from node.worker.runner import ModelRunner, SeqInput, StepInput
from node.worker.sampler import SampleRequest
from node.worker.weights import build_model
from support import BYTE_LEVEL_MODEL_CONFIG

CPU = torch.device("cpu")
GREEDY = SamplingParams(max_tokens=32, temperature=0.0)
VOCAB = BYTE_LEVEL_MODEL_CONFIG["vocab_size"]


def make_runner(backend: str = "torch", max_model_len: int = 256, num_blocks: int = 48) -> ModelRunner:
    cfg = ModelConfig.from_dict(BYTE_LEVEL_MODEL_CONFIG)
    model = build_model(cfg, folder=None, load_format="dummy", dtype=torch.float32, device=CPU,
                        max_positions=max_model_len, ops=get_ops(backend), seed=0)
    return ModelRunner(model, cfg, CPU, num_blocks, 16, torch.float32)


def attach(runner: ModelRunner, max_model_len: int = 256, max_num_seqs: int = 8, **kw) -> DecodeGraphs:
    runner.graphs = DecodeGraphs(runner.model, runner.kv_cache, block_size=runner.block_size,
                                 max_model_len=max_model_len, max_num_seqs=max_num_seqs, use_cuda_graph=False, **kw)
    return runner.graphs


def decode_seqs(ctx: list[int], first_block: int = 1, vocab: int = VOCAB, seed: int = 0) -> list[SeqInput]:
    """One decode token per sequence at position ``ctx[i] - 1``, on consecutive fresh blocks."""
    rng = random.Random(seed)
    seqs, b = [], first_block
    for i, c in enumerate(ctx):
        n = -(-c // 16)
        seqs.append(SeqInput(f"s{i}", [rng.randrange(3, vocab)], c - 1, list(range(b, b + n)),
                             SampleRequest(GREEDY, [], 0, 0)))
        b += n
    return seqs


# --- buckets and padding (pure) -------------------------------------------------------------------


@pytest.mark.quick
def test_buckets_are_powers_of_two_capped_by_max_num_seqs():
    assert decode_buckets(256) == DEFAULT_BUCKETS == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert decode_buckets(1000) == DEFAULT_BUCKETS  # larger batches run eagerly
    assert decode_buckets(100) == (1, 2, 4, 8, 16, 32, 64, 100)  # the cap itself is a bucket
    assert decode_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert decode_buckets(1) == (1,)
    assert decode_buckets(0) == (1,)
    assert decode_buckets(600, largest=512) == DEFAULT_BUCKETS + (512,)


@pytest.mark.quick
@pytest.mark.parametrize("n,bucket", [(1, 1), (2, 2), (3, 4), (5, 8), (17, 32), (64, 64), (65, 128), (256, 256),
                                      (257, None), (0, None)])
def test_pick_bucket_is_the_smallest_that_fits(n, bucket):
    assert pick_bucket(n, DEFAULT_BUCKETS) == bucket


@pytest.mark.quick
def test_pack_pads_rows_with_slot_minus_one_and_seq_len_one():
    # seq 0: position 20 (block 7 offset 4, needs 2 blocks of its 3); seq 1: position 3 in block 9
    b = pack_decode_batch([11, 12], [20, 3], [[5, 7, 8], [9]], bucket=4, block_size=16, max_blocks=8)
    assert b.num_seqs == 2 and b.bucket == 4
    assert b.input_ids.tolist() == [11, 12, 0, 0] and b.input_ids.dtype == torch.int64
    assert b.positions.tolist() == [20, 3, 0, 0] and b.positions.dtype == torch.int64
    assert b.slot_mapping.tolist() == [7 * 16 + 4, 9 * 16 + 3, -1, -1] and b.slot_mapping.dtype == torch.int64
    assert b.seq_lens.tolist() == [21, 4, 1, 1] and b.seq_lens.dtype == torch.int32
    # only the blocks a context needs; width = the widest real row; padding rows read block 0
    assert b.block_tables.tolist() == [[5, 7], [9, 0], [0, 0], [0, 0]] and b.block_tables.dtype == torch.int32


@pytest.mark.quick
def test_pack_exact_bucket_has_no_padding_and_block_boundaries_are_right():
    b = pack_decode_batch([1], [15], [[4, 6]], bucket=1, block_size=16, max_blocks=4)  # last slot of block 4
    assert b.slot_mapping.tolist() == [4 * 16 + 15] and b.block_tables.tolist() == [[4]] and b.seq_lens.tolist() == [16]
    b = pack_decode_batch([1], [16], [[4, 6]], bucket=1, block_size=16, max_blocks=4)  # first slot of block 6
    assert b.slot_mapping.tolist() == [6 * 16] and b.block_tables.tolist() == [[4, 6]] and b.seq_lens.tolist() == [17]


@pytest.mark.quick
def test_pack_refuses_what_a_graph_cannot_run():
    assert pack_decode_batch([], [], [], 4, 16, 8) is None  # nothing to run
    assert pack_decode_batch([1, 2, 3], [0, 0, 0], [[1], [2], [3]], 2, 16, 8) is None  # batch above the bucket
    assert pack_decode_batch([1], [16 * 8], [list(range(9))], 1, 16, 8) is None  # context beyond max_blocks
    assert pack_decode_batch([1], [16], [[3]], 1, 16, 8) is None  # block list too short for the context
    assert pack_decode_batch([1], [16 * 8 - 1], [list(range(8))], 1, 16, 8) is not None  # the longest allowed


@pytest.mark.quick
def test_decode_lists_only_for_pure_decode_steps():
    seqs = [SimpleNamespace(token_ids=[4], start=9, block_ids=[1]),
            SimpleNamespace(token_ids=[5], start=0, block_ids=[2])]
    assert decode_lists(seqs) == ([4, 5], [9, 0], [[1], [2]])
    seqs.append(SimpleNamespace(token_ids=[6, 7], start=0, block_ids=[3]))  # a prefill chunk
    assert decode_lists(seqs) is None


@pytest.mark.quick
def test_static_buffers_load_reset_and_meta():
    buf = StaticDecodeInputs(max_bucket=8, max_blocks=6, device=CPU)
    assert buf.cu_seqlens_q.tolist() == list(range(9)) and buf.slot_mapping.tolist() == [-1] * 8
    buf.block_tables.fill_(33)  # stale ids from an earlier, wider step
    buf.load(pack_decode_batch([11, 12, 13], [20, 3, 40], [[5, 7], [9], [1, 2, 3]], 4, 16, 6))
    assert buf.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert buf.slot_mapping[:4].tolist() == [7 * 16 + 4, 9 * 16 + 3, 3 * 16 + 8, -1]
    assert buf.seq_lens[:4].tolist() == [21, 4, 41, 1]
    assert buf.block_tables[:4, :3].tolist() == [[5, 7, 0], [9, 0, 0], [1, 2, 3], [0, 0, 0]]
    assert (buf.block_tables[:4, 3:] == 33).all()  # past the batch's width: stale, never read
    assert (buf.block_tables[4:] == 33).all() and buf.slot_mapping[4:].tolist() == [-1] * 4  # other rows untouched
    meta = buf.meta(4)
    assert meta.max_seqlen_q == 1 and meta.cu_seqlens_q.tolist() == [0, 1, 2, 3, 4]
    assert meta.block_tables.shape == (4, 6) and meta.slot_mapping.shape == (4,) and meta.seq_lens.shape == (4,)
    assert meta.block_tables.data_ptr() == buf.block_tables.data_ptr()  # views: a graph sees later loads
    buf.reset(4)
    assert buf.slot_mapping[:4].tolist() == [-1] * 4 and buf.seq_lens[:4].tolist() == [1] * 4
    assert buf.input_ids[:4].tolist() == [0] * 4 and (buf.block_tables[:4] == 0).all()


@pytest.mark.quick
def test_graph_split_count_is_static_and_fills_short_contexts():
    # the CPU counts 16 SMs: the automatic policy splits only below 2 * 16 (seq, kv head) programs
    assert graph_decode_splits(64, 8, 8192, CPU) == 1  # the batch fills the device: no split-K, as eagerly
    assert graph_decode_splits(1, 8, 8192, CPU) == 16  # ~512-token splits over the whole table
    assert graph_decode_splits(2, 8, 1024, CPU) == 2
    assert graph_decode_splits(1, 8, 512, CPU) == 1  # too short to split
    assert graph_decode_splits(1, 1, 64 * 1024, CPU) == 32  # capped


@pytest.mark.quick
def test_graphs_need_cuda_and_the_triton_backend():
    assert decode_graphs_unsupported(CPU, get_ops("torch")) is not None
    assert "not 'triton'" in decode_graphs_unsupported(torch.device("cuda", 0), get_ops("torch"))
    assert decode_graphs_unsupported(torch.device("cuda", 0), SimpleNamespace(backend="triton")) is None
    runner = make_runner()
    with pytest.raises(ValueError, match="CUDA"):
        DecodeGraphs(runner.model, runner.kv_cache, block_size=16, max_model_len=256, max_num_seqs=4)


# --- the static-buffer forward against the eager one ----------------------------------------------


def greedy_tokens(runner: ModelRunner, prompts: list[list[int]], steps: int) -> list[list[int]]:
    blocks = [list(range(1 + 3 * i, 4 + 3 * i)) for i in range(len(prompts))]
    toks: list[list[int]] = [[] for _ in prompts]
    for t in range(steps + 1):
        seqs = [SeqInput(f"s{i}", p if t == 0 else [toks[i][-1]], 0 if t == 0 else len(p) + t - 1, blocks[i],
                         SampleRequest(GREEDY, p + toks[i], len(p), t)) for i, p in enumerate(prompts)]
        outs = runner.execute(StepInput(seqs))
        for i in range(len(prompts)):
            toks[i].append(outs[f"s{i}"].token_id)
    return toks


@pytest.mark.parametrize("batch", [4, 3])  # fills bucket 4; padded to 4
def test_runner_with_graphs_generates_the_eager_tokens(batch):
    rng = random.Random(batch)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(4, 30))] for _ in range(batch)]
    runner = make_runner()
    eager = greedy_tokens(runner, prompts, 6)
    graphs = attach(runner, max_num_seqs=8)
    assert graphs.capture_all() >= 0 and graphs.captured
    runner.kv_cache.zero_()
    assert greedy_tokens(runner, prompts, 6) == eager
    assert graphs.replays == 6  # every decode step went through the static buffers; the prefill did not


@pytest.mark.quick
def test_static_forward_matches_eager_hidden_states_and_padding_writes_no_kv():
    runner = make_runner()
    runner.kv_cache.normal_()  # a full cache: reads of stale/padding slots would show
    seqs = decode_seqs([37, 5, 80])
    eager = runner._forward(StepInput(seqs))
    eager_kv = runner.kv_cache.clone()
    runner.kv_cache.copy_(torch.randn_like(runner.kv_cache))  # every slot differs from the eager run ...
    for s in seqs:  # ... except the context of the real sequences (the new token's slot is rewritten)
        for pos in range(s.start):
            blk, off = s.block_ids[pos // 16], pos % 16
            runner.kv_cache[:, :, blk, off] = eager_kv[:, :, blk, off]
    before = runner.kv_cache.clone()
    graphs = attach(runner, lazy=True)
    out = graphs.run(seqs)
    assert out.shape == eager.shape == (3, 128)
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    written = before != runner.kv_cache
    changed_slots = {(int(b), int(o)) for b, o in written.nonzero()[:, 2:4].tolist()}
    assert changed_slots == {(s.block_ids[s.start // 16], s.start % 16) for s in seqs}  # padding row 3 wrote nothing
    assert graphs.is_captured(4) and not graphs.is_captured(1)  # lazily: only the bucket it needed


def test_triton_kernels_through_static_buffers_match_eager_under_the_interpreter():
    """The graph's forced split-K count (16 splits over a 2048-token table) and the padded rows, with the
    Triton kernels run by the interpreter: the same hidden states as the eager Triton forward."""
    runner = make_runner("triton", max_model_len=2048)
    runner.kv_cache.normal_()
    graphs = attach(runner, max_model_len=2048, max_num_seqs=4, lazy=True)
    assert graph_decode_splits(4, 4, 2048, CPU) > 1  # the split-K path is what is tested here
    seqs = decode_seqs([70, 9, 33])  # padded to bucket 4
    eager = runner._forward(StepInput(seqs))
    out = graphs.run(seqs)
    torch.testing.assert_close(out, eager, rtol=1e-4, atol=1e-4)


def test_run_declines_steps_it_cannot_replay():
    runner = make_runner()
    graphs = attach(runner, max_num_seqs=4)
    seqs = decode_seqs([5, 6])
    assert graphs.run(seqs) is None  # not captured and not lazy: eager
    graphs.capture_all()
    assert graphs.run(seqs) is not None
    prefill = [SeqInput("p", [1, 2, 3], 0, [1])]
    assert graphs.run(seqs + prefill) is None  # mixed step
    assert graphs.run(decode_seqs([5] * 5)) is None  # above the largest bucket
    assert graphs.run(decode_seqs([300])) is None  # longer than max_model_len
    assert graphs.replays == 1
    # the runner falls back to the eager path for all of them
    assert set(runner.execute(StepInput(decode_seqs([5] * 5)))) == {f"s{i}" for i in range(5)}


# --- runner, engine and loader integration --------------------------------------------------------


@pytest.mark.quick
def test_prepare_decode_captures_once_then_reuses():
    runner = make_runner()
    assert runner.prepare_decode() == 0.0  # no graphs: nothing to do
    graphs = attach(runner)
    assert runner.prepare_decode() > 0.0 and graphs.captured
    first = graphs.capture_ms
    assert runner.prepare_decode() == 0.0 and graphs.capture_ms == first


@pytest.mark.quick
def test_failed_capture_turns_graphs_off_and_steps_run_eagerly(monkeypatch):
    runner = make_runner()
    graphs = attach(runner)

    def boom(bucket):
        raise RuntimeError("capture failed on purpose")

    monkeypatch.setattr(graphs, "capture", boom)
    assert runner.prepare_decode() == 0.0
    assert runner.graphs is None and "on purpose" in runner.graphs_error
    outs = runner.execute(StepInput(decode_seqs([5, 9])))
    assert all(o.token_id is not None for o in outs.values())


@pytest.mark.quick
def test_switch_to_decode_captures_in_the_engine_thread_and_is_reused():
    runner = make_runner()
    graphs = attach(runner)
    threads = []
    real = runner.prepare_decode

    def spy():
        import threading

        threads.append(threading.current_thread().name)
        return real()

    runner.prepare_decode = spy

    async def go():
        role = DeviceRole("cpu:0", Role.PREFILL, time.monotonic(), 0.0)
        engine = DeviceEngine("cpu:0", LocalEngine(EngineCore(runner)),
                              Batcher(BlockLedger(runner.num_blocks, 16), BatchConfig()), time.monotonic, role)
        try:
            first = await engine.switch_role(Role.DECODE, "test")
            captured_ms = graphs.capture_ms
            await engine.switch_role(Role.PREFILL, "test")
            again = await engine.switch_role(Role.DECODE, "test")
            return first, again, captured_ms, role.role
        finally:
            await engine.stop()

    first, again, captured_ms, final_role = asyncio.run(go())
    assert graphs.captured and graphs.capture_ms == captured_ms  # the second switch reused them
    assert first.swap_ms >= captured_ms * 0.9  # the capture is paid inside the measured swap
    assert final_role is Role.DECODE
    assert len(threads) == 2 and all(t.startswith("engine") for t in threads)  # only DECODE switches, in the engine's thread


def parse_serve(*argv: str) -> NodeConfig:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="command")
    serve_parser(sub)
    return config_from_args(ap.parse_args(["serve", *argv]))


@pytest.mark.quick
def test_enforce_eager_flag_parses():
    assert parse_serve().enforce_eager is False
    assert parse_serve("--enforce-eager").enforce_eager is True
    assert NodeConfig().enforce_eager is False


@pytest.mark.quick
def test_loader_attaches_graphs_only_where_supported(monkeypatch):
    import node.worker.loader as loader

    runner = make_runner()
    attach_decode_graphs(runner, NodeConfig(), 256, get_ops("torch"), "cpu:0")
    assert runner.graphs is None  # CPU: eager

    made = []

    class FakeGraphs:
        buckets = (1, 2)

        def __init__(self, model, kv_cache, **kw):
            made.append(kw)
            self.captured = False

        def capture_all(self):
            self.captured = True
            return 1.0

    monkeypatch.setattr(loader, "decode_graphs_unsupported", lambda device, ops: None)  # pretend CUDA + Triton
    monkeypatch.setattr(loader, "DecodeGraphs", FakeGraphs)
    attach_decode_graphs(runner, NodeConfig(enforce_eager=True), 256, None, "cuda:0")
    assert runner.graphs is None and not made
    attach_decode_graphs(runner, NodeConfig(mode="time-shared", max_num_seqs=32, block_size=16), 256, None, "cuda:0")
    assert made[-1] == dict(block_size=16, max_model_len=256, max_num_seqs=32)
    assert runner.graphs.captured  # time-shared too: captured at start-up, never while requests wait
    runner.graphs = None
    attach_decode_graphs(runner, NodeConfig(mode="colocated"), 256, None, "cuda:0")
    assert runner.graphs.captured  # colocated: captured at start-up


# --- on a GPU --------------------------------------------------------------------------------------


@pytest.mark.quick
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (CPU coverage: the tests above)")
def test_cuda_graph_replay_matches_eager_on_gpu():  # pragma: no cover - needs a GPU
    import os

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("the Triton kernels were defined for the interpreter in this process")
    cfg = ModelConfig.from_dict(BYTE_LEVEL_MODEL_CONFIG)
    dev = torch.device("cuda", 0)
    model = build_model(cfg, folder=None, load_format="dummy", dtype=torch.float32, device=dev, max_positions=256,
                        ops=get_ops("triton"), seed=0)
    runner = ModelRunner(model, cfg, dev, 48, 16, torch.float32)
    runner.kv_cache.normal_()
    runner.graphs = DecodeGraphs(model, runner.kv_cache, block_size=16, max_model_len=256, max_num_seqs=8)
    runner.prepare_decode()
    seqs = decode_seqs([37, 5, 80])
    eager = runner._forward(StepInput(seqs)).clone()
    torch.testing.assert_close(runner.graphs.run(seqs), eager, rtol=1e-4, atol=1e-4)
