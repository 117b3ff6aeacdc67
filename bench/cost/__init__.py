"""Where the step cost models of ``bench/cost_models/`` come from.

* :mod:`bench.cost.calibrate` — time ``ModelRunner.execute`` on this machine and fit a linear cost model;
* :mod:`bench.cost.calibrate_node` — the same fit from step costs seen through a running node's API;
* :mod:`bench.cost.derive_cost` — a roofline cost model for any Llama-family geometry, hardware terms
  fitted to the H200 measurements.

Imports :mod:`bench.traffic` and, for the live probe only, :mod:`bench.load.replay`.
"""
