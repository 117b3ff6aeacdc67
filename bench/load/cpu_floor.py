"""A CPU runner's decode step against the machine's floors: weight bandwidth and matmul roofline.

    python -m bench.load.cpu_floor [--config bench/configs/llama-85m] [--dtype float32] [--batches 1,16,64]
        [--context 72] [--rounds 3] [--steps 8] [--threads 1] [--baseline DIR --baseline-threads 1]
        [--set KEY=VALUE ...] [--json OUT]

Each checkout (this one, and ``--baseline DIR``, another commit's checkout, e.g. ``git worktree add
/tmp/base main``) runs in its own worker process (cwd and ``PYTHONPATH`` the checkout), which builds a
:class:`~node.worker.runner.ModelRunner` with that checkout's loader (``--load-format dummy``: seeded
random weights of the config's geometry; ``--set`` passes further ``NodeConfig`` fields to this
checkout's worker, e.g. ``--set cpu_weight_packing=False``) and times ``ModelRunner.execute`` of a
pure greedy decode step (every sequence one new token at ``--context``: packing, forward, logits,
sampler, as a served step). Rounds alternate: the floors, then each worker at each batch size, so
every figure sees the same phases of a shared machine; a figure is the median of its round medians.

Floors, measured in the same rounds with the same thread count (``--threads``):

* **bandwidth floor**: a decode step reads every projection and LM-head weight once (the embedding
  only its rows): ``t_bw = weight bytes read per step / copy bandwidth``, the copy bandwidth being a
  256 MiB ``Tensor.copy_`` counted as read plus write bytes (STREAM's copy convention); the floor's
  rate at batch ``B`` is ``B / t_bw`` tokens/s.
* **matmul roofline**: the peak GFLOP/s of a 2048x2048x2048 matmul in the model's dtype; a step's
  matmul work is ``2 * B * weight elements read`` (attention's is left out: at a 72-token context it
  is under 1 % of it).

Reported per batch: tokens/s, the step's GFLOP/s, the fraction of the bandwidth floor's rate and of
the roofline, and new/old.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BLOCK = 16

# Run in each checkout's own interpreter (cwd = the checkout): only loader APIs both commits have.
WORKER = r'''
import json, sys, time, statistics
import torch
args = json.loads(sys.argv[1])
torch.set_num_threads(args["threads"])
from node.config import NodeConfig
from node.core.sequence import SamplingParams
from node.worker.loader import LoadedModel, build_runner, select_ops
from node.worker.model_config import ModelConfig
from node.worker.runner import SeqInput, StepInput
from node.worker.sampler import SampleRequest
from node.worker.tokenizer import TextTokenizer
from node.worker.weights import dtype_from_name
cfg = ModelConfig.from_folder(args["config"])
dtype = dtype_from_name(args["dtype"], cfg)
blocks = max(args["batches"]) * -(-args["context"] // 16) + 2
node = NodeConfig(model=args["config"], load_format="dummy", dtype=args["dtype"], max_model_len=args["context"],
                  kv_cache_memory_bytes=blocks * 16 * cfg.kv_bytes_per_token(dtype), **args["set"])
t0 = time.perf_counter()
runner = build_runner(node, LoadedModel(cfg, TextTokenizer.byte_level(), args["context"], dtype), "cpu:0",
                      select_ops("auto", "cpu"))
greedy = SampleRequest(SamplingParams(max_tokens=16, temperature=0.0), [], 0, 0)
n = -(-args["context"] // 16)
def step(b):
    return StepInput([SeqInput(f"s{i}", [3 + i], args["context"] - 1, list(range(1 + i * n, 1 + (i + 1) * n)), greedy)
                      for i in range(b)])
steps = {b: step(b) for b in args["batches"]}
for b in args["batches"]:
    runner.execute(steps[b])
print("@@" + json.dumps({"ready": time.perf_counter() - t0, "threads": torch.get_num_threads()}), flush=True)
for line in sys.stdin:
    b, k = map(int, line.split())
    runner.execute(steps[b])
    times = []
    for _ in range(k):
        t = time.perf_counter(); runner.execute(steps[b]); times.append(time.perf_counter() - t)
    print("@@" + json.dumps(statistics.median(times)), flush=True)
'''


class Worker:
    """One checkout's runner in its own process; :meth:`time` asks it for a median decode step (s)."""

    def __init__(self, checkout: Path, args: dict):
        env = dict(os.environ, PYTHONPATH=f"{checkout}:{checkout / 'kernels'}")
        self.stderr = tempfile.TemporaryFile("w+")  # read back when the worker dies
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER, json.dumps(args)], cwd=checkout, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True)
        self.checkout = checkout
        self.ready = self._reply()

    def _reply(self):
        """The worker's next ``@@``-marked JSON line (its log lines go to stdout too)."""
        while True:
            line = self.proc.stdout.readline()
            if not line:
                code = self.proc.wait()
                self.stderr.seek(0)
                raise RuntimeError(f"worker for {self.checkout} exited with {code}:\n{self.stderr.read()[-3000:]}")
            if line.startswith("@@"):
                return json.loads(line[2:])

    def time(self, batch: int, steps: int) -> float:
        self.proc.stdin.write(f"{batch} {steps}\n")
        self.proc.stdin.flush()
        return self._reply()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


