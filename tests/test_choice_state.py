"""A choice's text accumulates in linear time (issue 32: ``ChoiceState.text`` grew quadratically).

The check counts the characters copied by string concatenation instead of timing it: every piece is a
``str`` subclass whose ``__radd__`` (which Python calls for ``text + piece``, the right operand being
a subclass) records the length of the text it is appended to. ``text += piece`` on each delta copies
the whole text so far each time (O(n²) characters); keeping the pieces and joining them copies none.
"""

import pytest

from node.api.responses import ChoiceState

pytestmark = pytest.mark.quick  # the quick tier (bash scripts/test --quick) runs every test here


class _Piece(str):
    copied = 0  # characters of the left operand copied by ``text + piece``

    def __radd__(self, other: str) -> str:
        _Piece.copied += len(other)
        return str.__add__(other, self)


def test_text_accumulates_without_copying_what_came_before():
    _Piece.copied = 0
    c = ChoiceState(0)
    pieces = [_Piece(f"tok{i} ") for i in range(4000)]
    for p in pieces[:2000]:
        c.add_text(p)
    assert c.text == "".join(pieces[:2000])  # read midway: still right after more pieces
    for p in pieces[2000:]:
        c.add_text(p)
    c.add_text("")
    total = sum(map(len, pieces))
    assert c.text == "".join(pieces) and len(c.text) == total
    # Linear: at most a few copies of the text in all (the quadratic way copies ~ 4000/2 texts, ~ 70 M chars).
    assert _Piece.copied <= 2 * total, _Piece.copied


def test_empty_choice_has_empty_text():
    c = ChoiceState(3)
    assert c.text == "" and not c.parts
