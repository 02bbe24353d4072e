"""Who runs next, on which pages and in which batches (nano-vllm's Scheduler, Sarathi-Serve's
token budget, vLLM's recompute preemption). Host bookkeeping only: the engine loop
(serving/core/engine_loop.py) runs the programs it plans.

Each loop iteration the scheduler
- plans one prefill call: the next chunk of every prompt being prefilled, then new admissions,
  until `prefill_budget` prompt tokens. A request is admitted only when its n slots and its
  prompt's pages are free, keeping one free page per running sequence in hand (a watermark
  against immediate preemption). Preempted sequences are admitted before new requests, and a
  request carried over from a previous run (`Request.carried`) queues its started samples as
  preempted ones;
- plans one decode dispatch: gives every running sequence the pages the next
  `steps_per_dispatch` decode steps write and puts them in one batch, or two when that is
  cheaper (`decode_groups`). When the pool runs dry it preempts the youngest running sequence:
  its pages go back to the pool and it waits to be recomputed (prompt and tokens, as one more
  prefill), then decodes on exactly where it stopped. A sequence whose end by length is known
  while its last tokens are still in flight (the loop dispatches step t+1 before it reads step
  t's tokens) is not dispatched again (`ends_in_flight`).

The n samples of a request share the pages its prompt fills completely; a partly filled last
page is copied, once per sample beyond the first, since each sample writes its own tokens there.

A sample that names a session keeps its pages when it ends, and its session's next turn
continues from them (serving/core/sessions.py); kept pages are evicted before anything is preempted.
"""

from __future__ import annotations

import collections
import threading

import numpy as np

from serving.core.page_pool import PagePool
from serving.core.sequence import Prefill, Request, Sequence
from serving.core.sessions import Continuation, SessionCache


