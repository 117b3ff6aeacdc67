"""bench.load.host_overhead's comparisons and CPU readings: per-process CPU time from ``/proc``, and the
summary lines that pair cells of one run (old against new tree, front ends against one process, tok/s
against ``--api-processes`` as a fraction of linear, two devices against one, sampled against greedy)."""

from __future__ import annotations

import os
import statistics
from typing import TYPE_CHECKING

from bench.load.host_cells import _ok

if TYPE_CHECKING:
    from bench.load.host_cells import Cell


def _tree_cpu_s(pid: int | None) -> tuple[float, float]:
    """CPU seconds (user + system, from ``/proc``) of process ``pid`` and of its children together;
    ``(0, 0)`` without ``pid`` or off Linux. A child that exits in between drops out of the sum."""
    if pid is None or not os.path.isdir("/proc"):
        return 0.0, 0.0
    tick = os.sysconf("SC_CLK_TCK")

    def stat(p: str) -> list[str] | None:
        try:
            with open(f"/proc/{p}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()  # fields from 3 (state) on
        except OSError:
            return None

    own = stat(str(pid))
    kids = 0.0
    for p in os.listdir("/proc"):
        if p.isdigit() and (f := stat(p)) is not None and f[1] == str(pid):
            kids += (int(f[11]) + int(f[12])) / tick
    return ((int(own[11]) + int(own[12])) / tick if own else 0.0), kids


def cpu_by_role(pid: int | None) -> tuple[float, float, float]:
    """CPU seconds of process ``pid`` (the node's control process), of its API front ends (children
    named ``shiftnode-api-N``) and of its other children (the engines); zeros without ``/proc``."""
    if pid is None or not os.path.isdir("/proc"):
        return 0.0, 0.0, 0.0
    tick = os.sysconf("SC_CLK_TCK")
    own = api = engines = 0.0
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/stat") as f:
                comm, _, rest = f.read().partition("(")[2].rpartition(")")
        except OSError:
            continue
        fields = rest.split()  # from field 3 (state) on
        cpu = (int(fields[11]) + int(fields[12])) / tick
        if p == str(pid):
            own = cpu
        elif fields[1] == str(pid):
            if comm.startswith("shiftnode-api"):
                api += cpu
            else:
                engines += cpu
    return own, api, engines


def against_baseline(cells: list[Cell]) -> list[str]:
    """Per grid point run by both checkouts: this tree's node CPU per streamed token and tok/s as ratios
    to the baseline's run of the same round (the two ran one after the other, so they share the
    machine's phase), the median over rounds, each round's in brackets. CPU per token is the steadier
    figure on a shared machine: it does not depend on how much CPU the node was given."""
    out = []
    key = lambda x: (x.layout, x.model, x.setup, x.concurrency, x.sampling, f"api{x.api_processes}")  # noqa: E731
    ok = {(key(x), x.tree, x.pair): x for x in cells if x.wall_s and x.tokens}
    for k in dict.fromkeys(k for k, tree, _ in ok if tree == "baseline"):
        pairs = sorted(i for kk, tree, i in ok if kk == k and tree == "baseline")
        rounds = [(ok[(k, "this", i)], ok[(k, "baseline", i)]) for i in pairs
                  if (k, "this", i) in ok and ok[(k, "baseline", i)].node_us_per_token()]  # no CPU read: no ratio
        if not rounds:
            continue
        cpu = [t.node_us_per_token() / b.node_us_per_token() for t, b in rounds]
        tok = [t.tok_s() / b.tok_s() for t, b in rounds]
        us = statistics.median(t.node_us_per_token() for t, _ in rounds)
        base_us = statistics.median(b.node_us_per_token() for _, b in rounds)
        out.append(f"this vs baseline ({' '.join(map(str, k))}, {len(rounds)} rounds): node CPU per token "
                   f"{statistics.median(cpu):.2f}x [{' '.join(f'{r:.2f}' for r in cpu)}] (medians {us:.1f} vs "
                   f"{base_us:.1f} us), tok/s {statistics.median(tok):.2f}x [{' '.join(f'{r:.2f}' for r in tok)}]")
    return out


def api_against_single(cells: list[Cell]) -> list[str]:
    """Per grid point run with front ends (``--api-processes N`` > 1) and with one process on this tree:
    the control process's CPU per streamed token (issue 31's target: 5 us or less) and the whole node's
    (control + front ends + engines: no higher than one process's), medians over the rounds, and tok/s
    as a ratio to the one-process run of the same round."""
    out = []
    key = lambda x: (x.layout, x.model, x.setup, x.concurrency, x.sampling)  # noqa: E731
    ok = {(key(x), x.api_processes, x.pair): x for x in cells if x.wall_s and x.tokens and x.tree == "this"}
    for k, api in dict.fromkeys((k, a) for k, a, _ in ok if a > 1):
        rounds = [(ok[(k, api, i)], ok[(k, 1, i)]) for kk, a, i in ok if kk == k and a == api and (k, 1, i) in ok]
        if not rounds:
            continue
        med = statistics.median
        ctl, ctl1 = med(t.node_us_per_token() for t, _ in rounds), med(o.node_us_per_token() for _, o in rounds)
        tot, tot1 = med(t.total_us_per_token() for t, _ in rounds), med(o.total_us_per_token() for _, o in rounds)
        tok = [t.tok_s() / o.tok_s() for t, o in rounds]
        out.append(f"--api-processes {api} vs 1 ({' '.join(map(str, k))}, {len(rounds)} rounds): control loop "
                   f"{ctl:.1f} vs {ctl1:.1f} us/token (target <= 5: {_ok(ctl <= 5)}), whole node {tot:.1f} vs "
                   f"{tot1:.1f} us/token ({tot / tot1 if tot1 else float('nan'):.2f}x, target <= 1: {_ok(tot <= tot1)}), tok/s "
                   f"{med(tok):.2f}x [{' '.join(f'{r:.2f}' for r in tok)}]")
    return out


def api_scaling_rows(cells: list[Cell]) -> list[dict]:
    """Per grid point run (this tree) with ``--api-processes`` 1 and more: for each value ``n`` the median
    over rounds of tok/s, its fraction of linear ``tok(n) / (n * tok(1))``, the control process's and the
    whole node's CPU per token (us) and the clients' CPU (% of one core, summed; the busiest process's),
    with issue 31's targets: >= 0.7 of linear up to 4 processes, the control loop <= 5 us per token."""
    med = statistics.median
    key = lambda x: (x.layout, x.model, x.setup, x.concurrency, x.sampling)  # noqa: E731
    ok = [x for x in cells if x.wall_s and x.tokens and x.tree == "this"]
    rows = []
    for k in dict.fromkeys(key(x) for x in ok):
        by_n = {n: [x for x in ok if key(x) == k and x.api_processes == n] for n in sorted({x.api_processes for x in ok})}
        by_n = {n: xs for n, xs in by_n.items() if xs}
        if 1 not in by_n or len(by_n) < 2:
            continue
        one = med(x.tok_s() for x in by_n[1])
        for n, xs in by_n.items():
            tok, ctl = med(x.tok_s() for x in xs), med(x.node_us_per_token() for x in xs)
            frac = tok / (n * one) if one else 0.0
            rows.append({"point": " ".join(map(str, k)), "api_processes": n, "rounds": len(xs), "tok_s": tok,
                         "of_linear": frac, "control_us_per_token": ctl,
                         "whole_us_per_token": med(x.total_us_per_token() for x in xs),
                         "client_cpu_pct": med(100 * x.client_cpu_s / x.wall_s for x in xs),
                         "client_cpu_max_pct": med(100 * x.client_cpu_max_s / x.wall_s for x in xs),
                         "client_processes": xs[0].client_processes,
                         "linear_ok": frac >= 0.7 if 1 < n <= 4 else None, "control_ok": ctl <= 5.0})
    return rows


def api_scaling(cells: list[Cell]) -> list[str]:
    """:func:`api_scaling_rows` as lines, one per grid point and ``--api-processes`` value."""
    out = []
    for r in api_scaling_rows(cells):
        lin = f" (target >= 0.7: {_ok(r['linear_ok'])})" if r["linear_ok"] is not None else ""
        out.append(f"scaling ({r['point']}) --api-processes {r['api_processes']:>2}: {r['tok_s']:8.0f} tok/s, "
                   f"{r['of_linear']:.2f} of linear{lin}; control loop {r['control_us_per_token']:.1f} us/token "
                   f"(target <= 5: {_ok(r['control_ok'])}); whole node {r['whole_us_per_token']:.1f} us/token; "
                   f"clients {r['client_cpu_pct']:.0f}% CPU in {r['client_processes']} process(es) (busiest "
                   f"{r['client_cpu_max_pct']:.0f}%); {r['rounds']} round(s)")
    return out


def scaling(cells: list[Cell]) -> list[str]:
    """Two devices vs one: tok/s at 256 sequences per device, same layout, model, mode and sampling."""
    ok = [x for x in cells if x.wall_s and x.concurrency == 256 * x.devices and x.tree == "this" and x.api_processes == 1]
    out = []
    for two in (x for x in ok if x.devices == 2):
        mode = two.setup.split()[1]
        one = next((x for x in ok if x.devices == 1 and x.setup.split()[1] == mode and
                    (x.layout, x.model, x.sampling, x.pair) == (two.layout, two.model, two.sampling, two.pair)), None)
        if one and one.tok_s():
            r = two.tok_s() / one.tok_s()
            out.append(f"2 vs 1 device ({two.layout}, {two.model}, {mode}, {two.sampling}): {r:.2f}x "
                       f"(target >= 1.6x: {_ok(r >= 1.6)})")
    return out


def sampled_vs_greedy(cells: list[Cell]) -> list[str]:
    """ms per step, temperature 0.8 / top-p 0.95 against greedy at the same grid point and round (the
    target, <= 1.2x at batch 256, is issue 11's for a 128k vocabulary: ``llama3-vocab``)."""
    ok = [x for x in cells if x.wall_s and x.steps and x.concurrency == 256 * x.devices]
    out = []
    for t in (x for x in ok if x.sampling == "t0.8"):
        g = next((x for x in ok if x.sampling == "greedy" and (x.tree, x.pair, x.layout, x.model, x.setup,
                  x.concurrency) == (t.tree, t.pair, t.layout, t.model, t.setup, t.concurrency)), None)
        if g and g.ms_per_step() and t.ms_per_step():
            r = t.ms_per_step() / g.ms_per_step()
            goal = f" (target <= 1.2x: {_ok(r <= 1.2)})" if t.model == "llama3-vocab" else ""
            out.append(f"t0.8/top-p 0.95 vs greedy per step ({t.tree}, {t.layout}, {t.model}, {t.setup}, c={t.concurrency}): "
                       f"{r:.2f}x{goal}")
    return out
