"""bench.device.transfer end to end at a small size: both transports move a sequence between two processes,
the received KV equals the sent (the warm-up round's CRC-32 check), and every figure is measured."""

import pytest

from bench.device.transfer import run
from support import require_nixl

pytestmark = pytest.mark.slow_only("each case runs whole bench.device.transfer rounds between two processes (TCP, NIXL)")


@pytest.mark.parametrize("transport", ["tcp", "nixl"])
def test_a_round_moves_the_kv_and_measures_it(transport):
    if transport == "nixl":
        require_nixl()
    [row] = run(transport, mib=4, rounds=1)  # a warm-up round (checked) and one measured
    assert row["nbytes"] == 4 << 20 and row["mb_s"] > 0 and row["wall_s"] > 0
    assert all(0 <= row[k] < 16 for k in ("loop_busy", "cpu", "rx_loop_busy", "rx_cpu"))