class Scheduler:
    def __init__(self, *, slots: int, num_pages: int, page_size: int, max_len: int,
                 prefill_chunk: int, prefill_budget: int, prefill_rows=None,
                 longest_first: bool = False):
        """`prefill_rows(n)`: the most chunks a prefill call may hold when its longest has n
        tokens (the engine's compiled shapes); None: no limit."""
        self.pool = PagePool(num_pages, page_size)
        self.max_len = max_len
        self.prefill_chunk = prefill_chunk
        self.prefill_budget = prefill_budget
        self.prefill_rows = prefill_rows or (lambda n: 1 << 30)
        self.longest_first = longest_first
        self.free_slots = collections.deque(range(slots))
        self.num_slots = slots
        self.waiting: collections.deque[Request] = collections.deque()   # guarded by _lock
        self._lock = threading.Lock()
        self._busy = 0          # sequences held by the loop, as it last published them
        self.resumes: collections.deque[Sequence] = collections.deque()   # preempted
        self.prefilling: list[Prefill] = []
        self.running: dict[int, Sequence] = {}                            # slot -> sequence
        self.preemptions = 0
        self.sessions = SessionCache(self.pool)
        self._order = 0

    # -- the queue (any thread) ----------------------------------------------------------------
    def add(self, request: Request, max_queued: int) -> bool:
        """Queues `request`; False when `max_queued` requests already wait."""
        with self._lock:
            if len(self.waiting) >= max_queued:
                return False
            self.waiting.append(request)
            return True

    def queued(self) -> int:
        with self._lock:
            return len(self.waiting)

    def load(self) -> float:
        """Sequences wanting a slot (running, being prefilled, preempted, waiting) per slot: how
        full this engine is, for a dispatcher choosing between engines."""
        with self._lock:
            waiting = sum(r.sampling.n for r in self.waiting)
            return (self._busy + waiting) / self.num_slots

    def publish_load(self) -> None:
        """The loop's side of `load`: what it holds, counted on its own thread."""
        busy = len(self.running) + sum(len(p.slots) for p in self.prefilling) + len(self.resumes)
        with self._lock:
            self._busy = busy

    def take_cancelled(self) -> list[Request]:
        """Removes queued requests whose client went away."""
        with self._lock:
            gone = [r for r in self.waiting if r.stream.cancelled]
            if gone:
                self.waiting = collections.deque(r for r in self.waiting if not r.stream.cancelled)
        for request in gone:
            self._let_go(request)
        return gone

    def take_cancelled_work(self) -> tuple[list[Request], list[Sequence]]:
        """Removes the prefills and the preempted sequences whose client went away, freeing
        their pages and slots: (the prefills' requests, the preempted sequences)."""
        prefills = [p for p in self.prefilling if p.request.stream.cancelled]
        for p in prefills:
            self.prefilling.remove(p)
            self.pool.release(p.pages + p.copy_pages)
            self.free_slots.extend(p.slots)
        resumes = [s for s in self.resumes if s.request.stream.cancelled]
        if resumes:
            self.resumes = collections.deque(s for s in self.resumes
                                             if not s.request.stream.cancelled)
        return ([p.request for p in prefills if p.resumed is None],
                [p.resumed for p in prefills if p.resumed is not None] + resumes)

    def take_waiting(self) -> list[Request]:
        with self._lock:
            out, self.waiting = list(self.waiting), collections.deque()
        for request in out:
            self._let_go(request)
        return out

    def _let_go(self, request: Request) -> None:
        """Returns the pages a queued request took back from its session."""
        if request.continuation is not None:
            self.pool.release(request.continuation.pages)
            request.continuation = None

    # -- prefill -------------------------------------------------------------------------------
    def plan_prefill(self) -> list[tuple[Prefill, int, list[int]]]:
        """(prefill, start, tokens) of each chunk to write in this iteration's prefill call."""
        budget, chunks = self.prefill_budget, []

        def fits(chunk) -> bool:   # one more row still within the call's compiled shapes
            longest = max([len(c[2]) for c in chunks] + [len(chunk[2])])
            return len(chunks) < self.prefill_rows(longest)

        for p in self.prefilling:
            if budget <= 0 or not fits(self._chunk(p)):
                return chunks
            chunks.append(self._chunk(p))
            budget -= len(chunks[-1][2])
        while budget > 0:
            p = self._admit()
            if p is None:
                break
            self.prefilling.append(p)      # a chunk that does not fit goes in the next call
            if not fits(self._chunk(p)):
                break
            chunks.append(self._chunk(p))
            budget -= len(chunks[-1][2])
        return chunks

    def _chunk(self, p: Prefill):
        return p, p.done, p.tokens[p.done: p.done + self.prefill_chunk]

    def _admit(self) -> Prefill | None:
        """The next prefill to start, if its slots and pages are free."""
        watermark = len(self.running)
        while True:
            if self.resumes:
                seq = self.resumes[0]
                tokens = seq.request.prompt + seq.tokens[:-1]
                pages = self.pool.pages_for(len(tokens))
                if not self.free_slots:
                    return None
                self.sessions.evict(pages + watermark)
                if pages + watermark > self.pool.free:
                    return None
                self.resumes.popleft()
                return Prefill(tokens, self.pool.allocate(pages), [self.free_slots.popleft()],
                               seq.request, resumed=seq)
            with self._lock:
                if not self.waiting:
                    return None
                if self.longest_first:
                    request = max(self.waiting, key=lambda r: r.predicted_len or 0.0)
                else:
                    request = self.waiting[0]
                if request.carried:   # its carried samples queue as preempted ones would
                    self.resumes.extend(request.carried)
                    request.carried = []
                    if not request.fresh:
                        self.waiting.remove(request)
                    continue
                n, prompt = len(request.fresh), request.prompt
                if request.session is not None and request.continuation is None:
                    request.continuation = (self.sessions.take(request.session, prompt)
                                            or Continuation([], 0))
                cont = request.continuation or Continuation([], 0)
                pages = self.pool.pages_for(len(prompt)) - len(cont.pages)
                copies = (n - 1) if len(prompt) % self.pool.page_size else 0
                if n > len(self.free_slots):
                    return None
                self.sessions.evict(pages + copies + watermark)
                if pages + copies + watermark > self.pool.free:
                    return None
                self.waiting.remove(request)
                request.continuation = None
            return Prefill(list(prompt), cont.pages + self.pool.allocate(pages),
                           [self.free_slots.popleft() for _ in range(n)], request,
                           copy_pages=self.pool.allocate(copies), done=cont.cached)

    def prefilled(self, p: Prefill, tokens: int) -> bool:
        """`tokens` more of `p` are written; True when it is complete."""
        p.done += tokens
        return p.remaining == 0

    def start(self, p: Prefill) -> tuple[list[Sequence], list[tuple[int, int]]]:
        """A complete prefill's sequences, now running in its slots, and the (source,
        destination) pages to copy before they decode."""
        self.prefilling.remove(p)
        if p.resumed is not None:
            seqs = [p.resumed]
            p.resumed.pages = p.pages
        else:
            seqs = [Sequence(p.request, i) for i in p.request.fresh]
            seqs[0].pages = p.pages
            partial = len(p.tokens) % self.pool.page_size != 0
            full = p.pages[:-1] if partial else p.pages
            for seq, copy in zip(seqs[1:], p.copy_pages or [None] * (len(seqs) - 1)):
                seq.pages = self.pool.share(full) + ([copy] if partial else [])
        copies = [(p.pages[-1], c) for c in p.copy_pages]
        for seq, slot in zip(seqs, p.slots):
            seq.slot = slot
            seq.order = self._order
            self._order += 1
            self.running[slot] = seq
        return seqs, copies

    # -- decode --------------------------------------------------------------------------------
    def plan_decode(self, steps: int, cfg, bucket=None) -> list[list[tuple[int, Sequence]]]:
        """The batches of the next decode dispatch of `steps` steps, as (slot, sequence) rows:
        every running sequence but those ending by length with tokens still in flight
        (`ends_in_flight`), given the pages the steps write (preempting the youngest when the
        pool runs dry), in one batch or two (`decode_groups`, `bucket` its row sizes); [] when
        none is left to run."""
        ready = [(slot, s) for slot, s in sorted(self.running.items())
                 if not ends_in_flight(s, self.max_len)]
        self.reserve(steps, [s for _, s in ready])
        owners = [(slot, s) for slot, s in ready if s.slot is not None]   # none preempted
        return decode_groups(cfg, owners, steps, bucket) if owners else []

    def reserve(self, steps: int, seqs=None) -> list[Sequence]:
        """Pages for `steps` more tokens of the running sequences `seqs` (default: all), oldest
        first; returns the sequences preempted to find them (the youngest running, which may
        be among `seqs`)."""
        preempted = []
        for seq in sorted(self.running.values() if seqs is None else seqs,
                          key=lambda s: s.order):
            if seq.slot is None:
                continue   # preempted earlier in this loop
            need = self.pool.pages_for(min(seq.cached + steps, self.max_len)) - len(seq.pages)
            self.sessions.evict(need)
            while need > self.pool.free and seq.slot is not None:
                victim = max(self.running.values(), key=lambda s: s.order)
                self.preempt(victim)
                preempted.append(victim)
            if seq.slot is not None and need > 0:
                seq.pages += self.pool.allocate(need)
        return preempted

    def trim(self, seq: Sequence, tokens: int | None = None) -> None:
        """Gives back the pages past those `tokens` need (default: `seq`'s cached tokens and
        its next one): a verify step reserved pages for a draft it did not keep."""
        keep = self.pool.pages_for(min(seq.cached + 1 if tokens is None else tokens,
                                       self.max_len))
        if len(seq.pages) > keep:
            self.pool.release(seq.pages[keep:])
            del seq.pages[keep:]

    def preempt(self, seq: Sequence) -> None:
        self._release(seq)
        self.preemptions += 1
        self.resumes.appendleft(seq)   # the oldest preempted resumes first

    def finish(self, seq: Sequence, keep: bool = False) -> None:
        """Frees `seq`'s slot, and its pages unless `keep` and it names a session to keep them
        for (its episode's next turn continues from them)."""
        seq.finished = True
        key = seq.request.keep[seq.index]
        if keep and key is not None:
            held = seq.request.prompt + seq.tokens[:-1]
            self.trim(seq, len(held))   # pages reserved past them (a draft, later steps)
            self.sessions.keep(key, held, seq.pages)
            seq.pages = []
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        self.pool.release(seq.pages)
        seq.pages = []
        del self.running[seq.slot]
        self.free_slots.append(seq.slot)
        seq.slot = None

    def table(self, rows: list[list[int]], width: int) -> np.ndarray:
        """Page tables of `rows` (lists of pages) as an int32 [len(rows), width] array."""
        out = np.zeros((len(rows), width), np.int32)
        for i, pages in enumerate(rows):
            out[i, : min(len(pages), width)] = pages[:width]
        return out

    def longest_running(self) -> int:
        return max((s.cached for s in self.running.values()), default=0)


