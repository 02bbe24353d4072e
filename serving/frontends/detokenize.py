"""Text of a growing token sequence, one token at a time, at a cost per token that does not grow
with the sequence.

Decoding the whole sequence again for every new token costs O(length) per token: quadratic over
a 32k-token answer. `IncrementalDecoder` decodes only a short window instead (the offset scheme
of vLLM's and TGI's detokenizers): the tokens from `prefix` on, against the same window without
the newest tokens, and emits the difference. Starting the window a few tokens back keeps the
tokenizer's context-dependent spacing (SentencePiece's leading spaces, word-level joins) as the
one-shot decode has it; text that ends in an incomplete UTF-8 character (U+FFFD) is held until
the character completes, and `flush` hands over whatever is left when the sequence ends. The
concatenation of everything emitted equals `tokenizer.decode(tokens)`.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class IncrementalDecoder:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self._prefix = 0    # the window starts here ...
        self._read = 0      # ... and its text up to here has been emitted

    def add(self, token: int) -> str:
        """The new text that `token` completes ("" while it is held back)."""
        self.tokens.append(int(token))
        before = self.tokenizer.decode(self.tokens[self._prefix: self._read])
        text = self.tokenizer.decode(self.tokens[self._prefix:])
        if len(text) <= len(before) or text.endswith(REPLACEMENT):
            return ""
        self._prefix, self._read = self._read, len(self.tokens)
        return text[len(before):]

    def flush(self) -> str:
        """The text held back so far (an unfinished character included, as decode shows it)."""
        before = self.tokenizer.decode(self.tokens[self._prefix: self._read])
        text = self.tokenizer.decode(self.tokens[self._prefix:])
        self._prefix = self._read = len(self.tokens)
        return text[len(before):]
