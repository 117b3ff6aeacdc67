"""Benchmarks, by concern: ``python -m bench`` lists every tool with the question it answers.

* :mod:`bench.traffic` — what a run sends and how it is measured (traces, workloads, metrics);
* :mod:`bench.load` — live load against ``shiftnode serve`` processes (replay, overhead, soak, fuzz, membership);
* :mod:`bench.cost` — where the step cost models come from (calibration, roofline derivation);
* :mod:`bench.device` — one device or link below the serving loop (kernels, steps, sampler, TP switch,
  KV transfer);
* :mod:`bench.sim` — the discrete-event simulator and the tuning protocol;
* :mod:`bench.studies` — comparisons of the modes, simulated or live, and their figures.

Imports go one way: traffic ← load ← cost ← sim ← studies, device beside cost (``tests/test_bench_index.py``).
Data stays here: ``configs/``, ``cost_models/``, ``figures/``, ``results/`` and ``RESULTS.md``.
"""