def ends_in_flight(seq: Sequence, max_len: int) -> bool:
    """`seq` ends by length once the tokens it has in flight are read back: decoding it again
    would only make tokens that are dropped."""
    s, n = seq.request.sampling, len(seq.tokens) + seq.inflight
    return seq.inflight > 0 and (n >= s.max_tokens or len(seq.request.prompt) + n >= max_len)


# A row of a decode batch costs about this many pages of attention in the rest of the model
# (projections, MLP, sampling), and a dispatch about this many row-pages of host overhead.
_ROW_PAGES, _DISPATCH_ROW_PAGES = 4, 16
_SPLIT_GAIN = 0.8     # two batches only when they cost at most this share of one


def decode_groups(cfg, owners: list[tuple[int, Sequence]], k: int, bucket=None
                  ) -> list[list[tuple[int, Sequence]]]:
    """The running (slot, sequence) pairs in one decode batch, or two when that is cheaper: the
    reference attention pads every row to the batch's longest, so in a long tail (many short
    sequences, a few long ones) the short rows go in a batch at their own width. Cost of a batch:
    its rows (bucketed: `bucket(n)`, by default the config's ladder) x (its page-table width +
    _ROW_PAGES), plus a dispatch; two batches when they cost at most _SPLIT_GAIN of one."""
    cached = [seq.cached for _, seq in owners]       # each row's, once
    order = sorted(range(len(owners)), key=cached.__getitem__)
    by_length = [owners[i] for i in order]
    widths = [cfg.table_width(cached[i] + k) for i in order]
    n, bucket, wide = len(by_length), bucket or cfg.row_bucket, widths[-1] + _ROW_PAGES
    # cost(rows, width) = bucket(rows) * (width + _ROW_PAGES) + _DISPATCH_ROW_PAGES
    best = _SPLIT_GAIN * (bucket(n) * wide + _DISPATCH_ROW_PAGES)   # split only for a clear gain
    split = None
    for i in range(n - 1, 0, -1):   # on a tie, the fewest rows at the wide width
        c = bucket(i) * (widths[i - 1] + _ROW_PAGES) + bucket(n - i) * wide
        if c + 2 * _DISPATCH_ROW_PAGES < best:
            best, split = c + 2 * _DISPATCH_ROW_PAGES, i
    return [by_length] if split is None else [by_length[:split], by_length[split:]]
