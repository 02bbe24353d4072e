"""The loop that owns the device: one thread runs `EngineLoop.run`, and only it touches the
engine's decode state, the scheduler's running sequences and the served weights.

Each iteration it
1. swaps in a pending weight update (between two decode dispatches; every page is kept),
2. has the scheduler plan a prefill call (chunks of prompts being prefilled, new admissions,
   preempted sequences recomputed) and runs it; each prompt that completes is forked into its
   n samples, whose first tokens are drawn and which take their slots,
3. has the scheduler give every running sequence the pages of the next `steps_per_dispatch`
   tokens (preempting the youngest when the pool runs dry) and dispatches the decode steps;
   while the device runs them, it reads back the previous dispatch's tokens and appends each
   to its sequence and its request's stream, applying the stop rules (EOS, stop tokens,
   max_tokens, max_len, client gone). A finished sequence's pages and slot are free for the
   next iteration. Step t+1 is dispatched before step t's tokens are read (they stay in the
   device's decode state, which the next step feeds: vLLM's and SGLang's overlapped
   scheduling), so a sequence is decoded once past an end the host learns one step late (EOS,
   a stop token, its grammar complete), and that token is dropped.

A decode step passes through five files before the model's forward, in the order a reader
follows it (nano-vllm's LLMEngine -> Scheduler -> BlockManager -> ModelRunner -> model):

    serving/core/engine_loop.py   this loop: plans, dispatches, reads back, applies stop rules
    serving/core/scheduler.py     the batch: which sequences run, in one batch or two
    serving/core/page_pool.py     their pages (nano-vllm's BlockManager)
    serving/runner/engine.py      the model runner: pads the batch and calls its program (the
                                  executable programs.py compiled for that shape at start)
    serving/runner/steps.py       what the program computes: the model's forward
                                  (`Transformer.extend` over serving/runner/paged_kv.py, which
                                  reads and writes the pages and chooses the attention kernel),
                                  then sampling.py's draw

tests/test_layering.py holds this list to the imports it describes.

Other threads reach it only through its methods, each of which wakes it: `notify` (new work
in the scheduler), `post_update` (weights to swap in), `post_score` (tokens to score),
`end_session` (pages to forget), `request_stop`, and `hold` / `release` (partial rollouts).
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import threading
import time
from functools import partial

import numpy as np

from serving.core.inbox import Score, Update
from serving.core.length_predictor import LengthPredictor
from serving.core.scheduler import Scheduler
from serving.core.sequence import Prefill, Request, Sequence, stop_reason
from serving.core.speculation import Speculator
from serving.core.stream import FINISHED, DoneEvent, Speculated, TokenEvent
from serving.runner.constraints import Grammars
from serving.runner.engine import Decoded, Engine, SlotBatch


@dataclasses.dataclass
class InFlight:
    """Decode batches dispatched and not yet read back: each batch's (slot, sequence) rows and
    its outputs on the device, the steps each ran, the weights version that ran them, and the
    tokens their rows attended over (k x the sum of their cached lengths)."""
    batches: list[tuple[list[tuple[int, Sequence]], Decoded]]
    steps: int
    version: int
    held_tokens: int


class EngineLoop:
    def __init__(self, engine: Engine, params, version: int, scheduler: Scheduler,
                 eos_id: int | None, length_predictor: LengthPredictor | None,
                 grammars: Grammars | None = None, speculator: Speculator | None = None):
        self.engine, self.scheduler = engine, scheduler
        self.params, self.version = params, version
        self.eos_id, self.length_predictor = eos_id, length_predictor
        self.grammars, self.speculator = grammars, speculator
        # the inbox
        self.wake, self.stop = threading.Event(), threading.Event()
        self._updates: queue.SimpleQueue[Update] = queue.SimpleQueue()
        self._ended: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._scores: queue.SimpleQueue[Score] = queue.SimpleQueue()
        self._hold = threading.Event()      # set: dispatch nothing until release()
        self.held = threading.Event()       # set by the loop once it honours the hold
        self._hold_until: float | None = None   # monotonic time a leased hold ends by itself
        self._hold_lock = threading.Lock()
        # what it reports
        self.pauses_s: list[float] = []
        self.error: BaseException | None = None
        self._stats = collections.Counter()
        self._stats_lock = threading.Lock()
        self._inflight: InFlight | None = None     # the decode dispatch not read back yet
        # closing: the loop's end takes every request queued before it, refuses later ones
        self.admit_lock = threading.Lock()
        self.closed = False

    # -- what other threads ask of it (each wakes it) ------------------------------------------
    def notify(self) -> None:
        """New work is in the scheduler's queue."""
        self.wake.set()

    def post_update(self, update: Update) -> None:
        """Weights to swap in between two steps (`update.applied` is set once they serve)."""
        self._updates.put(update)
        self.wake.set()

    def post_score(self, job: Score) -> None:
        """Tokens to score between two steps (`job.done` is set with its result)."""
        self._scores.put(job)
        self.wake.set()

    def end_session(self, key: str) -> None:
        """The episode `key` has ended: its kept pages go back to the pool."""
        self._ended.put(key)
        self.wake.set()

    def request_stop(self) -> None:
        """End the loop after its current call (every unfinished request ends "shutdown")."""
        self.stop.set()
        self.wake.set()

    def hold(self, lease_s: float | None = None) -> None:
        """Dispatch nothing until `release`, or for at most `lease_s` seconds (a remote
        trainer that paused the engine and died does not leave it paused for good)."""
        with self._hold_lock:
            self._hold_until = None if lease_s is None else time.monotonic() + lease_s
            self._hold.set()
        self.wake.set()

    def release(self) -> None:
        with self._hold_lock:
            self._hold.clear()
            self.held.clear()
            self._hold_until = None
        self.wake.set()

    def paused(self) -> bool:
        """Held (by `hold`, its lease not run out)."""
        with self._hold_lock:
            return self._hold.is_set() and not self._lease_over()

    def _lease_over(self) -> bool:
        """The hold's lease has run out (under _hold_lock)."""
        return self._hold_until is not None and time.monotonic() > self._hold_until

    def stats(self) -> collections.Counter:
        with self._stats_lock:
            return collections.Counter(self._stats)

    def stop_reason(self, seq: Sequence) -> str | None:
        return stop_reason(seq, self.eos_id, self.engine.cfg.max_len)

    def run(self) -> None:
        """The thread's body: until `stop`, or an error (which fails every request)."""
        try:
            state = self.engine.init_decode_state()
            if self.speculator is not None and not self.speculator.costs:
                state = self.speculator.measure(self.engine, self.params, state)
            while not self.stop.is_set():
                self.wake.clear()
                self._apply_updates()
                while not self._ended.empty():
                    self.scheduler.sessions.drop(self._ended.get())
                self._end_cancelled()
                if self._holding():
                    self.wake.wait(0.05)
                    continue
                self._score()
                state, prefilled = self._prefill(state)
                state, decoded = self._decode(state)
                self.scheduler.publish_load()
                if not (prefilled or decoded):
                    self.wake.wait(0.05)
        except BaseException as e:  # a bug: fail every request loudly instead of hanging them
            self.error = e
            self.shutdown("error")
            raise
        self._collect()         # the tokens of the last dispatch reach their streams
        self.shutdown("shutdown")

    def _end_cancelled(self) -> None:
        """Ends what the clients let go of, queued or running (also while held: a paused
        engine's cancelled groups end, and may continue elsewhere)."""
        sched = self.scheduler
        prefills, resumes = sched.take_cancelled_work()
        for request in sched.take_cancelled() + prefills:
            self._finish_request(request, "cancelled")
        for seq in resumes:
            seq.finished = True
            self._done(seq.request, seq.index, "cancelled")
        for seq in list(sched.running.values()):
            if seq.request.stream.cancelled:
                self._finish(seq, "cancelled")

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            self._stats.update(deltas)

    def _holding(self) -> bool:
        if self._hold.is_set():
            self._collect()     # a hold starts with every token dispatched read back
        with self._hold_lock:
            if self._hold.is_set() and self._lease_over():
                self._hold.clear()
                self.held.clear()
                self._hold_until = None
                self._count(hold_leases_expired=1)
            if self._hold.is_set():
                self.held.set()
                self._count(held_iterations=1)     # a turn of the loop that ran nothing
                return True
            return False

    def _apply_updates(self) -> None:
        while not self._updates.empty():
            update = self._updates.get()
            t0 = time.perf_counter()
            # The old weights are released by the caller's thread (update_params), not here:
            # freeing a model's buffers takes time that grows with its size, and decoding would
            # wait for it.
            update.retired = self.params
            params = update.params
            if update.adapters:         # the base stays; only the adapters' leaves change
                params = {**self.params, "layers": {**self.params["layers"],
                                                    **params["layers"]}}
            self.params, self.version = params, update.version
            update.pause_s = time.perf_counter() - t0
            update.params = None
            self.pauses_s.append(update.pause_s)
            update.applied.set()

    def _score(self) -> None:
        """Scores what is queued, with the weights serving now (its programs compiled at
        start: a few ms against a decode step's, at most one call per request)."""
        while not self._scores.empty():
            job = self._scores.get()
            try:
                job.result = self.engine.score(self.params, job.tokens, job.adapter)
            except ValueError as e:       # a bad request, said to its caller
                job.error = e
            job.done.set()

    def _prefill(self, state):
        """Runs this iteration's prefill call; starts the sequences of completed prompts."""
        chunks = self.scheduler.plan_prefill()
        if not chunks:
            return state, False
        engine, sched = self.engine, self.scheduler
        width = engine.cfg.prefill_width(max(start + len(t) for _, start, t in chunks))
        tokens = np.zeros((len(chunks), engine.bucket(max(len(t) for _, _, t in chunks))),
                          np.int32)
        for i, (_, _, t) in enumerate(chunks):
            tokens[i, : len(t)] = t
        state, logits, *routes = engine.prefill(
            self.params, state, tokens, [start for _, start, _ in chunks],
            [len(t) for _, _, t in chunks], sched.table([p.pages for p, _, _ in chunks], width),
            [p.request.sampling.adapter for p, _, _ in chunks])
        if routes:
            self._record_routes(chunks, routes[0])
        self._count(prefill_chunks=1, prefill_tokens=sum(len(t) for _, _, t in chunks))
        complete = [(row, p) for row, (p, _, t) in enumerate(chunks)
                    if sched.prefilled(p, len(t))]
        if complete:
            state = self._start(state, complete, logits)
        return state, True

    @staticmethod
    def _record_routes(chunks, routes_PTLK) -> None:
        """Appends each prefill chunk's routing to its prefill (record_routes)."""
        unknown = np.full(routes_PTLK.shape[2:], -1, np.int32)
        for row, (p, start, t) in enumerate(chunks):
            # Tokens a continued session's kept pages hold were routed in an earlier turn.
            p.routes += [unknown] * (start - len(p.routes)) + list(routes_PTLK[row, : len(t)])

    def _start(self, state, complete: list[tuple[int, Prefill]], logits):
        """Forks completed prompts into their sequences, draws new requests' first tokens, and
        puts every sequence still running into its slot."""
        engine, sched = self.engine, self.scheduler
        started, copies, fresh = [], [], []
        for row, p in complete:
            seqs, page_copies = sched.start(p)
            copies += page_copies
            started += seqs
            for seq in seqs:     # routing recorded before a preemption is kept
                seq.routes += p.routes[len(seq.routes):]
            if p.resumed is None:
                fresh += [(row, seq) for seq in seqs]
        if copies:
            state = engine.copy_pages(state, *zip(*copies))
        if fresh:
            tokens, logprobs = engine.sample_first(
                logits, [row for row, _ in fresh], [s.request.sampling for _, s in fresh],
                [s.index for _, s in fresh], self.eos_id, self._masks([s for _, s in fresh]))
            self._count(tokens=sum(
                self._push(seq, token, logprob, self.version) for (_, seq), token, logprob
                in zip(fresh, np.asarray(tokens).tolist(), np.asarray(logprobs).tolist())))
        live = [s for s in started if not s.finished]
        if live:
            state = engine.insert(state, SlotBatch.of(live), self.eos_id)
        return state

    def _decode(self, state):
        """Dispatches `steps_per_dispatch` decode steps for every running sequence not ending
        by length, then reads back the previous dispatch's tokens while these run. False when
        there was nothing to do."""
        engine, sched = self.engine, self.scheduler
        t0 = time.perf_counter()
        if self._constrained():
            self._collect()     # a grammar's next mask follows the token before it
        elif (length := self._speculating()) and (done := self._speculate(state, length)):
            return done
        k = engine.cfg.steps_per_dispatch
        groups = sched.plan_decode(k, engine.cfg, partial(engine.programs.rows_now, "decode"))
        if not groups:
            return state, self._collect()
        batches = []
        for group in groups:
            state, decoded = self._dispatch(state, group, k)
            batches.append((group, decoded))
        owners = [row for group in groups for row in group]
        held = k * sum(s.cached for _, s in owners)
        for _, seq in owners:
            seq.inflight += k
        overlapped = self._collect()
        self._inflight = InFlight(batches, k, self.version, held)
        if self.speculator is not None and overlapped:   # (speculation.py: what is timed)
            self.speculator.timed(Speculator.DECODE, self._rows(), time.perf_counter() - t0,
                                  k * len(owners))
        return state, True

    def _rows(self) -> int:
        """The row bucket of a batch of every running sequence (the load rule's key)."""
        return self.engine.programs.rows_now("verify", len(self.scheduler.running))

    def _speculating(self) -> int:
        """The draft length this dispatch verifies at, 0 for none (serving/core/speculation.py's
        load rule)."""
        if self.speculator is None or not self.scheduler.running:
            return 0
        return self.speculator.wanted(self._rows())

    def _speculate(self, state, k: int):
        """One verify step for every running sequence at draft length `k` (serving/runner/
        speculate.py), or None when no sequence has a draft (the plain decode step then runs).
        Drafts continue the tokens read back, so nothing is in flight before or after it; each
        row keeps from 1 to k+1 tokens, and the pages past what it keeps go back to the pool."""
        engine, sched, spec = self.engine, self.scheduler, self.speculator
        self._collect()
        t0, rows = time.perf_counter(), self._rows()
        drafts = {id(seq): spec.draft(seq, engine.cfg.max_len, k)
                  for seq in sched.running.values()}
        if not any(drafts.values()):
            spec.stepped(k, [1])
            return None
        pushed = 0
        groups = sched.plan_decode(k + 1, engine.cfg, partial(engine.programs.rows_now, "verify"))
        held = sum(s.cached for group in groups for _, s in group)
        for owners in groups:
            width = engine.cfg.table_width(max(s.cached for _, s in owners) + k + 1)
            state, tokens, logprobs = engine.verify(
                self.params, state, sched.table([s.pages for _, s in owners], width),
                [slot for slot, _ in owners], [drafts[id(s)] for _, s in owners], k)
            spec.stepped(k, [len(kept) for kept in tokens])
            for (_, seq), kept, kept_logprobs in zip(owners, tokens, logprobs):
                if drafts[id(seq)]:
                    spec.record(len(drafts[id(seq)]), len(kept))
                    seq.verify_steps += 1
                    seq.draft_tokens += len(drafts[id(seq)])
                    seq.accepted_tokens += len(kept) - 1
                for token, logprob in zip(kept, kept_logprobs):
                    if seq.finished:
                        break
                    pushed += self._push(seq, token, logprob, self.version)
                if not seq.finished:
                    sched.trim(seq)
        self._count(steps=len(groups), busy_slot_steps=sum(map(len, groups)),
                    verify_steps=len(groups), tokens=pushed, held_tokens=held)
        spec.timed(k, rows, time.perf_counter() - t0, sum(map(len, groups)))
        return state, bool(groups)

    def _constrained(self) -> bool:
        return self.grammars is not None and any(
            s.request.sampling.grammar is not None for s in self.scheduler.running.values())

    def _dispatch(self, state, owners: list[tuple[int, Sequence]], k: int):
        """Dispatches the decode steps of the slots of `owners` (gathered into a batch of their
        own) at the page-table width of the longest of them: (state, Decoded)."""
        engine = self.engine
        width = engine.cfg.table_width(max(s.cached for _, s in owners) + k)
        return engine.dispatch_steps(
            self.params, state, self.scheduler.table([s.pages for _, s in owners], width), k,
            slots=[slot for slot, _ in owners], allowed=self._masks([s for _, s in owners]))

    def _collect(self) -> bool:
        """Reads back the dispatch in flight, if any, and appends its tokens to their sequences
        and streams (a sequence that ended meanwhile drops its own); whether there was one."""
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return False
        k, version, pushed, rows = inflight.steps, inflight.version, 0, 0
        for owners, decoded in inflight.batches:
            tokens, logprobs, *routes = decoded.fetch()
            tokens, logprobs = tokens.tolist(), logprobs.tolist()
            rows += len(owners)
            for _, seq in owners:
                seq.inflight -= k
            for step, (step_tokens, step_logprobs) in enumerate(zip(tokens, logprobs)):
                for row, (_, seq) in enumerate(owners):
                    if not seq.finished:
                        if routes:       # the routing of the token this step fed
                            seq.routes.append(routes[0][step, row])
                        pushed += self._push(seq, step_tokens[row], step_logprobs[row],
                                             version)
        self._count(steps=k * len(inflight.batches), busy_slot_steps=k * rows,
                    held_tokens=inflight.held_tokens, tokens=pushed)
        return True

    def _masks(self, seqs: list[Sequence]):
        """The rows' token bitmasks, or None when no row has a grammar (nothing is sent)."""
        return None if self.grammars is None else self.grammars.masks(seqs)

    def _push(self, seq: Sequence, token: int, logprob: float, version: int) -> int:
        """Appends one token to `seq` and its stream, then applies the stop rules; the tokens
        it appended (0: the client had cancelled)."""
        req = seq.request
        if req.stream.cancelled:
            self._finish(seq, "cancelled")
            return 0
        seq.tokens.append(token)
        seq.logprobs.append(logprob)
        seq.versions.append(version)
        if self.speculator is not None:
            self.speculator.drafter.observe(seq, token)
        req.stream.put(TokenEvent(seq.index, token, logprob, version))
        reason = self.stop_reason(seq)
        if seq.matcher is not None and reason is None and (
                not seq.matcher.consume_token(token) or seq.matcher.is_stopped()):
            reason = "stop"          # the grammar is complete (or, a bug, broken): end here
        if reason is not None:
            self._finish(seq, reason)
        return 1

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.slot is not None:
            self.scheduler.finish(seq, keep=reason in ("eos", "stop", "length"))
        elif seq in self.scheduler.resumes:    # preempted while its last tokens were in flight
            self.scheduler.resumes.remove(seq)
        seq.finished = True
        if self.speculator is not None:
            self.speculator.drafter.finished(seq)
        seq.request.longest = max(seq.request.longest, len(seq.tokens))
        speculated = Speculated(seq.verify_steps, seq.draft_tokens, seq.accepted_tokens) \
            if seq.verify_steps else None
        self._done(seq.request, seq.index, reason,
                   np.stack(seq.routes) if seq.routes and reason in FINISHED else None,
                   speculated)

    def _done(self, req: Request, index: int, reason: str, routes=None,
              speculated: Speculated | None = None) -> None:
        if req.done[index]:
            return
        req.done[index] = True
        req.stream.put(DoneEvent(index, reason, routes, speculated))
        if all(req.done):
            self._count(requests_done=1)
            if self.length_predictor is not None and reason in ("eos", "stop", "length"):
                # A group takes as long as its longest sample.
                self.length_predictor.update(req.prompt, req.longest)

    def _finish_request(self, req: Request, reason: str) -> None:
        for i in range(req.sampling.n):
            self._done(req, i, reason)

    def shutdown(self, reason: str) -> None:
        """Ends every request not yet finished: queued, being prefilled, preempted, running;
        and refuses every new one."""
        sched = self.scheduler
        with self.admit_lock:
            self.closed = True
        for req in sched.take_waiting():
            self._finish_request(req, reason)
        for p in list(sched.prefilling):
            self._finish_request(p.request, reason)
        for seq in list(sched.resumes) + list(sched.running.values()):
            self._done(seq.request, seq.index, reason)
        while not self._scores.empty():
            job = self._scores.get()
            job.error = RuntimeError(f"the engine loop ended ({reason})")
            job.done.set()
