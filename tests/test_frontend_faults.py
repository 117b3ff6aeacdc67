"""An API front end's faults stay with the request that has them (``--api-processes`` > 1, issue 45 item 6):
one request's exception in detokenization or stop-string handling fails that request only, and an
admission the control process never answers ends with an error within a bound. In-process, on the
front end's own classes (the hung front end's heartbeat is tested on a real node: test_api_processes.py)."""

import asyncio

import pytest

from node.api import frontend_node
from node.api.frontend_node import FrontNode
from node.api.link_protocol import Admitted, Close, FrameReader, Open, Step
from node.config import NodeConfig
from node.core.sequence import SamplingParams
from node.runtime.admission import EnginesDown
from node.runtime.delta_stream import DeltaStream
from node.runtime.token_output import TokenDelta
from node.worker.loader import load_model_info

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here


class _Link:
    """What the front end sent the control process, decoded."""

    def __init__(self):
        self.reader = FrameReader()
        self.messages = []

    def send(self, data: bytes) -> None:
        self.messages += self.reader.feed(data)


def _job(prompt_ids, index0=0):
    from node.api.openai import Job

    return Job(prompt_ids, SamplingParams(max_tokens=8, ignore_eos=True), index0)


async def _admitted_front(link: _Link, prompts: int) -> tuple[FrontNode, list, DeltaStream]:
    config = NodeConfig()
    front = FrontNode(config, load_model_info(config), 0, link.send)
    stream = DeltaStream()
    opening = asyncio.ensure_future(front.open_requests("cmpl-x", [_job([65, 66, 67], p) for p in range(prompts)], 1, stream))
    await asyncio.sleep(0)
    (opened,) = [m for m in link.messages if type(m) is Open]
    front.on_admitted(Admitted(opened.ticket))
    return front, await opening, stream


def test_one_requests_output_error_fails_that_request_only():
    async def main():
        link = _Link()
        front, (bad, good), stream = await _admitted_front(link, 2)

        def broken(token_id, logprobs, position=None):
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "a detokenizer bug")

        bad.outputs[0].on_token = broken
        # one step: a plain run for both, then a full delta for both
        front.on_step(Step([[bad.key, 0, 70, good.key, 1, 71],
                            TokenDelta(bad.key, 0, [72]), TokenDelta(good.key, 1, [73], finish_reason="length")]))
        got = await stream.take()
        bad_deltas = [d for d in got if d.index == 0]
        good_deltas = [d for d in got if d.index == 1]
        assert [d.token_ids for d in good_deltas] == [[71], [73]] and good_deltas[-1].finish_reason == "length"
        assert len(bad_deltas) == 1 and bad_deltas[0].error and "a detokenizer bug" in bad_deltas[0].error
        assert bad_deltas[0].error_status == 500 and bad.ended == [True]
        assert front.gone is None and good.key in front.requests  # the front end serves on
        closes = [m for m in link.messages if type(m) is Close]
        assert [c.key for c in closes] == [bad.key]  # the control process ends the failed one (its KV freed)

    asyncio.run(main())


def test_an_admission_that_never_comes_ends_with_an_error(monkeypatch):
    monkeypatch.setattr(frontend_node, "ADMIT_TIMEOUT_S", 0.2, raising=False)

    async def main():
        link = _Link()
        config = NodeConfig()
        front = FrontNode(config, load_model_info(config), 0, link.send)
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(EnginesDown, match="did not answer"):
            await asyncio.wait_for(front.open_requests("cmpl-y", [_job([65])], 1, DeltaStream()), 5)
        assert asyncio.get_running_loop().time() - t0 < 2
        assert not front.requests and not front._waiting
        (opened,) = [m for m in link.messages if type(m) is Open]
        closes = [m for m in link.messages if type(m) is Close]
        assert [c.key for c in closes] == [opened.jobs[0].key]  # an admission that comes late is undone

    asyncio.run(main())
