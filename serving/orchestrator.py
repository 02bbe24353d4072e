"""Continuous batching around an Engine, with in-flight weight updates.

Two threads, blocking on queues as JetStream's orchestrator does:
- the engine loop owns the device: between two decode dispatches it applies a pending weight
  update, returns finished slots to the free list, prefills queued prompts chunk by chunk up to
  a token budget (inserting each into free slots when its prompt is done), then runs
  `steps_per_dispatch` decode steps for every slot. Prefill is chunked so a long prompt never stalls running decodes.
- the emitter pulls each dispatch's tokens to the host, appends them to their requests' streams,
  applies the stop rules (EOS, stop tokens, max_tokens, cache full, client gone) and hands
  finished slots back to the loop.

Every token is tagged with the version of the weights that produced it.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import queue
import threading
import time
from typing import Sequence

import numpy as np

from jaxrl.errors import UserError
from serving.engine import Engine
from serving.sampling import SamplingParams
from serving.stream import DoneEvent, RequestStream, Sample, TokenEvent

__all__ = ["DoneEvent", "InvalidRequest", "Orchestrator", "QueueFull", "RequestStream",
           "Sample", "TokenEvent", "UpdateResult"]


class InvalidRequest(UserError):
    """A request the engine cannot serve; the message says what is wrong."""


class QueueFull(Exception):
    """Backpressure: the request queue is at its limit; retry later."""


@dataclasses.dataclass
class _Request:
    prompt: list[int]
    sampling: SamplingParams
    stream: RequestStream
    generated: list[int] = dataclasses.field(default_factory=list)  # per sample
    done: list[bool] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        self.generated = [0] * self.sampling.n
        self.done = [False] * self.sampling.n


@dataclasses.dataclass
class _Update:
    params: object
    version: int
    applied: threading.Event = dataclasses.field(default_factory=threading.Event)
    pause_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class UpdateResult:
    version: int
    transfer_s: float   # checks + device-to-device copy + cast, done beside decoding
    pause_s: float      # time decoding was held to swap the weights in


class Orchestrator:
    def __init__(self, engine: Engine, *, eos_id: int | None = None, max_queued: int = 1024):
        if engine.params is None:
            raise ValueError("engine has no weights: call engine.load_params first")
        self.engine = engine
        self.eos_id = eos_id
        self.vocab_size = engine.model_cfg.vocab_size
        self._queue: collections.deque[_Request] = collections.deque()
        self._max_queued = max_queued
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._updates: queue.SimpleQueue[_Update] = queue.SimpleQueue()
        self._records: queue.Queue = queue.Queue(maxsize=2)  # how far the loop may run ahead
        self._freed: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._stats = collections.Counter()
        self._running: dict[int, _Request] = {}  # emitter's: requests with samples in slots
        self._job = None  # loop's: (request, prefix, tokens prefilled) of a long prompt
        self.pauses_s: list[float] = []
        self.error: BaseException | None = None

    # -- public --------------------------------------------------------------------------------
    def start(self) -> "Orchestrator":
        for target, name in ((self._loop, "engine-loop"), (self._emit, "emitter")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._wake.set()
        for t in self._threads:
            t.join(timeout)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def validate(self, prompt: Sequence[int], sampling: SamplingParams) -> None:
        e = self.engine.cfg
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

    def submit(self, prompt: Sequence[int], sampling: SamplingParams = SamplingParams()
               ) -> RequestStream:
        """Queues a request; raises InvalidRequest or QueueFull at once rather than later."""
        prompt = [int(t) for t in prompt]
        self.validate(prompt, sampling)
        if self._stop.is_set():
            raise QueueFull("the orchestrator is shutting down")
        stream = RequestStream(next(self._ids), sampling.n)
        with self._lock:
            if len(self._queue) >= self._max_queued:
                raise QueueFull(f"{len(self._queue)} requests are queued (max_queued="
                                f"{self._max_queued})")
            self._queue.append(_Request(prompt, sampling, stream))
        self._wake.set()
        return stream

    def generate(self, prompt: Sequence[int], sampling: SamplingParams = SamplingParams()
                 ) -> list[Sample]:
        return self.submit(prompt, sampling).result()

    def update_params(self, params, version: int, timeout: float | None = None) -> UpdateResult:
        """Checks and moves `params` to the engine (in this thread, beside decoding), then has
        the loop swap them in between two decode steps. Raises WeightUpdateError, leaving the
        old weights serving, if the update is bad."""
        if not self._threads or not self._threads[0].is_alive():
            raise RuntimeError("the orchestrator is not running: call start() first")
        t0 = time.perf_counter()
        prepared = self.engine.prepare_params(params)
        transfer = time.perf_counter() - t0
        update = _Update(prepared, version)
        self._updates.put(update)
        self._wake.set()
        if not update.applied.wait(timeout):
            raise TimeoutError(f"weight update {version} not applied within {timeout} s")
        return UpdateResult(version, transfer, update.pause_s)

    def metrics(self) -> dict:
        s = self._stats
        steps = max(s["steps"], 1)
        pauses = self.pauses_s or [0.0]
        with self._lock:
            queued = len(self._queue)
        return {"version": self.engine.version, "steps": s["steps"],
                "busy_slot_steps": s["busy_slot_steps"],
                "generated_tokens": s["tokens"], "requests_done": s["requests_done"],
                "prefill_chunks": s["prefill_chunks"], "queued": queued,
                "slots_busy_fraction": s["busy_slot_steps"] / (steps * self.engine.cfg.
                                                                max_concurrent_decodes),
                "updates": len(self.pauses_s), "update_pause_ms_max": 1e3 * max(pauses),
                "update_pause_ms_mean": 1e3 * sum(pauses) / len(pauses)}

    # -- engine loop ---------------------------------------------------------------------------
    def _loop(self) -> None:
        engine = self.engine
        try:
            state = engine.init_decode_state()
            free = collections.deque(range(engine.cfg.max_concurrent_decodes))
            owners: list[tuple[_Request, int] | None] = [None] * len(free)
            while not self._stop.is_set():
                self._wake.clear()
                while not self._updates.empty():
                    update = self._updates.get()
                    t0 = time.perf_counter()
                    engine.update_params(update.params, update.version, prepared=True)
                    update.pause_s = time.perf_counter() - t0
                    self.pauses_s.append(update.pause_s)
                    update.applied.set()
                while not self._freed.empty():
                    slot = self._freed.get()
                    owners[slot] = None
                    free.append(slot)
                state, worked = self._admit(state, free, owners)
                if any(owners):
                    worked = True
                    k = engine.cfg.steps_per_dispatch
                    state, tokens, logprobs = engine.generate_steps(engine.params, state, k)
                    self._stats["steps"] += k
                    self._stats["busy_slot_steps"] += k * sum(o is not None for o in owners)
                    self._records.put(("steps", list(owners), tokens, logprobs, engine.version))
                if not worked:
                    self._wake.wait(0.05)
        except BaseException as e:  # a bug: fail every request loudly instead of hanging them
            self.error = e
            self._records.put(("error", e))
            raise
        finally:
            self._records.put(("stop",))

    def _admit(self, state, free, owners):
        """Prefills queued prompts, first come first served, until `prefill_budget` prompt
        tokens are spent: runs of short prompts in one batched call, a long prompt one chunk at
        a time. Each finished prompt goes into free slots at once."""
        engine, budget, worked = self.engine, self.engine.cfg.prefill_budget, False
        while budget > 0:
            if self._job is None:
                batch = self._take_short(len(free), budget)
                if batch:
                    longest = max(len(r.prompt) for r in batch)
                    tokens = np.zeros((len(batch), engine.bucket(longest)), np.int32)
                    for i, r in enumerate(batch):
                        tokens[i, : len(r.prompt)] = r.prompt
                    prefix = engine.prefill_batch(engine.params, tokens,
                                                  [len(r.prompt) for r in batch])
                    self._stats["prefill_chunks"] += 1
                    state = self._insert(batch, prefix, state, free, owners)
                    budget -= sum(len(r.prompt) for r in batch)
                    worked = True
                    continue
                self._job = self._take_long(len(free))
                if self._job is None:
                    break
            req, prefix, done = self._job
            chunk = req.prompt[done: done + engine.cfg.prefill_chunk]
            padded = np.zeros((1, engine.bucket(len(chunk))), np.int32)
            padded[0, : len(chunk)] = chunk
            prefix = engine.prefill_batch(engine.params, padded, [len(chunk)], prefix)
            self._stats["prefill_chunks"] += 1
            budget -= len(chunk)
            worked = True
            self._job = (req, prefix, done + len(chunk))
            if done + len(chunk) == len(req.prompt):
                self._job = None
                state = self._insert([req], prefix, state, free, owners)
        return state, worked

    def _take_short(self, free_slots: int, budget: int) -> list[_Request]:
        """Requests from the head of the queue whose prompts fit one chunk, while their samples
        fit the free slots and their tokens the budget."""
        taken, tokens, slots = [], 0, 0
        with self._lock:
            while self._queue:
                r = self._queue[0]
                if r.stream.cancelled:
                    self._finish_all(self._queue.popleft(), "cancelled")
                    continue
                if (len(r.prompt) > self.engine.cfg.prefill_chunk
                        or slots + r.sampling.n > free_slots
                        or (taken and tokens + len(r.prompt) > budget)):
                    break
                taken.append(self._queue.popleft())
                tokens += len(r.prompt)
                slots += r.sampling.n
        return taken

    def _take_long(self, free_slots: int):
        with self._lock:
            if self._queue and self._queue[0].sampling.n <= free_slots:
                return (self._queue.popleft(), None, 0)
        return None

    def _insert(self, requests, prefix, state, free, owners):
        """All samples of `requests` (row i of `prefix` is request i) into free slots."""
        rows, samplings, indices, slots = [], [], [], []
        for row, r in enumerate(requests):
            for i in range(r.sampling.n):
                rows.append(row)
                samplings.append(r.sampling)
                indices.append(i)
                slots.append(free.popleft())
        engine = self.engine
        tokens, logprobs = engine.sample_first(prefix, rows, samplings, indices)
        state = engine.insert_batch(prefix, state, slots, rows, samplings, indices, tokens)
        for slot, row, i in zip(slots, rows, indices):
            owners[slot] = (requests[row], i)
        self._records.put(("first", requests, rows, indices, slots, tokens, logprobs,
                           engine.version))
        return state

    # -- emitter -------------------------------------------------------------------------------
    def _emit(self) -> None:
        while True:
            record = self._records.get()
            kind = record[0]
            if kind == "stop":
                self._shutdown()
                return
            if kind == "error":
                self._shutdown(reason="error")
                return
            if kind == "first":
                _, requests, rows, indices, slots, tokens, logprobs, version = record
                tokens, logprobs = np.asarray(tokens).tolist(), np.asarray(logprobs).tolist()
                for req in requests:
                    self._running[req.stream.request_id] = req
                for row, i, slot, token, logprob in zip(rows, indices, slots, tokens, logprobs):
                    self._push(requests[row], i, slot, token, logprob, version)
            else:
                _, owners, tokens, logprobs, version = record
                tokens, logprobs = np.asarray(tokens).tolist(), np.asarray(logprobs).tolist()
                for step_tokens, step_logprobs in zip(tokens, logprobs):
                    for slot, owner in enumerate(owners):
                        if owner is not None:
                            req, i = owner
                            self._push(req, i, slot, step_tokens[slot], step_logprobs[slot],
                                       version)

    def _push(self, req: _Request, i: int, slot: int, token: int, logprob: float,
              version: int) -> None:
        if req.done[i]:
            return  # tokens the loop made before it learned the sample had finished
        if req.stream.cancelled:
            self._finish(req, i, slot, "cancelled")
            return
        req.stream._events.put(TokenEvent(i, token, logprob, version))
        req.generated[i] += 1
        self._stats["tokens"] += 1
        s = req.sampling
        reason = None
        if s.stop_at_eos and self.eos_id is not None and token == self.eos_id:
            reason = "eos"
        elif token in s.stop_token_ids:
            reason = "stop"
        elif req.generated[i] >= s.max_tokens or \
                len(req.prompt) + req.generated[i] >= self.engine.cfg.max_len:
            reason = "length"
        if reason:
            self._finish(req, i, slot, reason)

    def _finish(self, req: _Request, i: int, slot: int | None, reason: str) -> None:
        req.done[i] = True
        req.stream._events.put(DoneEvent(i, reason))
        if slot is not None:
            self._freed.put(slot)
            self._wake.set()
        if all(req.done):
            self._stats["requests_done"] += 1
            self._running.pop(req.stream.request_id, None)

    def _finish_all(self, req: _Request, reason: str) -> None:
        for i in range(req.sampling.n):
            if not req.done[i]:
                self._finish(req, i, None, reason)

    def _shutdown(self, reason: str = "shutdown") -> None:
        with self._lock:
            pending = list(self._queue)
            self._queue.clear()
        for req in pending + list(self._running.values()):
            self._finish_all(req, reason)