def copy_gbps(threads: int, mib: int = 256, runs: int = 5) -> float:
    """Median GB/s (read + write bytes) of a ``mib`` MiB float32 ``copy_`` at ``threads`` threads."""
    import torch

    torch.set_num_threads(threads)
    src = torch.ones(mib << 18)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 2 * src.numel() * 4 / statistics.median(times) / 1e9


def matmul_gflops(threads: int, dtype_name: str, n: int = 2048, runs: int = 4) -> float:
    """Median GFLOP/s of an ``n x n x n`` matmul in ``dtype_name`` at ``threads`` threads."""
    import torch

    torch.set_num_threads(threads)
    dtype = getattr(torch, dtype_name)
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    a @ b
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times) / 1e9


def weights_read_per_step(config: Path) -> int:
    """Weight elements a decode step reads: every layer's projections and the LM head (tied or not)."""
    c = json.loads((config / "config.json").read_text())
    h, i, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    d = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    return layers * (h * (q + 2 * kv) + q * h + 3 * h * i) + c["vocab_size"] * h


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.load.cpu_floor", description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(REPO / "bench/configs/llama-85m"), help="a folder with a Llama config.json")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--context", type=int, default=72, help="tokens per sequence, the new one included")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=8, help="timed steps per worker, batch and round")
    p.add_argument("--threads", type=int, default=1, help="torch threads of this checkout's worker and the floors")
    p.add_argument("--baseline", default=None, help="another checkout, timed in the same rounds")
    p.add_argument("--baseline-threads", type=int, default=None, help="its torch threads (default: --threads)")
    p.add_argument("--baseline-dtype", default=None, help="its --dtype (default: --dtype)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a NodeConfig field for this checkout's worker (Python literal value)")
    p.add_argument("--json", default=None, help="write the results here")
    a = p.parse_args(argv)
    import ast

    config = Path(a.config).resolve()
    batches = [int(x) for x in a.batches.split(",")]
    extra = {k: ast.literal_eval(v) for k, v in (s.split("=", 1) for s in a.set)}
    base = dict(config=str(config), dtype=a.dtype, batches=batches, context=a.context, threads=a.threads, set=extra)
    workers = {"new": Worker(REPO, base)}
    if a.baseline:
        workers["old"] = Worker(Path(a.baseline).resolve(), base | dict(threads=a.baseline_threads or a.threads,
                                                                          dtype=a.baseline_dtype or a.dtype, set={}))
    elems = weights_read_per_step(config)
    elem_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}
    per: dict[str, list[float]] = {}
    try:
        for _ in range(a.rounds):
            per.setdefault("copy_gbps", []).append(copy_gbps(a.threads))
            per.setdefault("matmul_gflops", []).append(matmul_gflops(a.threads, a.dtype))
            for b in batches:
                for name, w in workers.items():
                    per.setdefault(f"{name}:{b}", []).append(w.time(b, max(2, a.steps if b < 64 else a.steps // 2)))
    finally:
        for w in workers.values():
            w.close()
    med = {k: statistics.median(v) for k, v in per.items()}
    bw, peak = med["copy_gbps"], med["matmul_gflops"]
    load = os.getloadavg()
    rows = []
    for b in batches:
        for name in workers:
            dt = a.dtype if name == "new" else (a.baseline_dtype or a.dtype)
            step = med[f"{name}:{b}"]
            t_bw = elems * elem_bytes[dt] / (bw * 1e9)
            gflops = 2 * elems * b / step / 1e9
            rows.append(dict(worker=name, batch=b, dtype=dt, threads=workers[name].ready["threads"], step_ms=step * 1e3,
                             tokens_s=b / step, floor_tokens_s=b / t_bw, of_bandwidth_floor=t_bw / step,
                             gflops=gflops, of_roofline=gflops / peak))
    print(f"{config.name} ({elems / 1e6:.1f}M weights read per step), context {a.context}, {os.cpu_count()} CPUs, "
          f"load {load[0]:.1f}, {a.rounds} rounds; copy {bw:.1f} GB/s, {a.dtype} matmul peak {peak:.1f} GFLOP/s "
          f"at {a.threads} threads")
    print(f"{'worker':6} {'B':>3} {'dtype':>8} {'thr':>3} {'step ms':>9} {'tok/s':>8} {'floor tok/s':>11} "
          f"{'of bw':>6} {'GFLOP/s':>8} {'of peak':>7}")
    for r in rows:
        print(f"{r['worker']:6} {r['batch']:3} {r['dtype']:>8} {r['threads']:3} {r['step_ms']:9.2f} {r['tokens_s']:8.1f} "
              f"{r['floor_tokens_s']:11.1f} {r['of_bandwidth_floor']:6.2f} {r['gflops']:8.1f} {r['of_roofline']:7.2f}")
    if "old" in workers:
        print("new/old tokens/s: " + ", ".join(f"B={b} {med[f'old:{b}'] / med[f'new:{b}']:.2f}x" for b in batches))
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "copy_gbps": bw, "matmul_gflops": peak, "load": load,
                                            "rounds": per, "command": " ".join(sys.argv)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
