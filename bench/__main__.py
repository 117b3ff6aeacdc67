"""``python -m bench``: the index of the benchmark tools, grouped by concern, with the question each answers.

    python -m bench                      # the index
    python -m bench TOOL [ARGS...]       # run a tool: the same as python -m bench.GROUP.TOOL ARGS...

``TOOL`` is a tool's short name (``crossover``) or its dotted path below ``bench`` (``studies.crossover``).
Every module of ``bench`` is in :data:`GROUPS`, as a tool (it has a command line) or as a helper the tools
share; ``tests/test_bench_index.py`` fails when a module is missing here, a listed one does not import,
or a group imports a group it should not (:attr:`Group.imports`: the layers, lowest first, are traffic,
load, cost, sim and studies; device sits beside cost).
"""

from __future__ import annotations

import runpy
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Tool:
    """A runnable module: ``module`` is its dotted path below ``bench``; ``question`` what it answers."""

    module: str
    question: str

    @property
    def name(self) -> str:
        """The short name ``python -m bench NAME`` takes: the module's last part (``sim`` for the simulator)."""
        return self.module.rsplit(".", 1)[-1]

    @property
    def command(self) -> str:
        return f"python -m bench.{self.module}"


@dataclass(frozen=True)
class Group:
    """A sub-package of ``bench``: its tools, its helper modules (no command line) and the sub-packages its
    modules may import (the direction of imports; a group may always import itself)."""

    package: str
    concern: str
    tools: tuple[Tool, ...]
    helpers: tuple[str, ...]
    imports: frozenset[str]


