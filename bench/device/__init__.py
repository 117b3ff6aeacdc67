"""What one device (or one tensor-parallel group) does, below the serving loop: kernels, steps, switches.

* :mod:`bench.device.kernels` — every Triton kernel checked against its torch reference on the GPU, then timed;
* :mod:`bench.device.e2e` — the model runner on one GPU: ceilings, load, role switch, decode and prefill steps;
* :mod:`bench.device.cpu_attention` — the CPU attention path against the torch reference;
* :mod:`bench.device.sampler` — sampler step time on the CPU, greedy against sampled configurations;
* :mod:`bench.device.tp_switch` — decode step time at TP degree 1 and 2, and a group's switch pause.

``kernels`` and ``e2e`` are what ``scripts/gpu_check`` runs. Only ``cpu_attention``'s serving part imports
:mod:`bench.load` (a node to replay against).
"""
