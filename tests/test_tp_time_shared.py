"""Time-shared mode on tensor-parallel groups: ``--decode-tp D --prefill-tp P`` (node.worker.role_layouts).

A node in this process over ``cpu:0,cpu:1`` as one group: the group decodes as one instance at degree
2 and, in the prefill role, runs as two instances at degree 1 (``P = 1``) or one at degree 2
(``P = 2``). With a 4-token budget per instance every prompt is chunked, chunks of one sequence land
on either instance from step to step (reading the KV the other instance wrote into the decode
layout), and requests that arrive while others decode make the group switch back and forth. The
four stories260k reference prompts give llama2.c's reference tokens exactly across those switches;
every block returns to the group's ledger; ``/v1/node`` shows both role configurations, the
layout the ranks run and the KV bytes the prefill instances wrote into the other device's pool
(``tokens x kv_bytes_per_token x (1 - P/D)``). A KV budget too small for the cases plus three more copies of the
longest forces preemption and recompute, still exact; an aborted request frees its blocks; sampled requests
(seeded and not) keep the ranks in agreement through composite steps. The refusals of flags the
slice does not run are checked without starting an engine. Hand-offs between groups of different
degrees re-shard the KV heads: pooled mode with its prefill pool at ``P`` and its decode pool at ``D``,
and a sequence moved between two time-shared groups, both keep the reference tokens.
"""

from __future__ import annotations

import asyncio

import pytest

from node.config import ConfigError, NodeConfig
from node.core.sequence import SamplingParams
from node.runtime.node import Node
from node.worker.loader import StartupError, load_model_info
from support import STORIES, reference_cases, require_shared
from test_tp_engines import run_case

KV_BYTES = 5 * 1024 * 1024


def ts_config(**over) -> NodeConfig:
    base = dict(model=str(STORIES), devices=["cpu:0", "cpu:1"], mode="time-shared", decode_tp=2, prefill_tp=1,
                kv_cache_memory_bytes=KV_BYTES, max_num_batched_tokens=4, min_window_ms=1, max_window_ms=20)
    return NodeConfig(**(base | over))


async def staggered(node: Node, cases: list[dict], gap_s: float = 0.15) -> list[list[int]]:
    """The longest case first, then the others one by one while it decodes (each arrival sends the
    group back to the prefill role)."""
    order = sorted(range(len(cases)), key=lambda i: -len(cases[i]["output_token_ids"]))
    tasks = {}
    for k, i in enumerate(order):
        tasks[i] = asyncio.create_task(run_case(node, f"ref-{i}", cases[i]))
        if k < len(order) - 1:
            await asyncio.sleep(gap_s)
    return [await tasks[i] for i in range(len(cases))]


@pytest.mark.parametrize("prefill_tp", [1, 2])
def test_a_group_serves_the_references_exactly_across_switches(prefill_tp):
    require_shared()
    cases = reference_cases()

    async def go():
        node = await Node.create(ts_config(prefill_tp=prefill_tp))
        node.start()
        try:
            engine = node.engines[0]
            assert engine.device_id == "cpu:0+cpu:1" and engine.runner.active_role == "prefill"
            got = await staggered(node, cases)
            for g, c in zip(got, cases):
                assert g == c["output_token_ids"], c["prompt"]
            assert engine.failure is None and not engine.errors, engine.errors
            assert engine.batcher.ledger.num_used == 0
            assert engine.role.count >= 3, engine.role.count  # the long request spanned several switches
            st = node.status()["devices"][0]
            assert st["role_configs"] == {
                "prefill": {"role": "prefill", "tp_degree": prefill_tp, "instances": 2 // prefill_tp, "token_budget": 4,
                            "cuda_graphs": False},
                "decode": {"role": "decode", "tp_degree": 2, "instances": 1, "token_budget": 256, "cuda_graphs": False}}
            assert st["tensor_parallel"]["active_layout"] in ("prefill", "decode")
            info = load_model_info(ts_config())
            prompt_tokens = sum(len(c["prompt_token_ids"]) for c in cases)
            per_token = info.cfg.kv_bytes_per_token(info.dtype)
            assert st["kv_scatter_bytes"] == prompt_tokens * per_token * (2 - prefill_tp) // 2
            switches = [s for s in st["switches"] if s["to_role"] == "decode"]
            assert switches and all(s["swap_ms"] > 0 for s in switches)  # a measured reconfiguration
        finally:
            await node.close()

    asyncio.run(go())


