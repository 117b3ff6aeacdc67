"""bench.load.spec_decode's bookkeeping: the CPU time of a node and its engine processes, and per-round ratios."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from bench.load.spec_decode import _ratios, process_cpu_s

pytestmark = pytest.mark.quick


def test_cpu_time_counts_the_process_and_its_children():
    # a parent that idles while its child spins: the parent's own CPU stays near 0, the sum grows
    code = "import subprocess,sys,time; c=subprocess.Popen([sys.executable,'-c','while True: pass']); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        time.sleep(1.0)
        a = process_cpu_s(proc.pid)
        time.sleep(1.5)
        b = process_cpu_s(proc.pid)
        assert b - a > 0.2  # the spinning child's time (the parent only sleeps)
    finally:
        for child in open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split():
            os.kill(int(child), 9)
        proc.kill()
        proc.wait()


def test_ratios_pair_rounds_and_skip_missing_values():
    plain = [{"itl": 2.0}, {"itl": None}, {"itl": 4.0}]
    spec = [{"itl": 1.0}, {"itl": 3.0}, {"itl": 1.0}]
    assert _ratios(plain, spec, "itl") == [0.5, 0.25]
