"""The CPU engine's intra-op thread count: the pure choice, the candidates, and a live node's report."""

import pytest

from node.worker.cpu_threads import LOOP_S_PER_STEP, choose_threads, thread_candidates


@pytest.mark.quick
def test_candidates_reserve_a_core_for_the_loop_and_front_ends_and_offer_all_of_them():
    assert thread_candidates(2, 0, 1, None, False) == (1, 2)
    assert thread_candidates(16, 0, 1, None, False) == (15, 16)
    assert thread_candidates(16, 4, 2, None, False) == (5, 6)
    assert thread_candidates(1, 0, 1, None, False) == (1, 1)
    assert thread_candidates(16, 0, 1, None, True) == (15, 15)  # tensor-parallel ranks share the cores: no probe
    assert thread_candidates(2, 0, 1, 2, False) == (2, 2)  # --cpu-threads
    assert thread_candidates(16, 4, 2, 3, True) == (3, 3)


@pytest.mark.quick
def test_a_step_that_outweighs_the_loop_takes_every_core():
    # 85M Llama at batch 1 (measured here): ~35 ms on one thread, ~20 ms on two
    assert choose_threads({1: 35e-3, 2: 20e-3}, 1, 2) == 2


@pytest.mark.quick
def test_a_step_cheaper_than_the_loop_leaves_the_loop_its_core():
    # stories260k: the step is a fraction of the loop's per-step work; a second thread buys nothing
    assert choose_threads({1: 0.3e-3, 2: 0.25e-3}, 1, 2) == 1


@pytest.mark.quick
def test_a_step_of_a_few_loops_keeps_the_reserved_core_whatever_its_probe_says():
    # a tiny model's probe on a busy machine: one noisy 3 ms step at one thread
    assert choose_threads({1: 3e-3, 2: 0.5e-3}, 1, 2) == 1
    assert choose_threads({1: 4e-3, 2: 0.5e-3}, 1, 2) == 2  # four loops' work: compute-bound enough


@pytest.mark.quick
def test_a_gain_within_the_margin_keeps_the_reserved_core():
    step1 = 10e-3
    # all cores must beat max(step1, loop) by 10 %: step2 + loop = 0.95 * step1 is not enough
    assert choose_threads({1: step1, 2: 0.95 * step1 - LOOP_S_PER_STEP}, 1, 2) == 1
    assert choose_threads({1: step1, 2: 0.85 * step1 - LOOP_S_PER_STEP}, 1, 2) == 2


@pytest.mark.quick
def test_busy_cores_that_slow_a_second_thread_keep_one():
    # a machine whose other core is busy: two OpenMP threads wait on it at every barrier
    assert choose_threads({1: 40e-3, 2: 110e-3}, 1, 2) == 1


@pytest.mark.quick
def test_equal_candidates_need_no_measurement_and_missing_ones_are_an_error():
    assert choose_threads({}, 3, 3) == 3
    with pytest.raises(ValueError, match="no step time measured at 2"):
        choose_threads({1: 1e-3}, 1, 2)
    with pytest.raises(ValueError, match="positive"):
        choose_threads({1: 1e-3, 2: 0.0}, 1, 2)


@pytest.mark.quick
def test_cpu_threads_flag_is_validated():
    from node.config import ConfigError, NodeConfig

    with pytest.raises(ConfigError, match="--cpu-threads"):
        NodeConfig(cpu_threads=0).validate()


def test_a_live_node_reports_its_engine_threads(stories_node):
    from node.config import usable_cores
    from tests.support import NodeProcess

    node = NodeProcess("--devices", "cpu:0", "--cpu-threads", "2")
    try:
        engine = node.status()["devices"][0]["engine"]
        assert engine["threads"] == 2, engine
    finally:
        node.close()
    # without --cpu-threads, timed at start-up: one of the two candidates (the session's one-device node,
    # whose log holds its start-up lines)
    (device,) = stories_node.status()["devices"]
    assert device["device"] == "cpu:0"
    assert device["engine"]["threads"] in thread_candidates(usable_cores(), 0, 1, None, False), device["engine"]
    assert "engine_threads" in stories_node.logs()
