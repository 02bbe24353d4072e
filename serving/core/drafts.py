"""Drafts for speculative decoding without a second model: what a sequence is likely to write
next, read from text the host already holds.

An RL group writes the same problem many times, and a run writes it again every epoch: the
samples of a prompt repeat each other's phrasings, equations and numbers, and the long tail of
a group (the few samples still running) can copy much of what its siblings wrote (Seer's
grouped speculation, DAS's per-prompt suffix trees). `SuffixDrafter` keeps one `SuffixIndex`
per prompt over the prompt, every sample of it as it is written, and the same prompt's earlier
rollouts, within a memory bound (the least recently drafted prompts forgotten first).
`NgramDrafter` is prompt-lookup decoding: the sequence's own prompt and tokens only.

A draft is a proposal, never a sample: the engine verifies it against the target model and
keeps the sampled distribution exactly (serving/runner/speculate.py), so a bad draft costs
time, not correctness. A model drafter (a small draft model, an MTP head) implements the
same `Drafter` interface.
"""

from __future__ import annotations

import collections
from typing import Protocol

from serving.core.sequence import Sequence


class Drafter(Protocol):
    """Proposes up to `k` next tokens of a running sequence; told each token it writes."""

    def draft(self, seq: Sequence, k: int) -> list[int]: ...

    def observe(self, seq: Sequence, token: int) -> None: ...

    def finished(self, seq: Sequence) -> None: ...


class SuffixIndex:
    """Every context of up to `depth` tokens in a set of texts, with how often each next token
    followed it: a suffix tree cut at `depth` (SuffixDecoding's, as a table). `add` appends a
    token to one text; `propose` walks from the longest context matching a sequence's end,
    taking the most frequent continuation, as long as it holds at least `min_share` of what
    followed its context and matched at least `min_match` tokens."""

    def __init__(self, depth: int = 8):
        self.depth = depth
        self.next: dict[tuple[int, ...], collections.Counter] = {}
        self.entries = 0

    def add_text(self, tokens: list[int]) -> None:
        for i in range(1, len(tokens)):
            self.add(tokens[max(0, i - self.depth):i], tokens[i])

    def add(self, before: list[int], token: int) -> None:
        """`token` followed `before` (a text's last tokens) once more."""
        for m in range(1, min(self.depth, len(before)) + 1):
            counts = self.next.get(ctx := tuple(before[-m:]))
            if counts is None:
                counts = self.next[ctx] = collections.Counter()
            if token not in counts:
                self.entries += 1
            counts[token] += 1

    def propose(self, text: list[int], k: int, min_match: int = 1,
                min_share: float = 0.3) -> list[int]:
        out: list[int] = []
        tail = list(text[-self.depth:])
        while len(out) < k:
            for m in range(min(self.depth, len(tail)), min_match - 1, -1):
                counts = self.next.get(tuple(tail[-m:]))
                if counts:
                    break
            else:
                return out
            token, seen = counts.most_common(1)[0]
            if seen < min_share * sum(counts.values()):
                return out
            out.append(token)
            tail = (tail + [token])[-self.depth:]
        return out


def _before(seq: Sequence, i: int, n: int) -> list[int]:
    """The `n` tokens before generated token i of `seq` (its prompt's end included)."""
    tokens = seq.tokens
    if i >= n:
        return tokens[i - n:i]
    return seq.request.prompt[len(seq.request.prompt) - (n - i):] + tokens[:i]


