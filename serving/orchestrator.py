"""Continuous batching around an Engine over a paged KV pool, with in-flight weight updates.

One loop thread owns the device. Each iteration it
1. swaps in a pending weight update (between two decode dispatches; every page is kept),
2. has the scheduler plan a prefill call (chunks of prompts being prefilled, new admissions,
   preempted sequences recomputed) and runs it; each prompt that completes is forked into its
   n samples, whose first tokens are drawn and which take their slots,
3. has the scheduler give every running sequence the pages of the next `steps_per_dispatch`
   tokens (preempting the youngest when the pool runs dry), runs the decode steps, and appends
   each token to its sequence and its request's stream, applying the stop rules (EOS, stop
   tokens, max_tokens, max_len, client gone). A finished sequence's pages and slot are free for
   the next iteration.

Every token is tagged with its log-probability and the version of the weights that produced it.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import queue
import threading
import time
from typing import Sequence as Seq

import numpy as np

from jaxrl.errors import UserError
from serving import threads
from serving.engine import Engine
from serving.length_predictor import LengthPredictor
from serving.programs import process_compiles
from serving.sampling import SamplingParams
from serving.scheduler import Scheduler
from serving.sequence import Prefill, Request, Sequence
from serving.stream import DoneEvent, RequestStream, Sample, TokenEvent
from serving.weight_stream import StaleVersion

__all__ = ["DoneEvent", "EngineStopped", "InvalidRequest", "Orchestrator", "QueueFull",
           "RequestStream", "Sample", "TokenEvent", "UpdateResult"]


class InvalidRequest(UserError):
    """A request the engine cannot serve; the message says what is wrong."""


class QueueFull(Exception):
    """Backpressure: the request queue is at its limit; retry later."""


class EngineStopped(RuntimeError):
    """The engine loop is not running (stopped, or ended by an error): nothing more will be
    served (gRPC UNAVAILABLE, HTTP 503)."""


@dataclasses.dataclass
class _Update:
    params: object
    version: int
    applied: threading.Event = dataclasses.field(default_factory=threading.Event)
    pause_s: float = 0.0
    retired: object = None      # the weights it replaced, freed off the decode path


@dataclasses.dataclass(frozen=True)
class UpdateResult:
    version: int
    transfer_s: float   # checks + device-to-device copy + cast, done beside decoding
    pause_s: float      # time decoding was held to swap the weights in


class Orchestrator:
    def __init__(self, engine: Engine, params, *, version: int = 0, eos_id: int | None = None,
                 max_queued: int = 1024, longest_first: bool = False):
        """Serves `engine` with the weights `params` (any placement: they are checked and
        placed on the engine's mesh here), numbered `version`; it owns them from now on and
        `update_params` replaces them.
        `longest_first`: admit the requests predicted to generate the most tokens first
        (StreamRL), by the caller's `predicted_len` or else a LengthPredictor that learns from
        every finished request; otherwise first come, first served."""
        self.engine = engine
        self.params = engine.prepare_params(params)
        self.version = version
        self.eos_id = eos_id
        self.vocab_size = engine.model_cfg.vocab_size
        e = engine.cfg
        self.scheduler = Scheduler(slots=e.max_concurrent_decodes, num_pages=engine.num_pages,
                                   page_size=e.page_size, max_len=e.max_len,
                                   prefill_chunk=e.prefill_chunk,
                                   prefill_budget=e.prefill_budget,
                                   prefill_rows=lambda n: e.prefill_rows(e.bucket(n)),
                                   longest_first=longest_first)
        self._max_queued = max_queued
        self.length_predictor = LengthPredictor() if longest_first else None
        self._wake = threading.Event()
        self._updates: queue.SimpleQueue[_Update] = queue.SimpleQueue()
        self._update_lock = threading.Lock()     # one update checked and queued at a time
        self._accepted_version = version         # the newest version queued or served
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._hold = threading.Event()      # set: dispatch nothing until resume()
        self._held = threading.Event()      # set by the loop once it honours the hold
        self._hold_lock = threading.Lock()
        self._stats = collections.Counter()     # written by the loop, read by metrics()
        self._stats_lock = threading.Lock()
        self._closed = False                    # no request is taken once the loop has ended
        self._admit_lock = threading.Lock()
        self._carried_tokens = 0            # tokens replayed from `carry`, never regenerated
        self._carry_lock = threading.Lock()
        self._ended: queue.SimpleQueue[str] = queue.SimpleQueue()   # sessions to forget
        self.pauses_s: list[float] = []
        self.error: BaseException | None = None

    # -- public --------------------------------------------------------------------------------
    def start(self) -> "Orchestrator":
        """Compiles every program the engine can run (on this thread; nothing when an engine
        of the same shapes did), then starts the loop: no request ever waits for a compile."""
        if self._thread is not None:
            raise RuntimeError("this orchestrator was started already")
        t0 = time.perf_counter()
        self.compiled_at_start = self.engine.compile()
        self.compile_s = time.perf_counter() - t0
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Ends the loop (every request not finished ends with reason "shutdown") and returns
        once its thread has ended; raises TimeoutError naming it if it has not in `timeout`."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            threads.join(self._thread, timeout)
        else:
            self._shutdown("shutdown")

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _stopped_error(self) -> EngineStopped:
        why = f": {type(self.error).__name__}: {self.error}" if self.error else ""
        return EngineStopped(f"the engine loop has stopped{why}")

    def pause(self, timeout: float = 60.0) -> None:
        """Stops dispatching prefill and decode calls between two of them and returns once the
        device is free (partial rollouts: the trainer gets it for a step). Every sequence keeps
        its tokens, slot and pages; weight updates, cancellations and new requests are still
        taken, and `resume` continues decoding exactly where it stopped."""
        self._hold.set()
        self._wake.set()
        deadline = time.monotonic() + timeout
        while not self._held.wait(0.05):
            if self._thread is None or not self._thread.is_alive():
                return                      # a stopped loop dispatches nothing
            if time.monotonic() > deadline:
                raise TimeoutError(f"the engine loop did not pause within {timeout} s")

    def resume(self) -> None:
        with self._hold_lock:
            self._hold.clear()
            self._held.clear()
        self._wake.set()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def validate(self, prompt: Seq[int], sampling: SamplingParams,
                 session: str | Seq[str] | None = None) -> None:
        e, pool = self.engine.cfg, self.scheduler.pool
        if isinstance(session, str):
            if sampling.n != 1:
                raise InvalidRequest(f"a turn of session {session!r} must have n=1, not "
                                     f"n={sampling.n} (start n episodes with one session each)")
        elif session is not None and (len(session) != sampling.n or len(set(session)) != len(
                session) or not all(isinstance(k, str) for k in session)):
            raise InvalidRequest(f"sessions {list(session)!r}: a group's first turn names "
                                 f"n={sampling.n} distinct sessions, one per sample")
        if len(prompt) == 0:
            raise InvalidRequest("prompt is empty")
        if len(prompt) > e.max_prefill_length:
            raise InvalidRequest(f"prompt has {len(prompt)} tokens; the limit is "
                                 f"{e.max_prefill_length}")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary "
                                 f"[0, {self.vocab_size})")
        room = e.max_len - len(prompt)
        if sampling.max_tokens > room:
            raise InvalidRequest(f"max_tokens={sampling.max_tokens} is over the limit: a "
                                 f"{len(prompt)}-token prompt leaves room for {room}")
        if sampling.n > e.max_concurrent_decodes:
            raise InvalidRequest(f"n={sampling.n} exceeds the {e.max_concurrent_decodes} slots")
        pages = pool.pages_for(len(prompt)) + (sampling.n - 1) * (len(prompt) % e.page_size > 0)
        longest = pool.pages_for(len(prompt) + sampling.max_tokens)
        if max(pages, longest) > pool.capacity:
            raise InvalidRequest(f"the request needs {max(pages, longest)} KV pages of "
                                 f"{e.page_size} tokens at once; the pool has {pool.capacity}")

    def submit(self, prompt: Seq[int], sampling: SamplingParams = SamplingParams(), *,
               predicted_len: float | None = None, carry: Seq[Sample] | None = None,
               session: str | Seq[str] | None = None) -> RequestStream:
        """Queues a request; raises InvalidRequest or QueueFull at once rather than later.
        `predicted_len`: its expected output length, for length-aware admission.
        `session`: one turn of a multi-turn episode (n=1): the prompt (the episode's whole
        history) continues from the pages the session's previous turn kept, and this turn's
        pages are kept for the next (serving/sessions.py). A list of n keys: a group's first
        turn, each sample's pages kept for its own session. `end_session` frees them.
        `carry`: the request's n samples as a previous run left them (`RequestStream.snapshot`
        taken at a checkpoint): their tokens, log-probs and versions are replayed into the new
        stream and each unfinished sample is recomputed from its prefix (one prefill, as after a
        preemption) and decoded on from where it stopped, with the same random draws."""
        prompt = [int(t) for t in prompt]
        self.validate(prompt, sampling, session)
        carried = self._carried(prompt, sampling, carry) if carry is not None else None
        stream = RequestStream(next(self._ids), sampling.n)
        if predicted_len is None and self.length_predictor is not None:
            predicted_len = self.length_predictor.predict(prompt)
        request = Request(prompt, sampling, stream, predicted_len)
        if isinstance(session, str):
            request.session, request.keep = session, [session]
        elif session is not None:
            request.keep = list(session)
        if carried is not None:
            request.fresh = [i for i, seq in enumerate(carried) if seq is None]
            request.carried = [seq for seq in carried if seq is not None]
            for seq in request.carried:
                seq.request = request
                for event in zip(seq.tokens, seq.logprobs, seq.versions):
                    stream.put(TokenEvent(seq.index, *event))
                reason = self._stop_reason(seq)
                if reason is not None:     # it had finished (the request is not shared yet)
                    seq.finished, request.done[seq.index] = True, True
                    stream.put(DoneEvent(seq.index, reason))
            request.carried = [seq for seq in request.carried if not seq.finished]
            with self._carry_lock:
                self._carried_tokens += sum(len(seq.tokens) for seq in carried if seq)
            if not request.fresh and not request.carried:
                return stream              # every sample had finished
        with self._admit_lock:        # the loop's end takes every request queued before it
            if self._closed or self._stop.is_set():
                raise self._stopped_error()
            if not self.scheduler.add(request, self._max_queued):
                raise QueueFull(f"{self.scheduler.queued()} requests are queued (max_queued="
                                f"{self._max_queued})")
        self._wake.set()
        return stream

    def _carried(self, prompt, sampling: SamplingParams, carry: Seq[Sample]
                 ) -> list[Sequence | None]:
        """Checks a carried request's samples; None for a sample with no token yet."""
        if len(carry) != sampling.n:
            raise InvalidRequest(f"carry holds {len(carry)} samples; the request has "
                                 f"n={sampling.n}")
        out = []
        for i, s in enumerate(carry):
            if not len(s.tokens) == len(s.logprobs) == len(s.versions):
                raise InvalidRequest(f"carried sample {i} has {len(s.tokens)} tokens, "
                                     f"{len(s.logprobs)} log-probs and {len(s.versions)} "
                                     f"versions; they must match")
            if len(s.tokens) > sampling.max_tokens:
                raise InvalidRequest(f"carried sample {i} has {len(s.tokens)} tokens; "
                                     f"max_tokens={sampling.max_tokens}")
            bad = [t for t in s.tokens if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequest(f"carried sample {i}: token id {bad[0]} is outside the "
                                     f"vocabulary [0, {self.vocab_size})")
            out.append(Sequence(None, i, [int(t) for t in s.tokens],
                                [float(x) for x in s.logprobs], [int(v) for v in s.versions])
                       if s.tokens else None)
        return out

    def generate(self, prompt: Seq[int], sampling: SamplingParams = SamplingParams()
                 ) -> list[Sample]:
        return self.submit(prompt, sampling).result()

    def end_session(self, key: str) -> None:
        """The episode `key` has ended: the pages kept for its next turn go back to the pool."""
        self._ended.put(key)
        self._wake.set()

    @property
    def newest_version(self) -> int:
        """The newest weights version served or accepted to be: an update must be newer."""
        return self._accepted_version

    def update_params(self, params, version: int, timeout: float | None = None, *,
                      resume: bool = False) -> UpdateResult:
        """Checks and moves `params` to the engine (in this thread, beside decoding), then has
        the loop swap them in between two decode steps. Raises WeightUpdateError, leaving the
        old weights serving, if the update is bad, and StaleVersion if `version` is not newer
        than every version served or accepted before it (versions never go back), unless
        `resume`: a trainer resumed from a checkpoint restarts the sequence at its version."""
        if self._thread is None:
            raise RuntimeError("the orchestrator is not running: call start() first")
        if not self._thread.is_alive():
            raise self._stopped_error()
        with self._update_lock:
            if version <= self.newest_version and not resume:
                raise StaleVersion(f"weight update version {version} is not newer than the "
                                   f"served version {self.newest_version}")
            t0 = time.perf_counter()
            prepared = self.engine.prepare_params(params)
            transfer = time.perf_counter() - t0
            update = _Update(prepared, version)
            self._accepted_version = version
            self._updates.put(update)
        self._wake.set()
        deadline = None if timeout is None else time.monotonic() + timeout
        while not update.applied.wait(0.05):
            if not self._thread.is_alive():
                raise self._stopped_error()
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"weight update {version} not applied within {timeout} s")
        update.retired = None       # the replaced weights are freed here, beside decoding
        return UpdateResult(version, transfer, update.pause_s)

    def metrics(self) -> dict:
        with self._stats_lock:
            s = collections.Counter(self._stats)
        sched = self.scheduler
        steps = max(s["steps"], 1)
        pauses = self.pauses_s or [0.0]
        return {"version": self.version, "slots": sched.num_slots,
                "max_len": self.engine.cfg.max_len, "max_prefill_length":
                self.engine.cfg.max_prefill_length, "vocab_size": self.vocab_size,
                "eos_id": self.eos_id, "steps": s["steps"],
                "busy_slot_steps": s["busy_slot_steps"],
                "generated_tokens": s["tokens"], "requests_done": s["requests_done"],
                "prefill_chunks": s["prefill_chunks"], "prefill_tokens": s["prefill_tokens"],
                "queued": sched.queued(),
                "slots_busy_fraction": s["busy_slot_steps"] / (steps * sched.num_slots),
                "pages_total": sched.pool.capacity, "pages_free": sched.pool.free,
                "held_tokens": s["held_tokens"],
                "held_tokens_mean": s["held_tokens"] / max(s["busy_slot_steps"], 1),
                "preemptions": sched.preemptions,
                "sessions_kept": len(sched.sessions),
                "session_evictions": sched.sessions.evictions,
                "prefix_reused_tokens": sched.sessions.reused_tokens,
                "carried_tokens": self._carried_tokens,
                "updates": len(self.pauses_s), "update_pause_ms_max": 1e3 * max(pauses),
                "update_pause_ms_mean": 1e3 * sum(pauses) / len(pauses),
                "programs": self.engine.programs.compiled,
                "process_compiles": process_compiles(),
                "late_compiles": self.engine.programs.late_compiles}

    # -- engine loop ---------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            state = self.engine.init_decode_state()
            while not self._stop.is_set():
                self._wake.clear()
                self._apply_updates()
                while not self._ended.empty():
                    self.scheduler.sessions.drop(self._ended.get())
                for request in self.scheduler.take_cancelled():
                    self._finish_request(request, "cancelled")
                if self._holding():
                    self._wake.wait(0.05)
                    continue
                state, prefilled = self._prefill(state)
                state, decoded = self._decode(state)
                self.scheduler.publish_load()
                if not (prefilled or decoded):
                    self._wake.wait(0.05)
        except BaseException as e:  # a bug: fail every request loudly instead of hanging them
            self.error = e
            self._shutdown("error")
            raise
        self._shutdown("shutdown")

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            self._stats.update(deltas)

    def _holding(self) -> bool:
        with self._hold_lock:
            if self._hold.is_set():
                self._held.set()
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
            self.params, self.version = update.params, update.version
            update.pause_s = time.perf_counter() - t0
            update.params = None
            self.pauses_s.append(update.pause_s)
            update.applied.set()

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
        state, logits = engine.prefill(self.params, state, tokens,
                                       [start for _, start, _ in chunks],
                                       [len(t) for _, _, t in chunks],
                                       sched.table([p.pages for p, _, _ in chunks], width))
        self._count(prefill_chunks=1, prefill_tokens=sum(len(t) for _, _, t in chunks))
        complete = [(row, p) for row, (p, _, t) in enumerate(chunks)
                    if sched.prefilled(p, len(t))]
        if complete:
            state = self._start(state, complete, logits)
        return state, True

    def _start(self, state, complete: list[tuple[int, Prefill]], logits):
        """Forks completed prompts into their sequences, draws new requests' first tokens, and
        puts every sequence still running into its slot."""
        engine, sched = self.engine, self.scheduler
        started, copies, fresh = [], [], []
        for row, p in complete:
            seqs, page_copies = sched.start(p)
            copies += page_copies
            started += seqs
            if p.resumed is None:
                fresh += [(row, seq) for seq in seqs]
        if copies:
            state = engine.copy_pages(state, *zip(*copies))
        if fresh:
            tokens, logprobs = engine.sample_first(
                logits, [row for row, _ in fresh], [s.request.sampling for _, s in fresh],
                [s.index for _, s in fresh])
            for (_, seq), token, logprob in zip(fresh, np.asarray(tokens).tolist(),
                                                np.asarray(logprobs).tolist()):
                self._push(seq, token, logprob, self.version)
        live = [s for s in started if not s.finished]
        if live:
            state = engine.insert(state, [s.slot for s in live], [s.cached for s in live],
                                  [s.tokens[-1] for s in live], [len(s.tokens) for s in live],
                                  [s.request.sampling for s in live], [s.index for s in live])
        return state

    def _decode(self, state):
        """Runs `steps_per_dispatch` decode steps for every running sequence."""
        engine, sched = self.engine, self.scheduler
        for seq in list(sched.running.values()):
            if seq.request.stream.cancelled:
                self._finish(seq, "cancelled")
        k = engine.cfg.steps_per_dispatch
        sched.reserve(k)
        if not sched.running:
            return state, False
        version = self.version
        for group in decode_groups(engine.cfg, sorted(sched.running.items()), k):
            state = self._decode_group(state, group, k, version)
        return state, True

    def _decode_group(self, state, owners: list[tuple[int, Sequence]], k: int, version: int):
        """Decodes the slots of `owners` (gathered into a batch of their own) at the page-table
        width of the longest of them."""
        engine = self.engine
        width = engine.cfg.table_width(max(s.cached for _, s in owners) + k)
        state, tokens, logprobs = engine.generate_steps(
            self.params, state, self.scheduler.table([s.pages for _, s in owners], width), k,
            slots=[slot for slot, _ in owners])
        self._count(steps=k, busy_slot_steps=k * len(owners),
                    held_tokens=k * sum(s.cached for _, s in owners))
        tokens, logprobs = np.asarray(tokens).tolist(), np.asarray(logprobs).tolist()
        for step_tokens, step_logprobs in zip(tokens, logprobs):
            for row, (_, seq) in enumerate(owners):
                if not seq.finished:
                    self._push(seq, step_tokens[row], step_logprobs[row], version)
        return state

    def _push(self, seq: Sequence, token: int, logprob: float, version: int) -> None:
        """Appends one token to `seq` and its stream, then applies the stop rules."""
        req = seq.request
        if req.stream.cancelled:
            self._finish(seq, "cancelled")
            return
        seq.tokens.append(token)
        seq.logprobs.append(logprob)
        seq.versions.append(version)
        req.stream.put(TokenEvent(seq.index, token, logprob, version))
        self._count(tokens=1)
        reason = self._stop_reason(seq)
        if reason is not None:
            self._finish(seq, reason)

    def _stop_reason(self, seq: Sequence) -> str | None:
        """Why `seq` ends after its last token, if it does."""
        s, token = seq.request.sampling, seq.tokens[-1]
        if s.stop_at_eos and self.eos_id is not None and token == self.eos_id:
            return "eos"
        if token in s.stop_token_ids:
            return "stop"
        if len(seq.tokens) >= s.max_tokens or seq.total_len() >= self.engine.cfg.max_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.slot is not None:
            self.scheduler.finish(seq, keep=reason in ("eos", "stop", "length"))
        seq.finished = True
        seq.request.longest = max(seq.request.longest, len(seq.tokens))
        self._done(seq.request, seq.index, reason)

    def _done(self, req: Request, index: int, reason: str) -> None:
        if req.done[index]:
            return
        req.done[index] = True
        req.stream.put(DoneEvent(index, reason))
        if all(req.done):
            self._count(requests_done=1)
            if self.length_predictor is not None and reason in ("eos", "stop", "length"):
                # A group takes as long as its longest sample.
                self.length_predictor.update(req.prompt, req.longest)

    def _finish_request(self, req: Request, reason: str) -> None:
        for i in range(req.sampling.n):
            self._done(req, i, reason)

    def _shutdown(self, reason: str) -> None:
        """Ends every request not yet finished: queued, being prefilled, preempted, running;
        and refuses every new one."""
        sched = self.scheduler
        with self._admit_lock:
            self._closed = True
        for req in sched.take_waiting():
            self._finish_request(req, reason)
        for p in list(sched.prefilling):
            self._finish_request(p.request, reason)
        for seq in list(sched.resumes) + list(sched.running.values()):
            self._done(seq.request, seq.index, reason)


