"""The adaptive policy's chunk placement as a part alone (:class:`node.core.mixed_placement.MixedPlacement`):
built from the estimates its constructor names, with no scheduler, and reading them at each call."""

from __future__ import annotations

import pickle

import pytest

from node.core.adaptive import AdaptiveScheduler
from node.core.cost import CostModel
from node.core.mixed_placement import MixedPlacement
from node.core.roles import DeviceState, Place, Role, RoleSchedulerConfig, WaitingPrompt, _Dev

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here


class _Mix:
    """A device's chunk budget this round: chunk ``c``, work start ``t0``, residents ``s`` holding ``k`` tokens."""

    def __init__(self, chunk: int, t0: float):
        self.chunk, self.t0, self.s, self.k, self.oldest_s = chunk, t0, 1, 100, None


def _devs(kv: tuple[int, ...]) -> list[_Dev]:
    return [_Dev(DeviceState(device_id=f"d{i}", role=Role.DECODE, kv_free_blocks=b, kv_total_blocks=64), i)
            for i, b in enumerate(kv)]


def _placement(target: list[float], urgent: bool = False) -> MixedPlacement:
    """1 ms per prompt token as chunks from ``t0``; 10 ms decode steps; a prompt needs 2 blocks (64 at most)."""
    need = lambda st, w: 2 if w.prompt_tokens <= 1000 else -1  # noqa: E731
    return MixedPlacement(target_s=lambda: target[0],
                          fits_kv=lambda dv, w: n if 0 <= (n := need(dv.st, w)) <= dv.kv else -1,
                          need_blocks=need, chunks_s=lambda mix, tokens: tokens / 1000,
                          decode_step_s=lambda n, k: 0.01, urgent=lambda w, now_s: urgent)


def _prompt(rid: str, tokens: int) -> WaitingPrompt:
    return WaitingPrompt(rid, tokens, 0.0, expected_output_tokens=10)


def test_prompts_go_fifo_where_their_chunks_end_soonest_within_the_target():
    devs = _devs((8, 8))
    mixes = {"d0": _Mix(64, t0=0.0), "d1": _Mix(64, t0=0.15)}  # d1 is busy for 150 ms
    target = [0.25]
    out: list[Place] = []
    left, capped = _placement(target).place(0.0, [_prompt("a", 100), _prompt("b", 100), _prompt("c", 100)],
                                            devs, mixes, out)
    # a: d0 ends at 0.1 s; b: d0 at 0.2 s, d1 at 0.25 s; c: d0 would end at 0.3 s, past the target: d1 (0.25 s)
    assert [(p.request_id, p.device_id, p.reserve_blocks) for p in out] == [("a", "d0", 2), ("b", "d0", 2),
                                                                            ("c", "d1", 2)]
    assert left == [] and capped == 0 and devs[0].q == 200 and devs[0].kv == 4
    target[0] = 0.05  # the target is read at each call: now a queued device takes nothing more
    more: list[Place] = []
    left, capped = _placement(target).place(0.0, [_prompt("d", 100)], devs, mixes, more)
    assert more == [] and [w.request_id for w in left] == ["d"] and capped == 100  # room, but not the time


def test_an_urgent_prompt_that_only_kv_binds_reserves_its_blocks_and_the_rest_pass_beside():
    # a prompt takes 2 blocks a sequence; "big" (two sequences: 4 blocks) fits neither device (2 and 3 free)
    placement = MixedPlacement(target_s=lambda: 1.0,
                               fits_kv=lambda dv, w: 2 * w.seqs if 2 * w.seqs <= dv.kv else -1,
                               need_blocks=lambda st, w: 2 * w.seqs, chunks_s=lambda mix, tokens: tokens / 1000,
                               decode_step_s=lambda n, k: 0.01, urgent=lambda w, now_s: w.request_id == "big")
    big = WaitingPrompt("big", 100, 0.0, expected_output_tokens=10, seqs=2)
    devs = _devs((2, 3))
    out: list[Place] = []
    left, capped = placement.place(0.0, [big, _prompt("s1", 10), _prompt("s2", 10)], devs,
                                   {"d0": _Mix(64, 0.0), "d1": _Mix(64, 0.0)}, out)
    # big reserves d1, which lacks the fewest blocks (1); s1 passes beside it on d0; s2 would have fit d1
    assert [(p.request_id, p.device_id) for p in out] == [("s1", "d0")]
    assert [w.request_id for w in left] == ["big", "s2"] and capped == 0
    assert devs[1].kv == 3 - 4 and devs[1].slots == (1 << 30) - 2


def test_the_adaptive_policy_gives_its_placement_the_cost_model_of_now_and_still_pickles():
    cost = CostModel(prefill_fixed_s=0.002, prefill_per_token_s=2e-5, decode_fixed_s=0.008, decode_per_seq_s=1e-4,
                     decode_per_context_token_s=1e-7, pause_s=0.005)
    refit = CostModel(prefill_fixed_s=0.002, prefill_per_token_s=2e-5, decode_fixed_s=0.016, decode_per_seq_s=1e-4,
                      decode_per_context_token_s=1e-7, pause_s=0.005)
    policy = AdaptiveScheduler(RoleSchedulerConfig(ttft_slo_ms=200, ttft_urgency=0.5), cost)
    assert policy.mixed._target_s() == 0.1
    policy.cost = refit  # an online refit replaces the model: the placement sees it at its next call
    assert policy.mixed._decode_step_s(4, 1000) == refit.decode_step_s(4, 1000) != cost.decode_step_s(4, 1000)
    copy = pickle.loads(pickle.dumps(policy))  # the simulator's process pools pickle what they run
    assert copy.mixed._decode_step_s.__self__ is copy
