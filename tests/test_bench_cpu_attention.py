"""bench.device.cpu_attention's roofline bookkeeping (part 3)."""

import pytest

from bench.device.cpu_attention import llc_mib, memory_roofline

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here


def test_roofline_gives_bytes_floor_and_achieved_bandwidth():
    rows = [{"model": "small", "backend": "cpu", "layers": 5, "kv_bytes_per_layer_step": 2 << 20, "paged_attention_ms": 5.0},
            {"model": "big", "backend": "cpu", "layers": 5, "kv_bytes_per_layer_step": 8 << 20, "paged_attention_ms": 8.0}]
    small, big = memory_roofline(rows, bandwidth_gbs=10.0, cache_mib=32.0)
    assert small["kv_mib_per_step"] == 10.0 and big["kv_mib_per_step"] == 40.0
    assert big["memory_floor_ms"] == round(40 * 2**20 / 10e9 * 1e3, 2)  # 4.19 ms
    assert small["achieved_gb_per_s"] == round(10 * 2**20 / 5e-3 / 1e9, 2)  # 2.10 GB/s
    assert (small["llc_mib"], big["read_gb_per_s"]) == (32.0, 10.0)


def test_llc_is_a_size_or_unknown():
    size = llc_mib()
    assert size is None or size > 0
