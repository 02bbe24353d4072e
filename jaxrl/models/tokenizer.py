"""Tokenizers: Hugging Face `tokenizer.json` through the `tokenizers` package, and a character
tokenizer for the built-in demo task. Both expose encode / decode and pad, bos and eos ids."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol, Sequence


class Tokenizer(Protocol):
    vocab_size: int
    pad_id: int
    bos_id: int | None
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def prompt_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """A text prompt as jaxrl hands it to a model everywhere (warm-up examples, RL problems,
    evaluation, the OpenAI endpoint): BOS, when the tokenizer has one, then the text's tokens."""
    bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    return bos + tokenizer.encode(text)


class CharTokenizer:
    """One token per character of a fixed alphabet, after three specials: pad=0, bos=1, eos=2."""

    SPECIALS = ("<pad>", "<bos>", "<eos>")

    def __init__(self, alphabet: str = "0123456789+-*=() "):
        if len(set(alphabet)) != len(alphabet):
            raise ValueError(f"alphabet {alphabet!r} repeats a character")
        self.alphabet = alphabet
        self._ids = {c: i + len(self.SPECIALS) for i, c in enumerate(alphabet)}
        self.vocab_size = len(self.SPECIALS) + len(alphabet)
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2

    def encode(self, text: str) -> list[int]:
        try:
            return [self._ids[c] for c in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the alphabet "
                             f"{self.alphabet!r}") from None

    def decode(self, ids: Sequence[int]) -> str:
        n = len(self.SPECIALS)
        return "".join(self.alphabet[i - n] for i in ids if n <= i < self.vocab_size)


class HFTokenizer:
    """A Hugging Face tokenizer folder (tokenizer.json, optional tokenizer_config.json)."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer as _Tokenizer

        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {str(path)!r}")
        self._tok = _Tokenizer.from_file(str(file))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        config_file = file.parent / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}

        def special(name):
            tok = config.get(name)
            if isinstance(tok, dict):
                tok = tok.get("content")
            return None if tok is None else self._tok.token_to_id(tok)

        def text(name):
            tok = config.get(name)
            return tok.get("content") if isinstance(tok, dict) else tok

        self.bos_token, self.eos_token = text("bos_token"), text("eos_token")
        # The Jinja chat template (OpenAI-style chat requests render through it); older
        # folders keep it in chat_template.jinja beside the config.
        template = config.get("chat_template")
        if isinstance(template, list):     # named templates: the default one
            template = next((t.get("template") for t in template
                             if t.get("name") == "default"), None)
        jinja = file.parent / "chat_template.jinja"
        self.chat_template = template or (jinja.read_text() if jinja.is_file() else None)
        self.bos_id = special("bos_token")
        self.eos_id = special("eos_token")
        pad = special("pad_token")
        self.pad_id = pad if pad is not None else (self.eos_id if self.eos_id is not None else 0)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)
