"""The word cache of ``tokenizers`` is bounded where whole prompts are its keys (node/worker/tokenizer_cache.py).

stories260k has no pre-tokenizer, so each distinct prompt of <= 256 characters was cached whole (~4.9 KB
of native memory each, up to 10,000 of them): the soak's node process grew with every new prompt.
"""
import ctypes
import random

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from node.worker.tokenizer import TextTokenizer
from node.worker.tokenizer_cache import WHOLE_TEXT_CACHE_ENTRIES, keeps_text_whole
from support import STORIES, require_shared

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here

WORDS = "once upon a time there was a little girl who liked to play in the park with her dog".split()


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]


def _malloc_in_use() -> int:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    return libc.mallinfo2().uordblks


def test_distinct_prompts_do_not_grow_native_memory_past_the_bound():
    require_shared()
    tok = TextTokenizer.from_folder(STORIES)
    rng = random.Random(0)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 40))) for _ in range(2000)]  # < 256 chars
    for p in prompts[:WHOLE_TEXT_CACHE_ENTRIES]:  # fill the bounded cache first
        tok.encode(p)
    before = _malloc_in_use()
    for p in prompts[WHOLE_TEXT_CACHE_ENTRIES:]:
        tok.encode(p)
    grown = _malloc_in_use() - before
    # unbounded: ~1,750 new entries of ~5 KB (~9 MB); bounded: the full cache replaces nothing
    assert grown < 2 * 2**20, f"native memory grew {grown / 2**20:.1f} MiB over 1,744 distinct prompts"


def test_only_tokenizers_that_keep_text_whole_are_bounded():
    bpe = Tokenizer(models.BPE())
    assert keeps_text_whole(bpe)  # no pre-tokenizer
    bpe.pre_tokenizer = pre_tokenizers.Metaspace(split=False)
    assert keeps_text_whole(bpe)
    bpe.pre_tokenizer = pre_tokenizers.Metaspace()
    assert not keeps_text_whole(bpe)  # "▁a", "▁b", "▁c": short words, the default cache stays
    llama2 = Tokenizer(models.BPE())  # stories260k's normalizer: spaces become ▁ before any pre-tokenizer
    llama2.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    llama2.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    assert keeps_text_whole(llama2)  # no whitespace is left to split on