# A row of a decode batch costs about this many pages of attention in the rest of the model
# (projections, MLP, sampling), and a dispatch about this many row-pages of host overhead.
_ROW_PAGES, _DISPATCH_ROW_PAGES = 4, 16
_SPLIT_GAIN = 0.8     # two batches only when they cost at most this share of one


def decode_groups(cfg, owners: list[tuple[int, Sequence]], k: int
                  ) -> list[list[tuple[int, Sequence]]]:
    """The running (slot, sequence) pairs in one decode batch, or two when that is cheaper: the
    reference attention pads every row to the batch's longest, so in a long tail (many short
    sequences, a few long ones) the short rows go in a batch at their own width. Cost of a batch:
    its rows (bucketed) x (its page-table width + _ROW_PAGES), plus a dispatch; two batches
    when they cost at most _SPLIT_GAIN of one."""
    by_length = sorted(owners, key=lambda o: o[1].cached)

    def cost(group):
        width = cfg.table_width(group[-1][1].cached + k)
        return cfg.row_bucket(len(group)) * (width + _ROW_PAGES) + _DISPATCH_ROW_PAGES

    one = cost(by_length)
    best, split = _SPLIT_GAIN * one, None    # split only for a clear gain
    for i in range(len(by_length) - 1, 0, -1):   # on a tie, the fewest rows at the wide width
        c = cost(by_length[:i]) + cost(by_length[i:])
        if c < best:
            best, split = c, i
    return [by_length] if split is None else [by_length[:split], by_length[split:]]
