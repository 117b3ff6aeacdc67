"""What a benchmark run sends and how it is measured, shared by the live tools and the simulator.

* :mod:`bench.traffic.traces` — readers of the shared Azure and Mooncake traces, a seeded Poisson generator;
* :mod:`bench.traffic.workload` — the request list of one run (arrivals, prompt and output lengths), deterministic;
* :mod:`bench.traffic.metrics` — TTFT, TPOT, ITL, throughput, SLO attainment and goodput of a request log.

The bottom layer of ``bench``: it imports nothing else of ``bench``.
"""
