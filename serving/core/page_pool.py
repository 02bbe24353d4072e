"""Host-side bookkeeping of the KV pool's pages (nano-vllm's BlockManager): which pages are
free and how many sequences hold each. Pages shared by the samples of a group (their prompt's
full pages) are freed when the last holder lets go. Page 0 is the null page: never handed out,
it absorbs the writes of padding and idle slots (serving/runner/paged_kv.py)."""

from __future__ import annotations

import collections
import math

from serving.runner.paged_kv import NULL_PAGE


class PoolExhausted(Exception):
    """Fewer free pages than asked for."""


class PagePool:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages}: the pool needs the null page and at "
                             f"least one more")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free = collections.deque(p for p in range(num_pages) if p != NULL_PAGE)
        self._holders = [0] * num_pages
        self.handed_out = 0    # pages allocated over the pool's life (reuse counts again)

    @property
    def capacity(self) -> int:
        """Pages that can ever be handed out (all but the null page)."""
        return self.num_pages - 1

    @property
    def free(self) -> int:
        return len(self._free)

    def holders(self, page: int) -> int:
        return self._holders[page]

    def pages_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.page_size)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise PoolExhausted(f"{n} pages asked for, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(n)]
        self.handed_out += n
        for p in pages:
            self._holders[p] = 1
        return pages

    def share(self, pages: list[int]) -> list[int]:
        """One more holder for each page; returns the pages."""
        for p in pages:
            assert self._holders[p] > 0, f"page {p} is not allocated"
            self._holders[p] += 1
        return list(pages)

    def release(self, pages: list[int]) -> None:
        for p in pages:
            assert self._holders[p] > 0, f"page {p} released more often than held"
            self._holders[p] -= 1
            if self._holders[p] == 0:
                self._free.append(p)
