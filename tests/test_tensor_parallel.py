"""Tensor parallelism on the CPU: the same model code over gloo process groups of separate rank processes.

Two worlds of ranks (``torch.multiprocessing``, gloo, a ``file://`` rendezvous), each started once per
module, run the multi-rank checks and leave their measurements per rank in a file; the tests assert on
them:

* two ranks: stories260k greedy generation over the paged KV path (the model runner, the four
  reference prompts batched: ragged prefill, then decode) at TP=2 equals llama2.c's reference tokens
  exactly and in full (float32); then, for the tiny_configs families (GQA x4/x3/x2, llama3 rope
  scaling and an untied head with an uneven vocab split, q/k/v biases, q/k norms with head_dim !=
  hidden/heads) on random weights, every layer's outputs, the final hidden states and the logits of
  TP=2 stay within a relative error of 1e-5 of the plain TP=1 model over ragged prefill + chunked
  prefill + decode steps, and each rank's KV pool holds exactly its KV heads of the TP=1 pool; both
  with all weights stored (layout 2) and with each rank holding only its half;
* four ranks (slow collectives: four processes on two cores, so the first ``PREFIX_TOKENS`` tokens of
  each case): one copy of the weights stored for layout degree 4 runs at TP=4 and at TP=2 (its views
  for degree 2), and ranks holding half of the weights run at TP=4, all equal to the reference;
* every shard is a view inside the stored parameter and a rank stores no second copy (parameter bytes
  per rank are counted against the geometry).

Refusals (a degree that does not divide the KV heads) and degree 1 on an interleaved layout run in
this process.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import save_file

import shiftnode_kernels.reference as ref_ops
from node.core.sequence import SamplingParams
from node.worker.model import AttentionMetadata, CausalLM
from node.worker.model_config import ModelConfig
from node.worker.runner import ModelRunner, SeqInput, StepInput
from node.worker.sampler import SampleRequest
from node.worker.tensor_parallel import (ShardLayout, TensorParallelError, TPGroup, check_tp_config,
                                         init_distributed, new_tp_group, vocab_range)
from node.worker.weights import build_model
from support import SHARED, STORIES, reference_cases, require_shared

CPU = torch.device("cpu")
TINY = SHARED / "models" / "stories260k" / "tiny_configs"
# Family -> vocab override: llama3-style gets 509 rows so the vocab shards are uneven (padded gather)
# on an untied head; the others keep 512.
FAMILIES = {"llama3-style": 509, "qwen2-style": None, "qwen3-style": None}
TOL = 1e-5
BLOCK = 4  # small blocks: every sequence spans several, interleaved in the pool


# --- helpers shared by the ranks and the tests -------------------------------------------------------------


def family_config(folder: Path, vocab: int | None) -> ModelConfig:
    raw = ModelConfig.from_folder(folder).raw
    return ModelConfig.from_dict({**raw, **({"vocab_size": vocab} if vocab else {})})


def write_random_checkpoint(cfg: ModelConfig, out: Path, seed: int) -> Path:
    """HF-named random tensors for ``cfg`` (norms around 1 and biases non-zero, so both are tested)."""
    g = torch.Generator().manual_seed(seed)
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d

    def w(*shape, std=0.08):
        return torch.randn(shape, generator=g) * std

    def norm(n):
        return 1.0 + w(n, std=0.1)

    t = {"model.embed_tokens.weight": w(cfg.vocab_size, h, std=0.5), "model.norm.weight": norm(h)}
    if not cfg.tie_word_embeddings:
        t["lm_head.weight"] = w(cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        t |= {p + "self_attn.q_proj.weight": w(q, h), p + "self_attn.k_proj.weight": w(kv, h),
              p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.o_proj.weight": w(h, q),
              p + "mlp.gate_proj.weight": w(inter, h), p + "mlp.up_proj.weight": w(inter, h),
              p + "mlp.down_proj.weight": w(h, inter),
              p + "input_layernorm.weight": norm(h), p + "post_attention_layernorm.weight": norm(h)}
        if cfg.attention_bias:
            t |= {p + "self_attn.q_proj.bias": w(q, std=0.1), p + "self_attn.k_proj.bias": w(kv, std=0.1),
                  p + "self_attn.v_proj.bias": w(kv, std=0.1)}
        if cfg.qk_norm:
            t |= {p + "self_attn.q_norm.weight": norm(d), p + "self_attn.k_norm.weight": norm(d)}
    out.mkdir(parents=True, exist_ok=True)
    save_file(t, str(out / "model.safetensors"))
    return out


def load(cfg: ModelConfig, folder: Path, layout: ShardLayout = ShardLayout(), tp: TPGroup | None = None) -> CausalLM:
    return build_model(cfg, folder=folder, load_format="safetensors", dtype=torch.float32, device=CPU,
                       max_positions=256, ops=ref_ops, layout=layout, tp=tp)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp(min=1e-30)).item()


# Ragged steps over four sequences: (seq, number of new tokens) per step. Step 0 prefills three prompts
# of different lengths; step 1 mixes decodes with a chunked prefill after a cached prefix and a new
# prompt; steps 2-3 decode all four.
STEPS = [[(0, 7), (1, 1), (2, 13)], [(0, 1), (1, 5), (2, 1), (3, 4)], [(0, 1), (1, 1), (2, 1), (3, 1)],
         [(0, 1), (1, 1), (2, 1), (3, 1)]]


def run_ragged(model: CausalLM, cfg: ModelConfig, kv_heads: int, pools: int = 1) -> dict:
    """Run :data:`STEPS` on random tokens (the same on every rank); capture every layer's outputs, the
    final hidden states, the logits of all rows and the KV pool. ``pools > 1``: the KV heads are cached
    in that many pools of ``kv_heads / pools`` heads (a time-shared group's prefill layout); ``kv`` is
    then their concatenation along the heads."""
    g = torch.Generator().manual_seed(7)
    tokens = [torch.randint(3, cfg.vocab_size, (40,), generator=g).tolist() for _ in range(4)]
    tables = [[4 * b + s for b in range(6)] for s in range(4)]  # blocks of the four sequences interleaved
    split = tuple(torch.zeros(cfg.num_layers, 2, 24, BLOCK, kv_heads // pools, cfg.head_dim) for _ in range(pools))
    kv = split[0] if pools == 1 else split
    done = [0] * 4
    layers: list[list[torch.Tensor]] = [[] for _ in range(cfg.num_layers)]
    hooks = [layer.register_forward_hook(lambda mod, args, out, i=i: layers[i].append(torch.cat(out, dim=-1).clone()))
             for i, layer in enumerate(model.layers)]
    hidden, logits = [], []
    try:
        for step in STEPS:
            ids, pos, slots, cu, lens, table = [], [], [], [0], [], []
            for s, n in step:
                p = range(done[s], done[s] + n)
                ids += tokens[s][done[s] : done[s] + n]
                pos += p
                slots += [tables[s][i // BLOCK] * BLOCK + i % BLOCK for i in p]
                cu.append(cu[-1] + n)
                lens.append(done[s] + n)
                table.append(tables[s])
                done[s] += n
            meta = AttentionMetadata(torch.tensor(slots), torch.tensor(table, dtype=torch.int32),
                                     torch.tensor(lens, dtype=torch.int32), torch.tensor(cu, dtype=torch.int32),
                                     max(n for _, n in step))
            out = model(torch.tensor(ids), torch.tensor(pos), kv, meta)
            hidden.append(out.clone())
            logits.append(model.compute_logits(out))
    finally:
        for hk in hooks:
            hk.remove()
    return {"layers": [torch.cat(x) for x in layers], "hidden": torch.cat(hidden), "logits": torch.cat(logits),
            "kv": torch.cat(split, dim=-2)}


def compare(got: dict, want: dict, tp: TPGroup, cfg: ModelConfig) -> dict:
    """Worst relative errors of ``got`` (a rank at ``tp``) against ``want`` (TP=1), and whether the
    rank's KV pool equals its KV heads of the TP=1 pool."""
    k = cfg.num_kv_heads // tp.degree
    mine = want["kv"][..., tp.rank * k : (tp.rank + 1) * k, :]
    return {"layers": max(rel_err(a, b) for a, b in zip(got["layers"], want["layers"])),
            "hidden": rel_err(got["hidden"], want["hidden"]), "logits": rel_err(got["logits"], want["logits"]),
            "logits_shape": tuple(got["logits"].shape), "kv_shape": tuple(got["kv"].shape),
            "kv": rel_err(got["kv"], mine)}


def greedy_reference(model: CausalLM, cfg: ModelConfig, max_new: int | None = None) -> list[list[int]]:
    """The four reference prompts batched through a :class:`ModelRunner` (paged KV, ragged prefill then
    decode until each has ``min(max_new_tokens, max_new)`` tokens); returns the generated ids per case
    and, last, the runner's KV pool shape."""
    cases = reference_cases()
    runner = ModelRunner(model, cfg, CPU, num_blocks=4 * (256 // 16), block_size=16, kv_dtype=torch.float32)
    ids = [list(c["prompt_token_ids"]) for c in cases]
    start = [0] * len(cases)
    blocks = [[4 * b + j for b in range(256 // 16)] for j in range(len(cases))]
    want = [len(c["prompt_token_ids"]) + min(c["max_new_tokens"], max_new or c["max_new_tokens"]) for c in cases]
    while True:
        live = [j for j in range(len(cases)) if len(ids[j]) < want[j]]
        if not live:
            break
        seqs = []
        for j in live:
            n_prompt = len(cases[j]["prompt_token_ids"])
            req = SampleRequest(SamplingParams(max_tokens=cases[j]["max_new_tokens"], temperature=0.0), ids[j],
                                n_prompt, len(ids[j]) - n_prompt)
            seqs.append(SeqInput(str(j), ids[j][start[j]:], start[j], blocks[j], sample=req))
        outs = runner.execute(StepInput(seqs))
        for j in live:
            start[j] = len(ids[j])
            ids[j].append(outs[str(j)].token_id)
    out = [x[len(c["prompt_token_ids"]):] for x, c in zip(ids, cases)]
    return out + [list(runner.kv_cache.shape)]


def view_report(model: CausalLM) -> dict:
    """Whether every shard tensor lies inside its stored parameter's storage (no copy), and the bytes
    this rank stores (each storage counted once)."""
    pairs = []
    for layer in model.layers:
        s = layer.shard
        pairs += [(s.qkv_weight, layer.qkv_proj.weight), (s.o_weight, layer.o_proj.weight),
                  (s.gate_up_weight, layer.gate_up_proj.weight), (s.down_weight, layer.down_proj.weight)]
        if s.qkv_bias is not None:
            pairs.append((s.qkv_bias, layer.qkv_proj.bias))
    pairs.append((model.head_weight, model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight))
    inside = []
    for view, base in pairs:
        lo, hi = base.data_ptr(), base.data_ptr() + base.numel() * base.element_size()
        span = sum((n - 1) * st for n, st in zip(view.shape, view.stride())) + 1
        inside.append(view.numel() > 0 and view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
                      and lo <= view.data_ptr() and view.data_ptr() + span * view.element_size() <= hi)
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    return {"all_views": all(inside), "n_checked": len(inside), "stored_bytes": sum(storages.values()),
            "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


def geometry_bytes(cfg: ModelConfig, layout: ShardLayout) -> int:
    """float32 bytes a rank stores under ``layout``: its share of the split weights, all replicated ones."""
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    split = cfg.num_layers * (h * (q + 2 * kv) + h * q + 3 * h * inter + (q + 2 * kv) * cfg.attention_bias)
    replicated = cfg.vocab_size * h + h + cfg.num_layers * (2 * h + 2 * d * cfg.qk_norm)
    head = 0
    if not cfg.tie_word_embeddings:
        start, stop, _ = vocab_range(cfg.vocab_size, layout.layout_degree, layout.held_degree, layout.held_rank)
        head = (stop - start) * h
    assert split % layout.held_degree == 0
    return 4 * (replicated + split // layout.held_degree + head)


# --- the ranks ---------------------------------------------------------------------------------------------

PREFIX_TOKENS = 32  # tokens per case in the four-rank world (four ranks share two cores: collectives are slow)


def _world2(rank: int, tmp: str, families: dict[str, tuple[str, int | None]]) -> dict:
    """TP=2 over ranks {0, 1}: full-length stories260k greedy (all weights, layout 2), then the families."""
    tp = new_tp_group(2)
    out: dict = {"greedy": {}, "views": {}, "families": {}, "seconds": {}}
    cfg = ModelConfig.from_folder(STORIES)
    model = load(cfg, STORIES, ShardLayout(2), tp)
    t0 = time.perf_counter()
    out["greedy"]["tp2"] = greedy_reference(model, cfg)
    out["seconds"]["tp2"] = time.perf_counter() - t0
    out["views"]["tp2"] = view_report(model)
    t0 = time.perf_counter()
    for fam, (folder, vocab) in families.items():
        fcfg = family_config(Path(folder), vocab)
        want = run_ragged(load(fcfg, Path(folder)), fcfg, fcfg.num_kv_heads)
        k = fcfg.num_kv_heads // 2
        full = load(fcfg, Path(folder), ShardLayout(2), tp)
        held = load(fcfg, Path(folder), ShardLayout(2, 2, tp.rank), tp)
        out["families"][fam] = {"full": compare(run_ragged(full, fcfg, k), want, tp, fcfg),
                                "held": compare(run_ragged(held, fcfg, k), want, tp, fcfg),
                                "views": view_report(held),
                                "expected_bytes": geometry_bytes(fcfg, ShardLayout(2, 2, tp.rank))}
    out["seconds"]["families"] = time.perf_counter() - t0
    return out


def _world4(rank: int, tmp: str, families: dict) -> dict:
    """One copy of the stories260k weights stored for layout degree 4 runs at TP=4, then at TP=2 (groups
    {0,1} and {2,3}) on views of the same storage; then ranks holding half of the weights (held degree
    2: ranks 0,1 hold layout blocks 0-1, ranks 2,3 blocks 2-3) run at TP=4."""
    tp4, tp2 = new_tp_group(4), new_tp_group(2)
    out: dict = {"greedy": {}, "views": {}, "seconds": {}}
    cfg = ModelConfig.from_folder(STORIES)
    model = load(cfg, STORIES, ShardLayout(4))
    half = load(cfg, STORIES, ShardLayout(4, 2, rank // 2), tp4)
    for name, m, tp in (("tp4", model, tp4), ("tp2_of_layout4", model, tp2), ("tp4_held2", half, tp4)):
        m.set_tensor_parallel(tp)
        t0 = time.perf_counter()
        out["greedy"][name] = greedy_reference(m, cfg, PREFIX_TOKENS)
        out["seconds"][name] = time.perf_counter() - t0
        out["views"][name] = view_report(m)
    return out


def _rank_main(rank: int, world: int, tmp: str, families: dict) -> None:
    torch.set_num_threads(1)  # ranks share two cores
    t0 = time.perf_counter()
    init_distributed(rank, world, f"file://{tmp}/rendezvous", CPU, timeout_s=120)
    out = (_world2 if world == 2 else _world4)(rank, tmp, families)
    out["seconds"]["rank_total"] = time.perf_counter() - t0
    torch.save(out, Path(tmp) / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()
    os._exit(0)  # results are on disk: skip the interpreter's teardown of torch (seconds on busy cores)


def spawn_world(world: int, tmp: Path, families: dict) -> list[dict]:
    """Start ``world`` fresh rank processes with ``torch.multiprocessing`` and wait for them.

    Start method ``forkserver``: each rank is forked from a clean single-threaded server process (no
    state of this pytest process, as with ``spawn``) that imported torch and the model code once, so
    four ranks do not each import torch on two busy cores (about 10 s saved per world).
    """
    t0 = time.perf_counter()
    mp.set_forkserver_preload(["torch", "node.worker.runner", "node.worker.weights", "test_tensor_parallel"])
    mp.start_processes(_rank_main, args=(world, str(tmp), families), nprocs=world, join=True,
                       start_method="forkserver")
    res = [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(world)]
    print(f"\ntensor-parallel world of {world}: {time.perf_counter() - t0:.1f} s; rank 0:",
          {k: round(v, 1) for k, v in res[0]["seconds"].items()})
    return res


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    """Two rank processes; their measurements."""
    require_shared()
    tmp = tmp_path_factory.mktemp("tp2")
    families = {}
    for i, (fam, vocab) in enumerate(FAMILIES.items()):
        folder = write_random_checkpoint(family_config(TINY / fam, vocab), tmp / fam, seed=i)
        (folder / "config.json").write_text((TINY / fam / "config.json").read_text())
        families[fam] = (str(folder), vocab)
    return spawn_world(2, tmp, families)


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    """Four rank processes; their measurements."""
    require_shared()
    return spawn_world(4, tmp_path_factory.mktemp("tp4"), {})


# --- multi-rank checks -------------------------------------------------------------------------------------


def check_greedy(ranks: list[dict], run: str, degree: int, max_new: int | None) -> None:
    cfg = ModelConfig.from_folder(STORIES)
    want = [c["output_token_ids"][:max_new] for c in reference_cases()]
    for r, res in enumerate(ranks):
        *got, kv_shape = res["greedy"][run]
        assert got == want, (run, r)
        assert kv_shape == [cfg.num_layers, 2, 64, 16, cfg.num_kv_heads // degree, cfg.head_dim], (run, r)
    print(f"{run}: {max(res['seconds'][run] for res in ranks):.1f} s for four greedy cases")


def test_stories260k_greedy_tp2_equals_reference(world2):
    check_greedy(world2, "tp2", 2, None)


@pytest.mark.parametrize("run", ["tp4", "tp2_of_layout4", "tp4_held2"])
def test_stories260k_greedy_tp4_equals_reference_prefix(world4, run):
    check_greedy(world4, run, 2 if run.startswith("tp2") else 4, PREFIX_TOKENS)


@pytest.mark.quick
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_hidden_states_match_tp1(world2, family):
    cfg = family_config(TINY / family, FAMILIES[family])
    tokens = sum(n for step in STEPS for _, n in step)
    for res in world2:
        for how in ("full", "held"):
            c = res["families"][family][how]
            assert c["layers"] <= TOL and c["hidden"] <= TOL and c["logits"] <= TOL, (family, how, c)
            assert c["kv"] <= TOL, (family, how, c)
            assert c["logits_shape"] == (tokens, cfg.vocab_size)
            assert c["kv_shape"][4] == cfg.num_kv_heads // 2


@pytest.mark.quick
def test_shards_are_views_without_a_second_copy(world2, world4):
    cfg = ModelConfig.from_folder(STORIES)
    runs = [(world2, "tp2", lambda r: ShardLayout(2)), (world4, "tp4", lambda r: ShardLayout(4)),
            (world4, "tp2_of_layout4", lambda r: ShardLayout(4)), (world4, "tp4_held2", lambda r: ShardLayout(4, 2, r // 2))]
    for ranks, run, layout in runs:
        for r, res in enumerate(ranks):
            v = res["views"][run]
            assert v["all_views"] and v["n_checked"] == 4 * cfg.num_layers + 1, (run, r)
            assert v["stored_bytes"] == v["param_bytes"] == geometry_bytes(cfg, layout(r)), (run, r, v)
    for r, res in enumerate(world2):
        for fam, f in res["families"].items():
            assert f["views"]["all_views"], (fam, r)
            assert f["views"]["stored_bytes"] == f["expected_bytes"], (fam, r, f["views"])
    # held degree 2 really stores half of the split weights
    assert geometry_bytes(cfg, ShardLayout(4, 2, 0)) < geometry_bytes(cfg, ShardLayout(4))


# --- single-process checks ---------------------------------------------------------------------------------


@pytest.mark.quick
def test_degree_not_dividing_kv_heads_is_refused():
    cfg = family_config(TINY / "qwen2-style", None)  # 6 heads, 2 KV heads
    with pytest.raises(TensorParallelError, match=r"degree 4 does not divide the model's "
                                                  r"num_attention_heads 6, num_key_value_heads 2 \("):
        check_tp_config(cfg, 4)
    stories = ModelConfig.from_folder(STORIES)  # 8 heads, 4 KV heads: only the KV heads refuse degree 8
    only_kv = ModelConfig.from_dict({**stories.raw, "intermediate_size": 176})
    with pytest.raises(TensorParallelError, match=r"degree 8 does not divide the model's num_key_value_heads 4 \("):
        check_tp_config(only_kv, 8)
    odd = ModelConfig.from_dict({**stories.raw, "intermediate_size": 170})
    with pytest.raises(TensorParallelError, match=r"degree 4 does not divide the model's intermediate_size 170 \("):
        check_tp_config(odd, 4)
    for degree in (1, 2, 4):
        check_tp_config(stories, degree)
    with pytest.raises(TensorParallelError, match=r"degree 4 does not divide the model's num_attention_heads 6, "
                                                  r"num_key_value_heads 2"):  # at start-up: building the model
        build_model(cfg, folder=None, load_format="dummy", dtype=torch.float32, device=CPU, max_positions=16,
                    ops=ref_ops, layout=ShardLayout(4))


@pytest.mark.quick
def test_group_outside_the_layout_is_refused():
    cfg = ModelConfig.from_folder(STORIES)
    model = load(cfg, STORIES, ShardLayout(2))
    with pytest.raises(TensorParallelError, match="degree 4 does not divide the weights' layout degree 2"):
        model.set_tensor_parallel(TPGroup(rank=0, degree=4))
    with pytest.raises(TensorParallelError, match="degree 8 does not divide"):
        model.set_tensor_parallel(TPGroup(rank=0, degree=8))
    half = build_model(cfg, folder=STORIES, load_format="safetensors", dtype=torch.float32, device=CPU,
                       max_positions=16, ops=ref_ops, layout=ShardLayout(4, 2, 1))
    with pytest.raises(TensorParallelError, match="needs the weights of held rank 0 .* holds held rank 1"):
        half.set_tensor_parallel(TPGroup(rank=1, degree=4))
    with pytest.raises(TensorParallelError, match="not a multiple of the held degree 2"):
        half.set_tensor_parallel(TPGroup.single())


@pytest.mark.parametrize("family", ["stories260k", *FAMILIES])
def test_interleaved_layout_at_degree_1_equals_plain(tmp_path, family):
    """Weights stored for layout degree 2 (or 4) but run at degree 1 (every local block in turn) equal
    the plain layout; the plain layout at degree 1 is exactly the pre-tensor-parallel model (one block,
    the same views, no communication)."""
    if family == "stories260k":
        cfg, folder, m = ModelConfig.from_folder(STORIES), STORIES, 4
    else:
        cfg = family_config(TINY / family, FAMILIES[family])
        folder, m = write_random_checkpoint(cfg, tmp_path / family, seed=3), 2
    plain = load(cfg, folder)
    assert plain.tp.degree == 1 and all(layer.shard.blocks == 1 and layer.shard.reduce is None for layer in plain.layers)
    assert plain.layers[0].shard.qkv_weight.data_ptr() == plain.layers[0].qkv_proj.weight.data_ptr()
    want = run_ragged(plain, cfg, cfg.num_kv_heads)
    got = run_ragged(load(cfg, folder, ShardLayout(m)), cfg, cfg.num_kv_heads)
    c = compare(got, want, TPGroup.single(), cfg)
    assert max(c["layers"], c["hidden"], c["logits"], c["kv"]) <= 1e-6, c


@pytest.mark.parametrize("family, pools", [("stories260k", 2), ("stories260k", 4), *((f, 2) for f in FAMILIES)])
def test_prefill_layout_over_several_pools_equals_plain(tmp_path, family, pools):
    """A time-shared group's prefill layout at degree 1 (node.worker.role_layouts): a device holding the
    whole-model shard of a layout for ``pools`` ranks computes every KV head and caches head group
    ``j`` in pool ``j`` (another device's, in the node). Over ragged prefill, a chunked prefill on
    cached context (read back from the pools) and decode, every layer, the hidden states and the
    logits stay within 1e-5 of the plain model, and pool ``j`` holds exactly KV heads
    ``[j*K/pools, (j+1)*K/pools)`` of the plain pool."""
    if family == "stories260k":
        cfg, folder = ModelConfig.from_folder(STORIES), STORIES
    else:
        cfg = family_config(TINY / family, FAMILIES[family])
        folder = write_random_checkpoint(cfg, tmp_path / family, seed=5)
    assert cfg.num_kv_heads % pools == 0
    want = run_ragged(load(cfg, folder), cfg, cfg.num_kv_heads)
    held = load(cfg, folder, ShardLayout(pools, 1, 0))  # the degree-1 shard of a layout for `pools` ranks
    got = run_ragged(held, cfg, cfg.num_kv_heads, pools=pools)
    c = compare(got, want, TPGroup.single(), cfg)
    assert max(c["layers"], c["hidden"], c["logits"], c["kv"]) <= TOL, c
