"""KV pages kept between the turns of a multi-turn episode (SeamlessFlow's trajectory manager,
SGLang's and vLLM's prefix caching, keyed by trajectory instead of by hash).

When a sample that names a session ends, its pages are not returned to the pool: they are kept
under the session's key with the tokens they hold (the prompt and every generated token but the
last, which was sampled and never fed). The session's next turn sends the whole history as its
prompt (earlier turns, the last answer, the environment's reply); the scheduler takes the kept
pages back, finds how far the new prompt agrees with the tokens they hold, and prefills only
the rest. An episode's second and later turns so cost a prefill of their new tokens only.

Kept pages are a cache: when the pool runs dry, the least recently kept sessions are evicted
before any running sequence is preempted, and a turn whose session was evicted (or never kept)
prefills its whole prompt, which gives the same tokens, only later.
"""

from __future__ import annotations

import collections
import dataclasses

from serving.core.page_pool import PagePool


@dataclasses.dataclass
class Kept:
    tokens: list[int]      # the tokens whose keys and values the pages hold, in order
    pages: list[int]


@dataclasses.dataclass
class Continuation:
    pages: list[int]       # pages holding the first `cached` tokens of the prompt, in order
    cached: int            # prompt tokens already written: the prefill starts here


class SessionCache:
    def __init__(self, pool: PagePool):
        self.pool = pool
        self._kept: collections.OrderedDict[str, Kept] = collections.OrderedDict()
        self.evictions = 0
        self.reused_tokens = 0     # prompt tokens a continuation did not prefill again

    def __len__(self) -> int:
        return len(self._kept)

    def keep(self, key: str, tokens: list[int], pages: list[int]) -> None:
        """Keeps `pages` (whose first tokens hold `tokens`) for `key`'s next turn; pages past
        the tokens, and whatever `key` kept before, go back to the pool."""
        self.drop(key)
        held = self.pool.pages_for(len(tokens))
        self.pool.release(pages[held:])
        self._kept[key] = Kept(list(tokens), pages[:held])

    def drop(self, key: str) -> None:
        """Forgets `key` (its episode has ended), returning its pages."""
        kept = self._kept.pop(key, None)
        if kept is not None:
            self.pool.release(kept.pages)

    def evict(self, pages: int) -> None:
        """Evicts the least recently kept sessions until `pages` pages are free or none is kept.
        (Pages that a group's other samples still share free only when those end.)"""
        while self.pool.free < pages and self._kept:
            _, kept = self._kept.popitem(last=False)
            self.pool.release(kept.pages)
            self.evictions += 1

    def take(self, key: str, prompt: list[int]) -> Continuation | None:
        """The kept pages of `key` that `prompt` continues, now owned by the caller; None if
        nothing is kept or the prompt shares no page-worth of tokens with it. At least the
        prompt's last token is left to prefill (its logits start the next turn), and a page
        the prefill would write into is taken only if no one else holds it."""
        kept = self._kept.pop(key, None)
        if kept is None:
            return None
        same = 0
        for a, b in zip(kept.tokens, prompt):
            if a != b:
                break
            same += 1
        cached = min(same, len(prompt) - 1)
        size = self.pool.page_size
        boundary = cached // size               # the page position `cached` falls in
        if cached % size and self.pool.holders(kept.pages[boundary]) > 1:
            cached = boundary * size            # shared: rewrite its first tokens instead
        held = self.pool.pages_for(cached)
        self.pool.release(kept.pages[held:])
        if cached == 0:
            return None
        self.reused_tokens += cached
        return Continuation(kept.pages[:held], cached)
