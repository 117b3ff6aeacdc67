"""Plain tokens travel to the API front ends as runs of ``(key, index, id)`` in a step's frame, without a
delta object (the control loop's per-token work, issue 31), and give the front end exactly what one delta
per token gave: a choice's first token, a token with logprobs and one that ends the choice stay deltas,
and the frame keeps the order in which the tokens were produced."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from node.api.frontend_link import FrontendLink, _Sink
from node.api.frontend_node import FrontNode, FrontRequest
from node.api.link_protocol import FrameReader, Step, frame
from node.core.batcher import BatchConfig, Batcher
from node.core.ledger import BlockLedger
from node.core.sequence import SamplingParams
from node.runtime.delta_stream import DeltaStream
from node.runtime.engine import DeviceEngine
from node.runtime.request import RequestState
from node.runtime.token_output import TokenDelta
from node.worker.engine_core import StepReply
from node.worker.runner import SeqOutput
from node.worker.tokenizer import TextTokenizer

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here

STOP_ID = 7


class _Engine:
    """An engine in the node's process: output ``k`` of a sequence is ``100 + k``, or STOP_ID at output 4."""

    stopping = False
    kv_cache = None

    def __init__(self):
        self.seqs: dict[str, list] = {}

    def async_submit(self, msg):
        for new in msg.new:
            self.seqs[new.seq_id] = [new.prompt_len, len(new.token_ids)]
        outs = []
        for it in msg.items:
            st = self.seqs[it.seq_id]
            if not it.sample:
                outs.append(SeqOutput())
                continue
            k = st[1] - st[0] + 1  # the output this step samples (1-based)
            st[1] += 1
            outs.append(SeqOutput(STOP_ID if k == 4 else 100 + k))
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(StepReply(outs))
        return fut


class _Transport:
    def __init__(self):
        self.data = bytearray()

    def write(self, data: bytes) -> None:
        self.data += data

    def is_closing(self) -> bool:
        return False


class _Server:
    closing = False
    links: set = set()


def _control_frames(params: list[SamplingParams]) -> list:
    """Run requests (one choice each, keys 1..) on a device with a link's sinks; the link's frames' entries."""

    async def go():
        engine = DeviceEngine("cpu:0", _Engine(), Batcher(BlockLedger(64, 4, prefix_caching=True), BatchConfig()),
                              time.monotonic)
        link = FrontendLink(None, _Server())
        link.transport = _Transport()
        reqs = [RequestState(f"r{k}", [1, 2, 3], p, 1, None, [2], 64, time.monotonic(), stream=_Sink(link, k + 1),
                             detokenize=False) for k, p in enumerate(params)]
        for r in reqs:
            engine.add(r)
        for _ in range(40):
            if all(r.done for r in reqs):
                break
            await engine._iteration()
            await asyncio.sleep(0)  # the link's flush
        assert all(r.done for r in reqs)
        return [e for m in FrameReader().feed(bytes(link.transport.data)) for e in m.deltas]

    return asyncio.run(go())


def test_plain_tokens_go_as_runs_and_the_rest_as_deltas():
    entries = _control_frames([SamplingParams(max_tokens=6, ignore_eos=True),  # length at 6
                               SamplingParams(max_tokens=20, stop_token_ids=(STOP_ID,)),  # stop at 4
                               SamplingParams(max_tokens=20, stop_token_ids=(STOP_ID,), min_tokens=5)])  # length at 20
    got: dict[int, list] = {1: [], 2: [], 3: []}
    for e in entries:
        if type(e) is list:
            assert len(e) % 3 == 0
            for j in range(0, len(e), 3):
                got[e[j]].append(("plain", e[j + 2]))
        else:
            got[e.key].append(("delta", e.token_ids[0], e.finish_reason, e.device))
    assert got[1] == [("delta", 101, None, "cpu:0")] + [("plain", 100 + k) for k in (2, 3)] + [("plain", STOP_ID),
                                                                                                ("plain", 105)] + \
        [("delta", 106, "length", None)]
    assert got[2] == [("delta", 101, None, "cpu:0"), ("plain", 102), ("plain", 103), ("delta", STOP_ID, "stop", None)]
    # below min_tokens the stop id ends nothing: a delta (the full test), no end; then plain tokens again
    assert got[3][:5] == [("delta", 101, None, "cpu:0"), ("plain", 102), ("plain", 103), ("delta", STOP_ID, None, None),
                          ("plain", 105)]
    assert got[3][-1] == ("delta", 120, "length", None) and len(got[3]) == 20
    assert any(type(e) is list and len(e) > 3 for e in entries)  # one run holds several requests' tokens


def test_a_run_gives_the_front_end_what_one_delta_per_token_gave():
    tok = TextTokenizer.byte_level()
    ids = tok.encode("one two STOP three", add_special_tokens=False)
    params = SamplingParams(max_tokens=50, stop=("STOP",))

    def request(key: int) -> FrontRequest:
        return FrontRequest(key, f"r{key}", [1, 2], params, 1, DeltaStream(), 0, [], tok, 512, 0.0)

    by_delta, by_run = request(1), request(2)
    for t in ids:
        by_delta.on_wire(TokenDelta(1, 0, [t]))
    node = FrontNode.__new__(FrontNode)
    node.requests = {2: by_run}
    for part in (ids[:4], ids[4:]):  # two steps' runs, through the wire; key 9 is a request already closed
        for m in FrameReader().feed(frame(Step([[v for t in part for v in (2, 0, t, 9, 0, t)]]))):
            node.on_step(m)
    assert by_run.ended == by_delta.ended == [True]
    assert by_run.stream._items == by_delta.stream._items


def test_a_run_is_a_flat_array_on_the_wire_and_keeps_its_place():
    step = Step([TokenDelta(3, 0, [17], device="cpu:0"), [3, 0, 18, 4, 1, 9], TokenDelta(3, 0, [19], "length")])
    assert msgspec.msgpack.decode(frame(step)[4:]) == [
        "Step", [{"k": 3, "i": 0, "t": [17], "d": "cpu:0"}, [3, 0, 18, 4, 1, 9], {"k": 3, "i": 0, "t": [19], "f": "length"}]]
    assert FrameReader().feed(frame(step)) == [step]
