"""bench.load.host_overhead's measured cells and their table: one :class:`Cell` per load point (what the
clients counted, each device's steps, the node's CPU time by role), its figures per token and per step,
one row per cell with the target it is checked against (the columns are described in
:mod:`bench.load.host_overhead`; the summary lines that pair cells are :mod:`bench.load.host_compare`'s)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

SLEEP_MS = 5.0
"""``sleep:5``: each step of the benchmark model sleeps this long (ms)."""


@dataclass
class Cell:
    """One measured load point. Times in seconds unless the name says ms."""

    layout: str
    model: str
    setup: str
    concurrency: int
    sampling: str
    wall_s: float = 0.0
    steps_wall_s: float = 0.0  # between the two /v1/node reads (their midpoints); 0: wall_s
    node_read_s: float = 0.0  # the slower of the two /v1/node reads
    tokens: int = 0
    steps: list[int] = field(default_factory=list)  # per device, in the interval
    gap_s: float = 0.0  # sum of in-request chunk gaps in the interval
    gap_tokens: int = 0  # tokens of the chunks those gaps end at
    gaps: list[float] = field(default_factory=list, repr=False)  # each in-request gap / its chunk's tokens (s)
    startup_s: float | None = None  # the node's start-up (launch to healthy), compilation included
    requests: int = 0
    client_cpu_s: float = 0.0  # the client processes' CPU time in the interval, summed
    client_cpu_max_s: float = 0.0  # the busiest client process's
    client_processes: int = 1  # --client-processes: the streams split over this many processes
    node_cpu_s: float = 0.0  # the node (control) process's CPU time (user + system, all threads) in the interval
    engine_cpu_s: float = 0.0  # its engine processes' CPU time in the interval
    api_cpu_s: float = 0.0  # its API front-end processes' CPU time (--api-processes > 1) in the interval
    api_processes: int = 1  # the node's --api-processes
    tree: str = "this"  # which checkout ran the node: "this" or "baseline" (--baseline)
    pair: int = 0  # with --baseline: which of the --pairs rounds
    errors: int = 0
    error: str | None = None  # the node did not start (or the cell failed), why

    @property
    def devices(self) -> int:
        return int(self.setup.split()[0])

    def steps_wall(self) -> float:
        """Seconds the device steps were counted over (the ``/v1/node`` reads' interval, else ``wall_s``)."""
        return self.steps_wall_s or self.wall_s

    def tok_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0

    def ms_per_step(self) -> float | None:
        per = [self.steps_wall() * 1e3 / s for s in self.steps if s]
        return statistics.mean(per) if per else None

    def itl_ms(self) -> float | None:
        return self.gap_s * 1e3 / self.gap_tokens if self.gap_tokens else None

    def itl_p50_ms(self) -> float | None:
        return statistics.median(self.gaps) * 1e3 if self.gaps else None

    def node_us_per_token(self) -> float | None:
        return self.node_cpu_s * 1e6 / self.tokens if self.tokens else None

    def engine_us_per_token(self) -> float | None:
        return self.engine_cpu_s * 1e6 / self.tokens if self.tokens else None

    def api_us_per_token(self) -> float | None:
        return self.api_cpu_s * 1e6 / self.tokens if self.tokens else None

    def total_us_per_token(self) -> float | None:
        """The whole node's CPU per streamed token: control process, front ends and engines."""
        return (self.node_cpu_s + self.api_cpu_s + self.engine_cpu_s) * 1e6 / self.tokens if self.tokens else None


HEAD = (f"{'tree':8} {'layout':8} {'api':>3} {'model':8} {'devs':6} {'c':>4} {'sampling':8} {'tok/s':>8} {'steps/s':>8} "
        f"{'ms/step':>8} {'host ms':>8} {'wait':>6} {'ITL ms':>7} {'p50':>6} {'node us/tok':>11} {'api us/tok':>10} "
        f"{'eng us/tok':>10} {'all us/tok':>10} {'cli%':>5} {'K':>2} {'start s':>7} {'err':>4}  target")


def row(x: Cell, runner_ms: dict | None) -> str:
    """One cell's line of :func:`table` (an error row where it measured nothing)."""
    if x.wall_s == 0:
        return (f"{x.tree:8} {x.layout:8} {x.api_processes:>3} {x.model:8} {x.setup:6} {x.concurrency:>4} "
                f"{x.sampling:8} ERROR: {x.error}")
    ms = x.ms_per_step()
    runner = {"zero": 0.0, "sleep:5": SLEEP_MS}.get(x.model, _runner_ms(runner_ms, x))
    host = ms - runner if ms is not None and runner is not None else None
    wait = statistics.mean(1 - s * SLEEP_MS / 1e3 / x.steps_wall() for s in x.steps) if x.model == "sleep:5" and x.steps else None
    return (f"{x.tree:8} {x.layout:8} {x.api_processes:>3} {x.model:8} {x.setup:6} {x.concurrency:>4} {x.sampling:8} "
            f"{x.tok_s():8.0f} {sum(x.steps) / x.steps_wall():8.1f} {_f(ms, 8, 2)} {_f(host, 8, 2)} {_f(wait, 6, 3)} "
            f"{_f(x.itl_ms(), 7, 2)} {_f(x.itl_p50_ms(), 6, 2)} {_f(x.node_us_per_token(), 11, 1)} "
            f"{_f(x.api_us_per_token(), 10, 1)} {_f(x.engine_us_per_token(), 10, 1)} "
            f"{_f(x.total_us_per_token(), 10, 1)} {100 * x.client_cpu_s / x.wall_s:5.0f} {x.client_processes:>2} "
            f"{_f(x.startup_s, 7, 1)} {x.errors:>4}  {target(x, runner_ms)}" + (f"  [{x.error[:80]}]" if x.error else "")
            + (f"  [GET /v1/node took {x.node_read_s:.2f} s: steps over {x.steps_wall():.2f} s]"
               if x.node_read_s > 0.05 * x.wall_s else ""))


def _runner_ms(runner_ms: dict | None, x: Cell) -> float | None:
    """The in-process runner step of a stories cell's mode and batch (c = batch on one device), if measured."""
    mode = "inductor" if x.model == "stories-c" else "none"
    return (runner_ms or {}).get((mode, x.concurrency)) if x.devices == 1 else None


def target(x: Cell, runner_ms: dict | None) -> str:
    per_dev = x.concurrency // x.devices
    if x.model == "zero" and x.devices == 1 and x.concurrency == 256:
        return f">=30000 tok/s: {_ok(x.tok_s() >= 30000)}"
    if x.model == "sleep:5" and per_dev == 256:
        rate = min(x.steps) / x.steps_wall()
        return f">=190 steps/s/dev: {_ok(rate >= 190)} ({rate:.0f})"
    if x.model == "stories-c" and x.concurrency == 1 and x.itl_p50_ms() is not None:
        return f"ITL p50 <=0.8 ms: {_ok(x.itl_p50_ms() <= 0.8)}"
    step = _runner_ms(runner_ms, x)
    if x.model == "stories" and x.concurrency == 1 and step is not None and x.itl_ms() is not None:
        extra = x.itl_ms() - step
        return f"ITL-runner <=1 ms: {_ok(extra <= 1.0)} ({extra:.2f})"
    return ""


def _f(v: float | None, width: int, digits: int) -> str:
    return f"{v:{width}.{digits}f}" if v is not None else f"{'-':>{width}}"


def _ok(b: bool) -> str:
    return "ok" if b else "MISS"