def test_preemption_abort_and_sampling_on_a_group():
    require_shared()
    cases = reference_cases()
    info = load_model_info(ts_config())
    per_rank = info.cfg.kv_bytes_per_token(info.dtype) // 2
    # 32 blocks of 16 tokens per rank (one max-length sequence): preemption and recompute
    kv = 32 * 16 * per_rank

    async def go():
        node = await Node.create(ts_config(kv_cache_memory_bytes=kv))
        node.start()
        try:
            engine = node.engines[0]
            assert engine.batcher.ledger.num_blocks == 32
            # placement reserves 128 output tokens a request; the 200-token case outgrows it: four at once
            twice = [cases[0]] * 3 + cases  # three placed at once (9 blocks reserved each) grow to 13 each
            got = await asyncio.gather(*(run_case(node, f"ref-{i}", c) for i, c in enumerate(twice)))
            for g, c in zip(got, twice):
                assert g == c["output_token_ids"], c["prompt"]
            assert engine.batcher.num_preemptions > 0
            assert engine.batcher.ledger.num_used == 0

            # an abort mid-stream frees the request's blocks (the ledger is the group's)
            params = SamplingParams(max_tokens=150, temperature=0.0)
            n = 0
            async for _, d in node.generate("aborted", cases[0]["prompt_token_ids"], params):
                n += len(d.token_ids)
                if n >= 10:
                    break
            for _ in range(100):
                if engine.batcher.ledger.num_used == 0:
                    break
                await asyncio.sleep(0.05)
            assert engine.batcher.ledger.num_used == 0

            # sampled requests, seeded and not, through composite prefill steps: the ranks agree
            seeded = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=7)
            runs = []
            for extra in (0, 2):  # alone, then beside two unseeded requests
                others = [asyncio.create_task(_collect(node, f"u{extra}-{k}", cases[k + 1]["prompt_token_ids"],
                                                       SamplingParams(max_tokens=24, temperature=1.0)))
                          for k in range(extra)]
                runs.append(await _collect(node, f"seeded-{extra}", cases[1]["prompt_token_ids"], seeded))
                for t in others:
                    await t
            assert runs[0] == runs[1] and len(runs[0]) == 24
            assert engine.failure is None and engine.batcher.ledger.num_used == 0
        finally:
            await node.close()

    asyncio.run(go())


async def _collect(node: Node, rid: str, prompt: list[int], params: SamplingParams) -> list[int]:
    ids = []
    async for _, d in node.generate(rid, prompt, params):
        assert d.error is None, d.error
        ids += d.token_ids
    return ids


@pytest.mark.quick
@pytest.mark.parametrize("over, message", [
    (dict(prefill_tp=3, devices=["cpu:0", "cpu:1", "cpu:2"], decode_tp=3), None),  # model check below
    (dict(prefill_tp=2, decode_tp=1, devices=["cpu:0"]), r"--prefill-tp 2 must divide --decode-tp 1"),
    (dict(devices=["cpu:0", "cpu:1", "cpu:2"]), r"--decode-tp 2 groups --devices in consecutive runs of 2, but 3"),
    (dict(mode="colocated"), r"--decode-tp and --prefill-tp are the per-role degrees of time-shared and pooled "
                             r"modes \(the mode is colocated\): colocated mode takes --tensor-parallel-size"),
    (dict(mode="pooled", prefill_devices=["cpu:0"], decode_devices=["cpu:1", "cpu:2", "cpu:3"], decode_tp=2,
          devices=["cpu:0", "cpu:1", "cpu:2", "cpu:3"]),
     r"--decode-tp 2 groups --decode-devices in consecutive runs of 2, but 3 devices"),
    (dict(engine_layout="thread"), r"--decode-tp 2 needs --engine-layout process"),
    (dict(decode_tp=0), r"--decode-tp must be a positive integer, got 0"),
])
def test_flags_the_slice_does_not_run_are_refused(over, message):
    config = ts_config(**over)
    if message is None:  # stories260k: 8 heads, 4 KV heads; degree 3 divides neither
        config.validate()
        with pytest.raises(StartupError, match=r"--decode-tp 3: tensor-parallel degree 3 does not divide the model's "
                                               r"num_attention_heads 8, num_key_value_heads 4"):
            asyncio.run(Node.create(config))
        return
    with pytest.raises(ConfigError, match=message):
        config.validate()
    with pytest.raises(StartupError, match=message):
        asyncio.run(Node.create(config))


# --- hand-offs between groups of different degrees (pooled mode, moves between time-shared groups) --------


