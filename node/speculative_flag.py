"""``shiftnode serve --speculative-config``: the flag and its parse (:mod:`node.core.spec_config`)."""

from __future__ import annotations

import argparse

from node.core.spec_config import SpeculativeConfig, parse_speculative_config


def speculative_arg(text: str) -> SpeculativeConfig:
    """argparse type of ``--speculative-config``: :func:`parse_speculative_config`.

    Raises:
        argparse.ArgumentTypeError: the configuration's error (argparse adds the flag's name).
    """
    try:
        return parse_speculative_config(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--speculative-config: ")) from None


def add_speculative_flag(p: argparse.ArgumentParser) -> None:
    """Add ``--speculative-config`` to ``shiftnode serve``'s parser (its value: a :class:`SpeculativeConfig` or None)."""
    p.add_argument("--speculative-config", default=None, type=speculative_arg, metavar="JSON",
                   help="speculative decoding, vLLM's JSON shape, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                        "\"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}' or a draft model with the target's "
                        "vocabulary, '{\"model\": \"PATH\", \"num_speculative_tokens\": 3}' [off]; docs/user-guide.md")
