"""The rules of the policies' snapshot (node.core.snapshot), which the live driver and the simulator
share: residents, queued work, reservations and moves (pure)."""

from __future__ import annotations

import pytest

from node.core.batcher import BatchConfig, Batcher
from node.core.ledger import BlockLedger
from node.core.roles import Role
from node.core.sequence import SamplingParams, Sequence, SeqStatus
from node.core.snapshot import DeviceView, Placement, node_snapshot, waiting_prompt

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here

B = 4


def decoding(name: str, batcher: Batcher) -> Sequence:
    s = Sequence(name, name, 0, 0.0, [1] * 8, SamplingParams(max_tokens=20), 4096)
    s.token_ids += [5, 6]  # two outputs, the last one not yet computed
    s.num_computed = 9
    s.first_token_s = 0.5
    s.status = SeqStatus.RUNNING
    s.block_ids = batcher.ledger.allocate(3)
    batcher.running.append(s)
    return s


def view(device_id: str, b: Batcher, placements) -> DeviceView:
    return DeviceView(device_id, Role.DECODE, 0.0, None, None, 1.0, b, tuple(placements))


def test_residents_queued_work_reserves_and_moves():
    src, dst = (Batcher(BlockLedger(32, B), BatchConfig(max_num_seqs=8)) for _ in range(2))
    staying, queued_move, copying = decoding("a", src), decoding("b", src), decoding("c", src)
    copying.block_ids = src.release(copying)  # its move has begun: out of the batcher, blocks pinned
    prompt = Sequence("p", "p", 0, 0.2, [3] * 10, SamplingParams(max_tokens=5), 4096)
    src.add(prompt)
    placed = [Placement(6, (staying,)), Placement(6, (queued_move,)), Placement(6, (copying,)), Placement(4, (prompt,))]
    snap = node_snapshot(1.0, [view("src", src, placed), view("dst", dst, [])],
                         moving={"b": "dst", "c": "dst", "x": "peer"}, moved_s={"a": 0.25},
                         expected=lambda s: 7, pause_s=0.03)
    s, d = snap.devices
    assert [r.request_id for r in s.resident] == ["a"] and s.resident[0].moved_s == 0.25
    assert [r.request_id for r in d.resident] == ["b", "c"] and all(r.moved_s == 1.0 for r in d.resident)
    assert (s.prefill_queue_tokens, s.prefill_queue_seqs) == (10, 1)
    # 6 - 3 for each of a and b (b still here), nothing for c (copying away), 4 for the prompt
    assert s.kv_reserved_blocks == 3 + 3 + 4
    assert d.kv_reserved_blocks == 3  # b's blocks, which dst allocates when its move begins
    assert s.seq_slots_free == 8 - 1 - 1 and d.seq_slots_free == 8 - 2
    assert snap.pause_s == 0.03


def test_a_waiting_prompt_counts_each_choice():
    b = Batcher(BlockLedger(8, B, prefix_caching=True), BatchConfig())
    choices = [Sequence("r-0", "r", 0, 0.0, [1] * 6, SamplingParams(max_tokens=9), 4096),
               Sequence("r-1", "r", 1, 0.0, [1] * 6, SamplingParams(max_tokens=9), 4096)]
    w = waiting_prompt("r", choices, 0.1, 9, {"d0": b}, 0)
    assert (w.prompt_tokens, w.expected_output_tokens, w.seqs, w.cached_tokens) == (12, 18, 2, {})
