"""Tokenizer, chat template and incremental detokenizer, on the ``tokenizers`` library and jinja2.

Hugging Face folders are read as transformers reads a fast tokenizer (``TokenizersBackend`` in 5.x,
``PreTrainedTokenizerFast`` in 4.x): ``tokenizer.json`` as written (its post-processor adds BOS), with
no truncation or padding; ``tokenizer_config.json`` for special tokens (one missing from
``tokenizer.json`` is added as a special token) and the ``chat_template`` (or ``chat_template.jinja``);
``generation_config.json`` for EOS ids. Special tokens written as text in a prompt (``"<s>"``) are
parsed as their ids, as transformers does by default (``split_special_tokens=False``).

One deliberate difference: :meth:`TextTokenizer.encode` adds BOS (or EOS) only where the text does not
already begin (end) with it, so a prompt pre-rendered with a chat template that writes
``{{ bos_token }}`` gets one BOS, not two (vLLM #9519). Chat templates render in a sandboxed jinja2
environment with ``trim_blocks``/``lstrip_blocks``, like ``apply_chat_template``.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from node.worker.tokenizer_cache import bound_word_cache

DEFAULT_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}{{ message['content'] }}\n\n"
    "{% elif message['role'] == 'user' %}User: {{ message['content'] }}\n"
    "{% elif message['role'] == 'assistant' %}Assistant: {{ message['content'] }}\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)


class TokenizerError(ValueError):
    """Tokenizer files are missing or a chat template failed to render."""


def _token_str(v: Any) -> str | None:
    if isinstance(v, dict):
        return v.get("content")
    return v


class TextTokenizer:
    """Encode/decode text and render chat prompts.

    Attributes:
        bos_token / eos_token: special token strings (may be None).
        eos_token_ids: ids at which generation stops (``generation_config.json`` first, then the
            tokenizer's EOS).
        vocab_size: size of the tokenizer's vocabulary (tokens).
    """

    def __init__(self, tok: Tokenizer, config: dict[str, Any], chat_template: str | None, eos_token_ids: list[int]):
        self._tok = tok
        tok.no_truncation()  # transformers encodes without truncation or padding unless asked
        tok.no_padding()
        tok.encode_special_tokens = bool(config.get("split_special_tokens", False))
        bound_word_cache(tok)  # whole prompts as cache keys grew the node by ~5 KB a prompt (tokenizer_cache.py)
        self.bos_token = _token_str(config.get("bos_token"))
        self.eos_token = _token_str(config.get("eos_token"))
        self.chat_template = chat_template
        eos_id = tok.token_to_id(self.eos_token) if self.eos_token else None
        self.eos_token_ids = list(eos_token_ids) or ([eos_id] if eos_id is not None else [])
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.special_ids = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
        # No token covers more characters than its longest vocabulary piece (+1 for a prepended space
        # marker), so a text longer than max_tokens * this is over max_tokens without tokenizing it.
        self.max_chars_per_token = max(len(p) for p in tok.get_vocab(with_added_tokens=True)) + 1
        self._anchor_id = tok.encode("a", add_special_tokens=False).ids[-1]
        self._anchor_text = tok.decode([self._anchor_id], skip_special_tokens=False)
        self._added_prefix, self._added_suffix = _post_processor_ids(tok)

    @classmethod
    def from_folder(cls, folder: str | Path) -> "TextTokenizer":
        """Load from a Hugging Face model folder. Raises :class:`TokenizerError` when files are missing."""
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"no tokenizer.json in {folder} (only fast tokenizers are supported)")
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust library raises plain Exception subclasses
            raise TokenizerError(f"{path} cannot be loaded: {e}") from e
        cfg = _read_json(folder / "tokenizer_config.json")
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_path = folder / "chat_template.jinja"
        if template is None and jinja_path.is_file():
            template = jinja_path.read_text()
        eos: list[int] = []
        e = _read_json(folder / "generation_config.json").get("eos_token_id")
        eos = e if isinstance(e, list) else ([] if e is None else [e])
        _add_config_special_tokens(tok, cfg)
        vocab = tok.get_vocab_size(with_added_tokens=True)
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in eos):
            raise TokenizerError(f"generation_config.json eos_token_id {e!r} must be token ids below {vocab}")
        return cls(tok, cfg, template, eos)

    @classmethod
    def byte_level(cls) -> "TextTokenizer":
        """A byte-level tokenizer with no merges: ids 0-2 are ``<unk> <s> </s>``, 3..258 the 256 bytes.

        Used for a benchmark model's config-only folder (no ``tokenizer.json``) and in tests.
        """
        alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
        vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{ch: i + 3 for i, ch in enumerate(alphabet)}}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens(["<unk>", "<s>", "</s>"])
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
        cfg = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
        return cls(tok, cfg, DEFAULT_CHAT_TEMPLATE, [2])

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (special-token text such as ``"<s>"`` becomes its special id).

        With ``add_special_tokens`` the ids the post-processor adds (BOS for Llama) are added, except
        where the text's own ids already begin (or end) with them: at most one BOS, never a doubled
        one from a pre-rendered chat prompt.
        """
        if not add_special_tokens:
            return self._tok.encode(text, add_special_tokens=False).ids
        if self._added_prefix is None:  # a post-processor that does more than add ids: use it as is
            return self._tok.encode(text, add_special_tokens=True).ids
        ids = self._tok.encode(text, add_special_tokens=False).ids
        pre, suf = self._added_prefix, self._added_suffix
        head = [] if ids[: len(pre)] == pre else pre
        tail = [] if suf and len(ids) >= len(suf) and ids[-len(suf):] == suf else suf
        return head + ids + tail

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        return self._tok.id_to_token(token_id) or ""

    def token_text(self, token_id: int) -> str:
        """Text of one token as it reads inside a sequence (for logprob listings; special tokens kept).

        Decoded after an anchor token and the anchor's text removed, so decoders that strip a leading
        space at the start of a text (sentencepiece's ``Strip``) still show the token's own space.
        """
        anchor = self._anchor_text
        return self._tok.decode([self._anchor_id, token_id], skip_special_tokens=False)[len(anchor) :]

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, continue_final_message: bool = False,
                            **variables: Any) -> str:
        """Render ``messages`` with the model's chat template (``tools``: the function definitions,
        passed to the template as ``tools``, as transformers' ``apply_chat_template`` does);
        ``variables`` are extra template variables (``enable_thinking``...), as its keyword arguments.

        ``continue_final_message``: as Hugging Face's, the text ends right after the last message's
        content (whatever the template writes after it, an end-of-turn token, is cut), so generation
        continues that message.

        Raises:
            TokenizerError: the model has no chat template, rendering failed (e.g. the template
                raised for an unsupported role), or the final message to continue is empty or not
                found in the rendered text.
        """
        if not self.chat_template:
            raise TokenizerError("this model has no chat template; use /v1/completions")
        try:
            text = _compile(self.chat_template).render(
                **{**variables, "messages": messages, "add_generation_prompt": add_generation_prompt, "tools": tools,
                   "bos_token": self.bos_token or "", "eos_token": self.eos_token or ""},
            )
        except jinja2.TemplateError as e:
            raise TokenizerError(f"chat template failed: {e}") from e
        except Exception as e:  # noqa: BLE001
            # whatever a template does with the client's messages and chat_template_kwargs (a variable of a
            # type it cannot use, a recursion, a filter that raises) is the request's fault: a 400, never a 500
            raise TokenizerError(f"chat template failed: {type(e).__name__}: {e}") from e
        if continue_final_message:
            final = str(messages[-1].get("content") or "").strip() if messages else ""
            at = text.rfind(final) if final else -1
            if at < 0:
                raise TokenizerError("continue_final_message: the final message's content is empty or does not "
                                     "appear in the rendered template")
            text = text[: at + len(final)]
        return text


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object file, ``{}`` when absent. Raises :class:`TokenizerError` when malformed."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} must hold a JSON object")
    return data


