"""How many intra-op threads a CPU engine runs its steps with: decided from a measurement of its own steps.

An engine process shares the machine's cores with the node's control loop (scheduling, post-processing,
the streams). Two candidate settings (:func:`thread_candidates`):

* ``reserved``: the cores less one for the loop (and one per API front end), shared by the devices
  (:func:`~node.worker.engine_process.engine_threads`). Steps and the loop's work overlap, each on its
  own cores, so a step period is ``max(step(reserved), loop)``.
* ``all``: every core the engine may use. The loop's work then takes a core from the step's threads
  while it runs (OpenMP's threads wait for the slowest at each barrier), so a step period is about
  ``step(all) + loop``.

:func:`choose_threads` picks ``all`` only where that period is clearly shorter and the step costs at
least four loops' work: where the step's compute outweighs the loop's per-step cost. On a model whose step costs less than the loop's work (stories260k:
a ~0.3 ms step against ~1 ms of loop work per step at one stream, bench/RESULTS.md 2026-12-03) the
reserved core wins; on an 85M Llama (a 30-40 ms step, nearly halved by a second thread) all cores win.
The engine measures both settings at start-up (:func:`probe_decode_seconds`, a batch-1 decode step of
the loaded model), so the choice also sees a machine whose cores are busy with other work, where a
second OpenMP thread that has to wait for a busy core makes every step slower. ``--cpu-threads N``
skips the probe.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

LOOP_S_PER_STEP = 1.0e-3
"""The control loop's own work per step at one stream (s): the node's ITL at one stream on stories260k
(1.26 ms, issue 46) less its runner step (~0.3 ms), rounded. The loop's cost grows with the batch, but so
does the step's; the batch-1 figure is the case where a reserved core can matter most."""

COMPUTE_BOUND_LOOPS = 4.0
"""All cores are considered only for a step of at least this many loops' work (at the reserved count):
a smaller step leaves the loop a large share of each period, and its probe is a few noisy milliseconds
on a busy machine, where a wrong pick of two threads costs far more than the right one saves."""

MIN_GAIN = 0.10
"""The fraction by which the all-cores period must beat the reserved one: within it the two are a
measurement's noise apart, and the reserved core keeps the loop's latency steady."""


def thread_candidates(cores: int, frontends: int, devices: int, override: int | None, tensor_parallel: bool
                      ) -> tuple[int, int]:
    """``(reserved, all)`` intra-op threads for one CPU engine.

    Args:
        cores: CPUs this process may run on.
        frontends: API front-end processes beside the node (0 when the API runs in the node's process).
        devices: engines sharing the cores.
        override: ``--cpu-threads`` (both candidates are it), or None.
        tensor_parallel: the engine is one rank of a group whose ranks share the cores: no probe (both
            candidates are the reserved count).

    Returns ``reserved = max(1, (cores - 1 - frontends) // devices)`` and
    ``all = max(reserved, (cores - frontends) // devices)``.
    """
    if override is not None:
        return override, override
    devices = max(1, devices)
    reserved = max(1, (cores - 1 - frontends) // devices)
    if tensor_parallel:
        return reserved, reserved
    return reserved, max(reserved, (cores - frontends) // devices)


def choose_threads(step_s: dict[int, float], reserved: int, all_cores: int, loop_s: float = LOOP_S_PER_STEP,
                   min_gain: float = MIN_GAIN, compute_bound_loops: float = COMPUTE_BOUND_LOOPS) -> int:
    """The thread count whose step period is shortest (pure; see the module docstring for the model).

    Args:
        step_s: measured seconds of one step at each thread count (must hold ``reserved`` and, when it
            differs, ``all_cores``).
        reserved, all_cores: the candidates of :func:`thread_candidates`.
        loop_s: the control loop's work per step (s).
        min_gain: ``all_cores`` is chosen only when ``step(all) + loop <= (1 - min_gain) * max(step(reserved), loop)``
        compute_bound_loops: and only when ``step(reserved) >= compute_bound_loops * loop``.

    Raises:
        ValueError: a candidate has no measurement, or a time is not positive.
    """
    if all_cores == reserved:
        return reserved
    for n in (reserved, all_cores):
        if n not in step_s:
            raise ValueError(f"no step time measured at {n} threads (have {sorted(step_s)})")
        if not step_s[n] > 0:
            raise ValueError(f"step time at {n} threads must be positive, got {step_s[n]}")
    if step_s[reserved] < compute_bound_loops * loop_s:
        return reserved
    overlapped = max(step_s[reserved], loop_s)
    shared = step_s[all_cores] + loop_s
    return all_cores if shared <= (1.0 - min_gain) * overlapped else reserved


def probe_decode_seconds(runner: Any, threads: int, budget_s: float = 0.5, max_steps: int = 7) -> float:
    """Median seconds of a batch-1 greedy decode step of ``runner`` (a
    :class:`~node.worker.runner.ModelRunner`) at ``threads`` intra-op threads (left set), over the
    first blocks of its pool at a 32-token context (before serving: the blocks hold nobody's KV). One
    step warms the setting up, then steps run until ``budget_s`` or ``max_steps`` (at least 2)."""
    import torch

    from node.core.sequence import SamplingParams
    from node.worker.runner import SeqInput, StepInput
    from node.worker.sampler import SampleRequest

    torch.set_num_threads(threads)
    bs = runner.block_size
    context = min(32, bs * runner.num_blocks)
    step = StepInput([SeqInput("thread-probe", [1], context - 1, list(range(-(-context // bs))),
                               SampleRequest(SamplingParams(max_tokens=1, temperature=0.0), [], 0, 0))])
    runner.execute(step)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 2 or (len(times) < max_steps and time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        runner.execute(step)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def settle_threads(runner: Any, reserved: int, all_cores: int) -> tuple[int, dict[int, float]]:
    """Probe ``runner`` at both candidates (when they differ), set the chosen count with
    ``torch.set_num_threads`` and return it with the measured step seconds by thread count."""
    import torch

    if reserved == all_cores:
        torch.set_num_threads(reserved)
        return reserved, {}
    measured = {n: probe_decode_seconds(runner, n) for n in (all_cores, reserved)}
    chosen = choose_threads(measured, reserved, all_cores)
    torch.set_num_threads(chosen)
    return chosen, measured
