"""The sampler's per-request token controls (node/worker/token_masks.py) on plain tensors."""

import pytest
import torch

from node.core.sequence import SamplingParams
from node.worker.sample_request import SampleRequest
from node.worker.sampler import sample
from node.worker.token_masks import apply_token_masks

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here

V = 10


def row(history: list[int] = (), prompt_len: int = 0, **params) -> SampleRequest:
    return SampleRequest(SamplingParams(max_tokens=4, temperature=0.0, **params), list(history), prompt_len, 0)


def test_each_control_touches_only_its_row():
    logits = torch.zeros(4, V)
    reqs = [row(), row(logit_bias=((3, 2.0), (3, 1.0), (V + 5, 9.0))), row(allowed_token_ids=(1, 7)),
            row([5, 6, 1, 2], prompt_len=2, bad_words=((4,), (2, 8), (1, 9), (6, 1, 3)))]
    apply_token_masks(logits, reqs)
    assert torch.equal(logits[0], torch.zeros(V))
    assert logits[1, 3] == 3.0 and logits[1].sum() == 3.0  # both biases of one id add up; an id past V is ignored
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == [1, 7]
    # output so far [1, 2]: "4" always banned, "2 8" ends after 2 -> 8 banned, "1 9" does not (output ends
    # with 2), "6 1 3" does not (6 is in the prompt, not the output)
    assert (~torch.isfinite(logits[3])).nonzero().flatten().tolist() == [4, 8]


def test_masks_apply_after_the_raw_logprobs():
    logits = torch.tensor([[0.0, 5.0, 1.0]])
    toks, lps = sample(logits, [SampleRequest(SamplingParams(max_tokens=1, temperature=0.0, logprobs=1,
                                                             allowed_token_ids=(2,)), [], 0, 0)], torch.Generator())
    assert toks == [2]
    assert lps[0].top[0][0] == 1  # the model's own top token, not the masked distribution's