@pytest.mark.quick
@pytest.mark.parametrize("src, dst", [(1, 2), (2, 1), (2, 4), (4, 2), (1, 4), (2, 2)])
def test_a_sharded_copy_re_shards_the_kv_heads(src, dst):
    import torch

    from node.transport.local import copy_sharded_blocks, head_overlaps

    layers, blocks, bs, heads, hd = 3, 10, 4, 4, 8
    g = torch.Generator().manual_seed(src * 10 + dst)
    whole = torch.randn(layers, 2, blocks, bs, heads, hd, generator=g)
    src_pools = [whole[..., r * heads // src : (r + 1) * heads // src, :].clone() for r in range(src)]
    dst_pools = [torch.zeros(layers, 2, blocks + 3, bs, heads // dst, hd) for _ in range(dst)]
    src_ids, dst_ids = [7, 2, 5], [0, 11, 4]
    report = copy_sharded_blocks(src_pools, src_ids, dst_pools, dst_ids)
    got = torch.cat(dst_pools, dim=4)
    assert torch.equal(got[:, :, dst_ids], whole[:, :, src_ids])
    untouched = [b for b in range(blocks + 3) if b not in dst_ids]
    assert not got[:, :, untouched].any()
    assert report.nbytes == whole[:, :, src_ids].numel() * 4
    spans = head_overlaps(heads, src, dst)
    assert sum(b - a for _, _, a, b in spans) == heads and [a for _, _, a, _ in spans] == sorted(a for _, _, a, _ in spans)


@pytest.mark.parametrize("prefill_tp, decode_tp", [(1, 2), (2, 1)])
def test_pooled_pools_at_their_own_degrees_hand_off_exactly(prefill_tp, decode_tp):
    """Pooled mode with a prefill pool at degree P and a decode pool at D (what disaggregation buys):
    each hand-off re-shards the KV heads between the groups' ranks; the references come out exactly."""
    require_shared()
    cases = reference_cases()
    pre = [f"cpu:{i}" for i in range(prefill_tp)]
    dec = [f"cpu:{i}" for i in range(prefill_tp, prefill_tp + decode_tp)]

    async def go():
        config = ts_config(mode="pooled", devices=pre + dec, prefill_devices=pre, decode_devices=dec,
                           prefill_tp=prefill_tp, decode_tp=decode_tp, max_num_batched_tokens=8)
        config.validate()
        node = await Node.create(config)
        node.start()
        try:
            assert [e.device_id for e in node.engines] == ["+".join(pre), "+".join(dec)]
            got = await asyncio.gather(*(run_case(node, f"ref-{i}", c) for i, c in enumerate(cases)))
            for g, c in zip(got, cases):
                assert g == c["output_token_ids"], c["prompt"]
            assert len(node.migrations) == len(cases)
            assert all(e.batcher.ledger.num_used == 0 and e.failure is None and not e.errors for e in node.engines)
            roles = {d["device"]: d["role"] for d in node.status()["devices"]}
            assert roles == {"+".join(pre): "prefill", "+".join(dec): "decode"}
        finally:
            await node.close()

    asyncio.run(go())


def test_a_decoding_sequence_moves_between_time_shared_groups_exactly():
    """Four devices as two groups of two: a sequence moved mid-decode from one group to the other (the
    imbalance fallback's move, forced) goes on with the reference tokens; both ledgers end empty."""
    require_shared()
    case = reference_cases()[0]

    async def go():
        node = await Node.create(ts_config(devices=[f"cpu:{i}" for i in range(4)], imbalance_threshold=0.0))
        node.start()
        try:
            a, b = node.engines
            assert (a.device_id, b.device_id) == ("cpu:0+cpu:1", "cpu:2+cpu:3")
            params = SamplingParams(max_tokens=case["max_new_tokens"], temperature=0.0)
            ids, moved = [], None
            async for req, d in node.generate("moving", case["prompt_token_ids"], params):
                assert d.error is None, d.error
                ids += d.token_ids
                if moved is None and len(ids) >= 20:
                    seq = req.seqs[0]
                    src, dst = (a, b) if seq.device_id == a.device_id else (b, a)
                    moved = src.migrate(seq, dst, "test")
            record = await moved
            assert record is not None and record.dst == dst.device_id
            assert ids == case["output_token_ids"]
            assert a.batcher.ledger.num_used == 0 and b.batcher.ledger.num_used == 0
        finally:
            await node.close()

    asyncio.run(go())


def test_prefix_hits_on_blocks_written_in_the_same_step_stay_exact():
    """Many prompts sharing their first block arrive at once (a reference prompt plus the first ``k``
    reference tokens): the first admitted writes the block, later ones in the same composite step
    reuse it from the prefix cache. They run on the writer's instance (instances run side by side, so
    another instance could read the block before it is written), and every continuation is exact."""
    require_shared()
    case = reference_cases()[0]
    want = case["output_token_ids"]

    async def go():
        node = await Node.create(ts_config(max_num_batched_tokens=64))
        node.start()
        try:
            ks = list(range(11, 41))
            prompts = [case["prompt_token_ids"] + want[:k] for k in ks]
            params = SamplingParams(max_tokens=4, temperature=0.0)
            got = await asyncio.gather(*(_collect(node, f"p{k}", p, params) for k, p in zip(ks, prompts)))
            for k, g in zip(ks, got):
                assert g == want[k : k + 4], k
            engine = node.engines[0]
            assert engine.batcher.prefix_hit_tokens > 0 and engine.batcher.ledger.num_used == 0
        finally:
            await node.close()

    asyncio.run(go())
