"""What one device, group or link does below the serving loop: kernels, steps, switches, KV transfer.

* :mod:`bench.device.kernels` — every Triton kernel checked against its torch reference on the GPU, then timed;
* :mod:`bench.device.e2e` — the model runner on one GPU: ceilings, load, role switch, decode and prefill steps;
* :mod:`bench.device.cpu_attention` — the CPU attention path against the torch reference;
* :mod:`bench.device.sampler` — sampler step time on the CPU, greedy against sampled configurations;
* :mod:`bench.device.tp_switch` — decode step time at TP degree 1 and 2, and a group's switch pause.
* :mod:`bench.device.transfer` — KV between two processes, NIXL against TCP: MB/s and the loop's busy share.

``kernels`` and ``e2e`` are what ``scripts/gpu_check`` runs. Only ``cpu_attention``'s serving part imports
:mod:`bench.load` (a node to replay against).
"""