def _post_processor_ids(tok: Tokenizer) -> tuple[list[int] | None, list[int]]:
    """The ids the post-processor puts before and after a single text (``([1], [])`` for Llama).

    Found from a probe text; ``(None, [])`` when the post-processor does something other than add
    ids around the text, so callers fall back to the library's own ``add_special_tokens=True``.
    """
    plain = tok.encode("a b", add_special_tokens=False).ids
    full = tok.encode("a b", add_special_tokens=True).ids
    for i in range(len(full) - len(plain) + 1):
        if full[i : i + len(plain)] == plain:
            return full[:i], full[i + len(plain) :]
    return None, []


_NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _add_config_special_tokens(tok: Tokenizer, cfg: dict[str, Any]) -> None:
    """Add the tokens of ``tokenizer_config.json`` that ``tokenizer.json`` lacks, as transformers does.

    ``added_tokens_decoder`` entries keep their flags; named special tokens (``bos_token``...) and
    ``additional_special_tokens``/``extra_special_tokens`` are added as special, unnormalized tokens,
    so their text in a prompt is parsed as the token (a content already in the vocabulary keeps its id).
    """
    have = {t.content for t in tok.get_added_tokens_decoder().values()}
    new: list[AddedToken] = []
    decoder = cfg.get("added_tokens_decoder")
    if isinstance(decoder, dict):
        for _, spec in sorted(decoder.items(), key=lambda kv: int(kv[0]) if str(kv[0]).isdigit() else 0):
            if isinstance(spec, dict) and isinstance(spec.get("content"), str) and spec["content"] not in have:
                flags = {k: bool(spec[k]) for k in ("single_word", "lstrip", "rstrip", "normalized", "special") if k in spec}
                new.append(AddedToken(spec["content"], **flags))
                have.add(spec["content"])
    named = [_token_str(cfg.get(k)) for k in _NAMED_SPECIAL]
    for key in ("additional_special_tokens", "extra_special_tokens"):
        extra = cfg.get(key)
        if isinstance(extra, list):
            named += [_token_str(t) for t in extra]
    for content in named:
        if isinstance(content, str) and content and content not in have:
            new.append(AddedToken(content, special=True, normalized=False))
            have.add(content)
    if new:
        tok.add_tokens(new)


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    return env.from_string(template)


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas that never split a UTF-8 character.

    The window method of vLLM/TGI: decode ``ids[prefix:]`` and ``ids[prefix:read]`` and emit the
    difference; decoding from a few tokens back keeps leading-space rules (sentencepiece ``Strip``)
    and byte-fallback pieces right. A delta ending in U+FFFD (an incomplete byte sequence) is held
    back until the character completes, or until :meth:`flush` at the end. ``skip_special_tokens``:
    special tokens leave no text (the default, as vLLM's).
    """

    def __init__(self, tokenizer: TextTokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids = list(prompt_ids)
        self.prefix = max(len(self.ids) - 6, 0)
        self.read = len(self.ids)

    def add(self, token_id: int) -> str:
        """Append one token; return the text that became final."""
        self.ids.append(token_id)
        prefix_text = self.tok.decode(self.ids[self.prefix : self.read], self.skip)
        new_text = self.tok.decode(self.ids[self.prefix :], self.skip)
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            self.prefix, self.read = self.read, len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        """Text still held back (an incomplete character at the very end becomes U+FFFD)."""
        prefix_text = self.tok.decode(self.ids[self.prefix : self.read], self.skip)
        new_text = self.tok.decode(self.ids[self.prefix :], self.skip)
        self.prefix = self.read = len(self.ids)
        return new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""
