"""A 10-second soak (``bench/load/soak.py``): streaming load with client aborts, kill -9 of an engine and a
peer restart; afterwards no KV block is held, no request hung or is still held, and no 5xx other
than 503 was answered. RSS growth is printed, not checked: 10 s have no steady state to measure
it against (the 30-minute run in bench/RESULTS.md checks it)."""
import pytest

from bench.load.soak import soak
from support import STORIES, require_shared

pytestmark = pytest.mark.slow_only("one 10-second soak of streaming load, client aborts and an engine's kill -9")


def test_a_short_soak_leaks_nothing_and_hangs_nothing(tmp_path):
    require_shared()
    rep = soak(10, concurrency=12, abort=0.3, model=STORIES, request_timeout_s=60, log_dir=tmp_path)
    print("\n".join(rep.lines()))
    assert rep.requests > 25 and rep.aborted > 0 and rep.completed > 0, rep.lines()
    assert any("kill -9" in e for e in rep.events) and any("B up again" in e for e in rep.events), rep.events
    assert rep.leaked_blocks == 0, rep.lines()
    assert rep.hung == 0 and rep.live_requests == 0, rep.lines()
    assert rep.server_errors == 0 and not rep.stream_errors.get("internal_error"), rep.lines()
