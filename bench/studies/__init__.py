"""Studies that answer a question by many runs: mode comparisons, crossover, tensor parallelism, simulator checks.

* :mod:`bench.studies.compare` — the modes on one workload over a sweep of rates, live;
* :mod:`bench.studies.crossover` — where pooled beats time-shared (model x prompt lengths x link), simulated;
* :mod:`bench.studies.tp_study` — each mode's capacity with TP degrees as tuned knobs, simulated;
* :mod:`bench.studies.validate_sim` — the simulator against the live node on the same workload;
* :mod:`bench.studies.plots` and :mod:`bench.studies.timeline` — their figures and role timelines.

The top layer: imports :mod:`bench.sim`, :mod:`bench.cost`, :mod:`bench.load` and :mod:`bench.traffic`;
nothing imports it.
"""
