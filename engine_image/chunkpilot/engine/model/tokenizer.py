"""Tokenizer from `tokenizer.json` (Hugging Face `tokenizers`), the chat template rendered with jinja2, and an
incremental detokenizer for streaming and stop strings."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        d = Path(model_dir)
        path = d / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"{d} has no tokenizer.json (the fast-tokenizer file); save the tokenizer with transformers")
        self._tok = HFTokenizer.from_file(str(path))
        cfg_path = d / "tokenizer_config.json"
        self.config: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        template = self.config.get("chat_template")
        jinja_path = d / "chat_template.jinja"
        if jinja_path.is_file():
            template = jinja_path.read_text()
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
        self.chat_template: str | None = template
        self.bos_token = _token_str(self.config.get("bos_token"))
        self.eos_token = _token_str(self.config.get("eos_token"))
        # Whether encode() should add BOS comes from tokenizer.json's own post-processor, as in transformers.

    @property
    def max_token_chars(self) -> int:
        """The longest vocabulary entry, in characters (byte-level BPE spells each byte as one character): no
        token stands for more text than this, so a text longer than n times it has more than n tokens, which lets
        the server refuse a huge prompt without tokenizing it."""
        if not hasattr(self, "_max_token_chars"):
            self._max_token_chars = max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=1)
        return self._max_token_chars

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def vocab(self) -> dict[str, int]:
        """Every token's spelling and id, added tokens included: two tokenizers with equal vocabs split text alike
        and number the pieces alike (a draft model must share its target's)."""
        return self._tok.get_vocab(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template; use a completion prompt instead")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        try:
            return env.from_string(self.chat_template).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except jinja2.TemplateError as e:  # templates reject e.g. non-alternating roles: the caller's input
            raise ValueError(f"messages do not fit this model's chat template: {e}") from None

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        # The template already spells the special tokens (as transformers' apply_chat_template(tokenize=True)).
        return self.encode(self.apply_chat_template(messages), add_special_tokens=False)


def _token_str(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


@dataclass
class IncrementalDetokenizer:
    """Decodes a growing list of ids without re-decoding the whole output each step (vLLM's prefix/read
    offsets): only the last few tokens are decoded, and text is held back while it ends in an incomplete
    UTF-8 sequence. With stop strings, the last (longest stop - 1) characters are held back too, so a stop
    string split over two tokens is never streamed out before it is recognised."""

    tokenizer: Tokenizer
    stop: list[str] = field(default_factory=list)
    # The prompt's last tokens give the first output token its context: SentencePiece decoders drop a leading
    # space when a token is decoded alone (" Paris" → "Paris").
    prompt_ids: list[int] = field(default_factory=list)
    text: str = ""
    _ids: list[int] = field(default_factory=list)
    _prefix_offset: int = 0
    _read_offset: int = 0
    _emitted: int = 0

    def __post_init__(self) -> None:
        self._ids = list(self.prompt_ids[-6:])
        self._prefix_offset = max(len(self._ids) - 5, 0)
        self._read_offset = len(self._ids)

    def add(self, token_id: int) -> tuple[str, bool]:
        """Append one token; returns (text safe to emit now, whether a stop string was hit). On a hit the
        text is cut before the stop string."""
        self._ids.append(token_id)
        prefix = self.tokenizer.decode(self._ids[self._prefix_offset : self._read_offset])
        full = self.tokenizer.decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return "", False
        new = full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        start = len(self.text)
        self.text += new
        for s in self.stop:
            # Only the tail can hold a new match: the new text plus a stop string's length before it.
            pos = self.text.find(s, max(0, start - len(s) + 1))
            if pos != -1:
                self.text = self.text[:pos]
                return self.flush(), True
        hold = max((len(s) for s in self.stop), default=1) - 1
        end = max(self._emitted, len(self.text) - hold)
        out, self._emitted = self.text[self._emitted : end], end
        return out, False

    def flush(self) -> str:
        """Everything not yet emitted (call when the sequence finishes)."""
        out, self._emitted = self.text[self._emitted :], len(self.text)
        return out
