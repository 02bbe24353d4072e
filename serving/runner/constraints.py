"""Grammar-constrained decoding (structured outputs), with llguidance.

A request's `SamplingParams.grammar` is an llguidance grammar (made here from a JSON schema, a
Lark grammar or a regex). Each of its samples gets a matcher, which follows the tokens drawn and
says which tokens may come next; the engine loop turns that into a bitmask per row (bit t of
word t // 32 set: token t allowed) that the sampling programs apply to the logits, as they
apply min_tokens' EOS ban: the log-probs stay the model's own. When the grammar is complete the
sample ends ("stop"), so a constrained output always parses.

The masks cost the host a few tens of microseconds per constrained row and step (llguidance's
figure for a 128k vocabulary: 50 us on average); rows without a grammar share one all-allowed
mask kept on the device, so unconstrained decoding sends nothing more.
"""

from __future__ import annotations

import json
import threading

import numpy as np


def mask_words(vocab_size: int) -> int:
    """int32 words in one row's token bitmask."""
    return (vocab_size + 31) // 32


# JSON as `json.dumps(separators=(",", ":"))` writes it: no whitespace between tokens. With
# JSON's free whitespace a weak or early-RL model can write newlines after `{` until it runs
# out of tokens (vLLM's `disable-any-whitespace`, llguidance's `whitespace_flexible: false`).
# A schema's own "x-guidance" options still apply over these.
COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


def json_schema_grammar(schema: dict | bool) -> str:
    """The grammar of compact JSON text matching `schema` (ValueError: not a schema llguidance
    takes)."""
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=COMPACT)


def compact_json(schema: dict | bool) -> str:
    """`schema` as the argument of a Lark `%json` rule, compact as `json_schema_grammar`'s."""
    if schema is True:
        schema = {}
    if schema is False:
        schema = {"not": {}}
    options = {**COMPACT, **schema.get("x-guidance", {})}
    return json.dumps({**schema, "x-guidance": options}, separators=(",", ":"))


def lark_grammar(text: str) -> str:
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_lark(text)


def regex_grammar(pattern: str) -> str:
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_regex(pattern)


class Grammars:
    """Matchers for one tokenizer and model: `check` a grammar, start a `matcher`, `fill` the
    masks of a batch of rows."""

    def __init__(self, tokenizer, vocab_size: int):
        """`tokenizer`: jaxrl's (jaxrl/models/tokenizer.py): a Hugging Face tokenizer.json or
        the demo's characters. `vocab_size`: the model's (ids the tokenizer lacks: never
        allowed). llguidance reads the tokenizer at the first grammar (about a second for a
        150k vocabulary), not here: a server or an RL run that never constrains pays nothing."""
        self.vocab_size = vocab_size
        self._source = tokenizer
        self._built = None
        self._lock = threading.Lock()
        self._checked: dict[str, str] = {}     # grammar -> its error ("": valid)

    @property
    def _tokenizer(self):
        built = self._built
        if built is None:
            with self._lock:
                if self._built is None:
                    self._built = _ll_tokenizer(self._source, self.vocab_size)
                built = self._built
        return built

    def check(self, grammar: str) -> None:
        """ValueError naming what is wrong with `grammar` (remembered: agents repeat theirs)."""
        from llguidance import LLMatcher

        error = self._checked.get(grammar)
        if error is None:     # validated outside the lock: the engine loop's matchers need it
            failed, messages = LLMatcher.validate_grammar_with_warnings(grammar, self._tokenizer)
            error = messages[0] if failed else ""
            with self._lock:
                self._checked[grammar] = error
                if len(self._checked) > 1024:
                    self._checked.pop(next(iter(self._checked)))
        if error:
            raise ValueError(f"the grammar is not valid: {error}")

    def matcher(self, grammar: str, tokens=()):
        """A matcher at the start of `grammar`, having consumed `tokens` (a sample resumed with
        the tokens it had)."""
        from llguidance import LLMatcher

        m = LLMatcher(self._tokenizer, grammar, log_level=0)
        if tokens and not m.consume_tokens(list(tokens)):
            raise ValueError(f"the tokens so far do not match the grammar: {m.get_error()}")
        return m

    def masks(self, seqs) -> np.ndarray | None:
        """The token bitmasks of serving Sequences (serving/core/sequence.py) in a batch, or None
        when none has a grammar (nothing is sent). A sample's matcher is made when it is first
        needed: one resumed from a checkpoint (carry) goes on from the tokens it had."""
        if all(s.request.sampling.grammar is None for s in seqs):
            return None
        for s in seqs:
            if s.matcher is None and s.request.sampling.grammar is not None:
                s.matcher = self.matcher(s.request.sampling.grammar, s.tokens)
        return self.fill([s.matcher for s in seqs], len(seqs))

    def fill(self, matchers: list, rows: int) -> np.ndarray:
        """[rows, mask_words] int32: row i's allowed tokens by matchers[i] (all for None and
        for rows past the list)."""
        from llguidance.numpy import fill_next_token_bitmask

        mask = np.full((rows, mask_words(self.vocab_size)), -1, np.int32)
        for i, m in enumerate(matchers):
            if m is not None:
                fill_next_token_bitmask(m, mask, i)
        return mask


def _ll_tokenizer(tokenizer, vocab_size: int):
    import llguidance

    eos = tokenizer.eos_id
    backend = getattr(tokenizer, "_tok", None)
    try:
        if backend is not None:                   # HFTokenizer: the Rust tokenizer, as JSON
            return llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos)
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(
            _ByteTokens(tokenizer, vocab_size)), n_vocab=vocab_size, eos_token=eos)
    except Exception as e:
        raise ValueError(f"constrained decoding is unavailable: llguidance cannot read this "
                         f"model's tokenizer ({e})") from None


class _ByteTokens:
    """A tokenizer without a tokenizer.json (the demo's characters) as llguidance's
    TokenizerWrapper reads one: each id's bytes, the special ids, and encoding."""

    def __init__(self, tokenizer, vocab_size: int):
        specials = getattr(tokenizer, "SPECIALS", ())
        self.eos_token_id, self.bos_token_id = tokenizer.eos_id, tokenizer.bos_id
        self.special_token_ids = list(range(len(specials)))
        self.tokens = [specials[i].encode() if i < len(specials)
                       else tokenizer.decode([i]).encode() for i in range(tokenizer.vocab_size)]
        self.tokens += [b""] * (vocab_size - len(self.tokens))
        self._tokenizer = tokenizer

    def __call__(self, text):
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text)
