"""Sampler step time on the CPU: greedy vs non-greedy configurations, batched vs the old per-row loop.

Usage: ``python -m bench.device.sampler [--vocab 128256] [--batches 1,64,256] [--reps 5] [--threads N]``

Logits are ``[B, V]`` float32, ``N(0, sigma²)`` per token: ``sigma = 4`` ("peaked": at T = 0.8 the
entropy is ≈3.3 nats and the 0.95 nucleus ≈260 tokens, roughly an LM's typical next-token
distribution) and ``sigma = 2`` ("flat": entropy ≈8.5 nats, nucleus ≈25k tokens, the worst case
for the candidate-set top-p). Penalty rows carry a 1024-token history (512 prompt + 512 output).

Prints ms per step (median of ``reps`` after one warm-up) and the ratio to greedy at the same batch:
sampler only, and per node step, i.e. with a dummy LM-head matmul ``[B, 2048] x [2048, V]`` (the
cost every step pays anyway) added to both sides. Each configuration runs twice, side by side: with
the compiled CPU kernel for rows without top-k (:mod:`shiftnode_kernels.cpu_sampling_numba`, the default) and
on the torch path (``node.worker.sampler.CPU_SAMPLER = "torch"``, as without Numba). The old per-row
loop (``_old_sample`` below, the implementation before both, abridged) runs at batch 64 for contrast.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from node.core.sequence import SamplingParams
from node.worker import sampler as sampler_module
from node.worker.sampler import SampleRequest, sample

HIDDEN = 2048


def _old_sample(logits: torch.Tensor, params: list[SamplingParams], generator: torch.Generator) -> list[int]:
    """The former per-row loop: double-precision row, full sort for top-p, one multinomial per row."""
    out = logits.argmax(dim=-1).tolist()
    for row, p in enumerate(params):
        if p.greedy:
            continue
        x = logits[row].double() / p.temperature
        if 0 < p.top_k < x.shape[-1]:
            x = x.masked_fill(x < torch.topk(x, p.top_k).values[-1], float("-inf"))
        if p.top_p < 1.0:
            sx, order = torch.sort(x, descending=True)
            probs = torch.softmax(sx, dim=-1)
            sx = sx.masked_fill((torch.cumsum(probs, dim=-1) - probs) >= p.top_p, float("-inf"))
            x = torch.empty_like(x).scatter_(0, order, sx)
        out[row] = int(torch.multinomial(torch.softmax(x, dim=-1), 1, generator=generator)[0])
    return out


def _time(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    v = args.vocab
    gen = torch.Generator().manual_seed(0)
    hist = torch.randint(0, v, (1024,), generator=gen).tolist()
    configs = {
        "greedy": dict(temperature=0.0),
        "T0.8 top-p0.95": dict(temperature=0.8, top_p=0.95),
        "T0.8 top-p0.95 top-k50": dict(temperature=0.8, top_p=0.95, top_k=50),
        "T0.8 top-p0.95 rep1.1": dict(temperature=0.8, top_p=0.95, repetition_penalty=1.1),
        "T1.0 (no filter)": dict(temperature=1.0),
        "T0.8 min-p0.05": dict(temperature=0.8, min_p=0.05),
        "T0.8 top-p0.95 seeded": dict(temperature=0.8, top_p=0.95, seed=1),
    }
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, V={v}, float32, CPU; "
          f"median of {args.reps} (ms/step)")
    print(f"{'batch':>5} {'logits':>6} {'config':<26} {'path':>8} {'sampler ms':>10} {'x greedy':>8} "
          f"{'+lmhead ms':>10} {'x greedy':>8}")
    for b in [int(x) for x in args.batches.split(",")]:
        h = torch.randn(b, HIDDEN, generator=gen)
        w = torch.randn(HIDDEN, v, generator=gen) / HIDDEN**0.5
        mm = _time(lambda: h @ w, max(2, args.reps // 2))
        for sigma, label in [(4.0, "peaked"), (2.0, "flat")]:
            base = torch.randn(b, v, generator=gen) * sigma
            greedy_ms = None
            for name, kw in configs.items():
                if label == "flat" and name not in ("greedy", "T0.8 top-p0.95", "T0.8 top-p0.95 top-k50"):
                    continue
                p = SamplingParams(max_tokens=1, **kw)
                reqs = [SampleRequest(p, hist, 512, 512) for _ in range(b)]
                buf = torch.empty_like(base)

                def step():
                    buf.copy_(base)  # sample() may modify penalised rows in place
                    sample(buf, reqs, gen)

                for path in ("compiled", "torch") if name != "greedy" else ("-",):
                    sampler_module.CPU_SAMPLER = "torch" if path == "torch" else "auto"
                    ms = _time(step, args.reps) - _time(lambda: buf.copy_(base), args.reps)
                    greedy_ms = ms if greedy_ms is None else greedy_ms
                    print(f"{b:>5} {label:>6} {name:<26} {path:>8} {ms:>10.2f} {ms / greedy_ms:>8.2f} "
                          f"{mm + ms:>10.1f} {(mm + ms) / (mm + greedy_ms):>8.3f}", flush=True)
                sampler_module.CPU_SAMPLER = "auto"
            if b == 64:
                p = SamplingParams(max_tokens=1, temperature=0.8, top_p=0.95)
                ms = _time(lambda: _old_sample(base, [p] * b, gen), max(1, args.reps // 2))
                print(f"{b:>5} {label:>6} {'OLD per-row T0.8 top-p0.95':<26} {'old':>8} {ms:>10.2f} "
                      f"{ms / greedy_ms:>8.2f} {mm + ms:>10.1f} {(mm + ms) / (mm + greedy_ms):>8.3f}")
        print(f"{b:>5} {'':>6} {'(LM head matmul alone)':<26} {mm:>10.1f}")


if __name__ == "__main__":
    main()
