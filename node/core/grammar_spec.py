"""What a sequence's output must match (pure data, carried in :class:`~node.core.sequence.SamplingParams`).

The spec travels with the sequence's sampling parameters wherever the sequence goes (a KV move to
another device, an adaptive or pooled hand-off, a peer node over TCP, a resume after an engine died),
so the engine that samples the sequence next can rebuild the grammar matcher from the tokens the
sequence has already emitted (:mod:`node.worker.grammar`).
"""

from __future__ import annotations

from typing import Literal

import msgspec

GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "ebnf", "structural_tag"]


class GrammarSpec(msgspec.Struct, frozen=True, array_like=True):
    """A constraint on a sequence's output text.

    Attributes:
        kind: ``json_schema`` (``spec``: the schema as JSON text), ``json_object`` (any JSON object;
            ``spec`` empty), ``regex`` (``spec``: the pattern), ``choice`` (``spec``: a JSON list of the
            allowed strings), ``ebnf`` (``spec``: an EBNF grammar whose start rule is ``root``),
            ``structural_tag`` (``spec``: the structural tag as JSON text).
        spec: the constraint's text; with ``kind`` it is the key of the compiled-grammar cache.
    """

    kind: GrammarKind
    spec: str = ""
