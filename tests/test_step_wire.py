"""The step messages' cost on the wire (issue 31's decode fast path): an engine's reply carries a plain
token as a short array, and a decode step of sequences the engine holds carries no diff."""

import msgspec
import pytest

from node.core.batcher import ScheduledSeq, StepKind, StepPlan
from node.core.sequence import PENDING, SamplingParams, Sequence
from node.runtime.step_encoder import StepEncoder
from node.worker.engine_core import StepReply
from node.worker.runner import SeqOutput
from node.worker.sampler import TokenLogprobs

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here


def test_reply_outputs_are_positional_and_round_trip():
    plain = msgspec.msgpack.encode(SeqOutput(token_id=5))
    assert len(plain) <= 4  # [5, nil, []]: no field names per sequence
    reply = StepReply([SeqOutput(5), SeqOutput(), SeqOutput(7, TokenLogprobs(7, -0.5, [(7, -0.5), (3, -1.0)]))], 0.25)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(reply), type=StepReply) == reply


def test_decode_step_sends_items_only_and_drops_what_left():
    seqs = [Sequence(f"s{i}", f"r{i}", 0, float(i), list(range(10)), SamplingParams(max_tokens=9), 64) for i in range(3)]
    for s in seqs:
        s.block_ids = [i for i in range(3)]
    enc = StepEncoder()
    held = {s.seq_id: 0 for s in seqs}

    def send(plan):
        msg = enc.encode(plan, held)
        for it in plan.items:
            if it.samples:
                it.seq.token_ids.append(PENDING)
        enc.sent(msg)
        for it in plan.items:
            it.seq.num_computed += it.num_tokens
        return msg

    first = send(StepPlan(StepKind.MIXED, [ScheduledSeq(s, 10) for s in seqs]))
    assert [n.seq_id for n in first.new] == ["s0", "s1", "s2"] and first.reset
    for s in seqs:
        s.token_ids[-1] = 42  # the reply overwrites the placeholder, as the engine appended it
    del held["s1"]
    msg = send(StepPlan(StepKind.DECODE, [ScheduledSeq(seqs[0], 1), ScheduledSeq(seqs[2], 1)]))
    assert [(i.seq_id, i.start, i.num_tokens, i.sample) for i in msg.items] == [("s0", 10, 1, True), ("s2", 10, 1, True)]
    assert (msg.new, msg.tokens, msg.blocks, msg.drop, msg.reset) == ([], [], [], ["s1"], False)
    assert sorted(enc.known) == ["s0", "s2"] and enc.known["s0"].num_tokens == 12