class SuffixDrafter:
    """Drafts from the index of the sequence's prompt: the prompt, its siblings as they are
    written, its earlier rollouts. At most `max_entries` (context, token) entries over every
    prompt's index; past that the least recently drafted prompts are forgotten.

    Indexing is lazy: `observe` only notes a sequence the first time it writes, a finished
    one waits with its prompt's others, and a prompt's index takes in its sequences' new
    tokens (running and finished) when a draft is asked of it, so an engine that does not
    speculate pays nothing per token. Finished sequences not indexed yet are kept up to as
    many tokens as the bound's entries allow (max_entries / depth), the oldest dropped
    first."""

    def __init__(self, depth: int = 8, max_entries: int = 2_000_000, min_match: int = 2):
        self.depth, self.max_entries, self.min_match = depth, max_entries, min_match
        self.indexes: collections.OrderedDict[tuple[int, ...], SuffixIndex] = \
            collections.OrderedDict()
        self.entries = 0
        # prompt -> {id(seq): [seq, tokens of it indexed]}: the sequences writing it now
        self._live: dict[tuple[int, ...], dict[int, list]] = {}
        self._keys: dict[int, tuple[int, ...]] = {}      # id(seq) -> its prompt
        # prompt -> [[seq, tokens of it indexed], ...]: finished, not indexed yet (oldest first)
        self._ended: collections.OrderedDict[tuple[int, ...], list[list]] = \
            collections.OrderedDict()
        self._ended_tokens = 0

    def _index(self, key: tuple[int, ...]) -> SuffixIndex:
        index = self.indexes.get(key)
        if index is None:
            index = self.indexes[key] = SuffixIndex(self.depth)
            index.add_text(list(key))
            self.entries += index.entries
        self.indexes.move_to_end(key)
        return index

    def _catch_up(self, key: tuple[int, ...]) -> SuffixIndex:
        """The prompt's index with every token its sequences have written so far."""
        index = self._index(key)
        before = index.entries
        ended = self._ended.pop(key, [])
        for entry in [*self._live.get(key, {}).values(), *ended]:
            seq, done = entry
            for i in range(done, len(seq.tokens)):
                index.add(_before(seq, i, self.depth), seq.tokens[i])
            entry[1] = len(seq.tokens)
        self._ended_tokens -= sum(len(seq.tokens) for seq, _ in ended)
        self.entries += index.entries - before
        while self.entries > self.max_entries and len(self.indexes) > 1:
            old_key, old = self.indexes.popitem(last=False)
            self.entries -= old.entries
            if old_key == key:          # this prompt alone is over the bound: start afresh
                return self._index(key)
        return index

    def draft(self, seq: Sequence, k: int) -> list[int]:
        key = self._keys.get(id(seq)) or tuple(seq.request.prompt)
        return self._catch_up(key).propose(_before(seq, len(seq.tokens), self.depth), k,
                                           self.min_match)

    def observe(self, seq: Sequence, token: int) -> None:
        """`seq` wrote `token` (already appended to seq.tokens)."""
        if id(seq) not in self._keys:
            key = self._keys[id(seq)] = tuple(seq.request.prompt)
            self._live.setdefault(key, {})[id(seq)] = [seq, 0]

    def finished(self, seq: Sequence) -> None:
        """Its tokens are to go into its prompt's index (at the next draft for that prompt),
        for its siblings and the prompt's next rollouts."""
        key = self._keys.pop(id(seq), None)
        if key is None:
            return
        live = self._live[key]
        entry = live.pop(id(seq))
        if not live:
            del self._live[key]
        self._ended.setdefault(key, []).append(entry)
        self._ended_tokens += len(seq.tokens)
        while self._ended_tokens > self.max_entries // self.depth and len(self._ended) > 1:
            _, dropped = self._ended.popitem(last=False)
            self._ended_tokens -= sum(len(s.tokens) for s, _ in dropped)


class NgramDrafter:
    """Prompt-lookup decoding: the sequence's own prompt and tokens, the latest occurrence of
    its last `n` tokens (n from `max_n` down to `min_n`) and what followed it. Each sequence's
    n-grams are indexed as it is drafted for, from where the last draft left off."""

    def __init__(self, max_n: int = 4, min_n: int = 2):
        self.max_n, self.min_n = max_n, min_n
        self._seen: dict[int, list] = {}     # id(seq) -> [{n-gram: end}, text indexed up to]

    def draft(self, seq: Sequence, k: int) -> list[int]:
        text = seq.request.prompt + seq.tokens
        state = self._seen.setdefault(id(seq), [{}, 0])
        ends, done = state
        # every n-gram ending before the text's last token: its latest end
        for end in range(max(done, self.min_n), len(text)):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                ends[tuple(text[end - n:end])] = end
        state[1] = len(text)
        for n in range(min(self.max_n, len(text)), self.min_n - 1, -1):
            end = ends.get(tuple(text[len(text) - n:]))
            if end is not None and end < len(text):
                return text[end:end + k]
        return []

    def observe(self, seq: Sequence, token: int) -> None:
        pass

    def finished(self, seq: Sequence) -> None:
        self._seen.pop(id(seq), None)


DRAFTERS = {"suffix": SuffixDrafter, "ngram": NgramDrafter}


def make_drafter(kind: str) -> Drafter | None:
    """The drafter `kind` names ("suffix", "ngram"), or None for "off"."""
    if kind == "off":
        return None
    if kind not in DRAFTERS:
        raise ValueError(f"speculative={kind!r} is not one of {('off', *DRAFTERS)}")
    return DRAFTERS[kind]()