GROUPS: tuple[Group, ...] = (
    Group("studies", "questions answered by many runs, simulated or live, and their figures", (
        Tool("studies.crossover", "Where does pooled (disaggregated) serving beat time-shared: model size x "
                                  "prompt-length spread x link speed? (simulated)"),
        Tool("studies.tp_study", "What capacity does each mode reach with tensor-parallel degrees as tuned "
                                 "knobs, on an H200 preset? (simulated)"),
        Tool("studies.compare", "How do the modes compare on one workload over a sweep of rates: goodput, "
                                "TTFT/TPOT, role timeline? (live nodes)"),
        Tool("studies.validate_sim", "Does the simulator predict the live node: TTFT/TPOT of the same "
                                     "workload, live and simulated, side by side?"),
        Tool("studies.adaptive_cells", "Where does untuned adaptive stand against the best tuned baseline, cell by "
                                       "cell (probes, and the heat map redrawn from them)?"),
        Tool("studies.attainment", "Does one crossover cell meet its SLOs at given rates (a capacity search's "
                                   "single probes: is a mode within 0.95x of a baseline's capacity)?"),
        Tool("studies.oracles", "What was each oracle of the simulator worth (clients' max_tokens, the planning "
                                "model, free decisions, group decode graphs, copies) on one cell, adaptive and colocated?"),
        Tool("studies.heldout", "Held-out cells (Mooncake traces, gamma bursts): adaptive's goodput over every tuned "
                                "baseline at fixed rates, with a 95 % interval over seeds? (simulated)"),
        Tool("studies.shifting", "On traffic whose mix shifts over a day, does untuned adaptive beat each baseline's "
                                 "best static setting and reach a per-segment oracle? (simulated)"),
    ), ("studies.plots", "studies.timeline", "studies.paired", "studies.seed_stats"), frozenset({"traffic", "load", "cost", "sim"})),
    Group("sim", "the discrete-event simulator, driving the node's own pure policies on a virtual clock", (
        Tool("sim", "How would a deployment (mode, devices, link, cost model) serve a workload? Simulated "
                    "TTFT/TPOT/goodput per mode; --tune gives each mode its best knobs first"),
        Tool("sim.control_cost", "How much CPU does a role policy's decision round cost, per round and per resident "
                                 "sequence (the simulator's default control cost)?"),
    ), ("sim.config", "sim.run", "sim.timeshared", "sim.batched", "sim.pooled", "sim.parallel", "sim.stepcost",
        "sim.trace", "sim.tuning", "sim.planning"), frozenset({"traffic", "cost"})),
    Group("load", "live load against real `shiftnode serve` processes", (
        Tool("load.replay", "What TTFT, TPOT, ITL and goodput does a running node give a trace at a rate?"),
        Tool("load.cpu_floor", "How close does the CPU decode step come to its bandwidth floor and matmul roofline, "
                               "at batch 1, 16 and 64, against a baseline checkout?"),
        Tool("load.host_overhead", "How much host (CPU) time does the node spend per decode step under "
                                   "streaming load, and is it better than a baseline checkout?"),
        Tool("load.runner_step", "How long is the runner's decode step at batch 1 and 64, eager against "
                                 "--compile inductor, and how long does the compilation take?"),
        Tool("load.compile_start", "How soon does a node answer while its steps compile in the background, how much "
                                   "does the compile slow serving, and how long do a cold and a warm start take?"),
        Tool("load.soak", "Does a long mixed run with client aborts, a killed engine and a restarted peer leak "
                          "KV blocks, hang requests, grow memory or answer 5xx?"),
        Tool("load.fuzz", "Does any generated API request get a 5xx or hang? (the long run of the API fuzzer)"),
        Tool("load.restart", "When an engine is killed under greedy streams, how long do they pause, do they "
                             "end exactly, and how soon does the device serve again?"),
        Tool("load.structured", "What does structured output cost: tokens/s and ITL with a JSON schema against none, "
             "the mask per token, a 50-field schema's compile, the grammar cache's bound?"),
        Tool("load.spec_decode", "Does n-gram speculative decoding pay: ITL, TPOT and tokens/s at 1 and 64 streams "
             "on outputs that repeat their prompts, with and without --speculative-config?"),
        Tool("load.spec_step", "What does a speculative verify step of 1 + k tokens cost the engine against a "
                               "decode step, and one layer's attention by path?"),
        Tool("load.membership", "How fast do peer sets follow a join, a kill -9 and a clean stop through etcd?"),
        Tool("load.chaos", "With engines killed at random while KV is in flight (moves, hand-offs to a peer), "
                           "does every request end, greedy-exact or with a clear error, with no KV block leaked or "
                           "owned twice, and do both nodes come back healthy?"),
    ), ("load.node_process", "load.etcd_server", "load.host_compare", "load.host_cells", "load.stream_client",
        "load.stream_cells", "load.chaos_report", "load.chaos_client", "load.chaos_nodes"),
        frozenset({"traffic"})),
    Group("device", "one device, group or link below the serving loop: kernels, steps, switches, KV transfer", (
        Tool("device.kernels", "Is every Triton kernel right on this GPU, and how close to the copy and "
                               "matmul ceilings does it run?"),
        Tool("device.e2e", "How fast is the model runner on one GPU: load, role switch, decode and prefill "
                           "steps against their floors, eager and compiled (--compile inductor)?"),
        Tool("device.cpu_attention", "How does the CPU attention path compare with the torch reference, "
                                     "alone and in a serving node?"),
        Tool("device.sampler", "What does a sampler step cost on the CPU, greedy against sampled settings?"),
        Tool("device.tp_switch", "What does a group's role switch cost against a decode step at tensor-parallel "
                                 "degree 1 and 2?"),
        Tool("device.transfer", "How fast does KV move between two processes, NIXL against TCP, and how busy "
                                "does it keep the event loop?"),
    ), ("device.e2e_compiled",), frozenset({"traffic", "load"})),
    Group("cost", "where the step cost models of bench/cost_models/ come from", (
        Tool("cost.calibrate", "What are a model's step times on this machine, fitted as a cost model?"),
        Tool("cost.calibrate_node", "What step costs does a client see through a running node's API, fitted "
                                    "as a cost model?"),
        Tool("cost.derive_cost", "What roofline cost model does a Llama-family geometry get at a TP degree on "
                                 "the H200 preset?"),
    ), (), frozenset({"traffic", "load"})),
    Group("traffic", "what a run sends and how it is measured, shared by the live tools and the simulator",
          (), ("traffic.traces", "traffic.workload", "traffic.metrics", "traffic.clients", "traffic.arrivals",
           "traffic.shifting"), frozenset()),
)


def tools() -> dict[str, Tool]:
    """Every tool by its short name and by its dotted path below ``bench``."""
    found = {}
    for group in GROUPS:
        for tool in group.tools:
            found[tool.name] = found[tool.module] = tool
    return found


def index() -> str:
    """The listing ``python -m bench`` prints."""
    lines = ["shiftnode benchmark tools, by concern. `python -m bench TOOL [ARGS]` runs one (the same as its",
             "command below); each has --help; docs/benchmarks.md says how every standing result was made.", ""]
    for group in GROUPS:
        lines.append(f"{group.package}/ — {group.concern}")
        for tool in group.tools:
            lines.append(f"  {tool.name:<15} {tool.command}")
            lines.append(f"  {'':<15} {tool.question}")
        if group.helpers:
            lines.append(f"  {'(shared)':<15} " + ", ".join(h.rsplit(".", 1)[-1] for h in group.helpers))
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print the index, or run ``argv[0]`` as the tool's ``__main__`` with the rest as its arguments."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "list"):
        print(index())
        return 0
    tool = tools().get(argv[0])
    if tool is None:
        print(f"python -m bench: no tool {argv[0]!r}\n\n{index()}", file=sys.stderr)
        return 2
    sys.argv = [sys.argv[0], *argv[1:]]  # run_module puts the tool's own path first
    runpy.run_module(f"bench.{tool.module}", run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
