"""Continuous batching around an Engine over a paged KV pool, with in-flight weight updates:
the public face of the engine loop.

`Orchestrator` takes requests (checked by serving/core/requests.py before they are queued; a
carried request replayed by serving/core/carry.py), weight updates (checked and placed on the
caller's thread, swapped in by the loop between two decode steps), pauses and session ends,
and reports metrics. The loop that owns the device is serving/core/engine_loop.py, on a thread this
object starts and joins.

Every token is tagged with its log-probability and the version of the weights that produced it.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from typing import Sequence as Seq

from serving.core import carry as carry_replay
from serving.core import threads
from serving.core.engine_loop import EngineLoop, Score, Update
from serving.core.length_predictor import LengthPredictor
from serving.core.drafts import make_drafter
from serving.core.requests import (
    EngineStopped,
    InvalidRequest,
    QueueFull,
    StaleVersion,
    check_adapter,
    check_tokens,
    validate,
)
from serving.core.scheduler import Scheduler, decode_groups
from serving.core.sequence import Request
from serving.core.speculation import Speculator
from serving.core.stream import DoneEvent, RequestStream, Sample, TokenEvent
from serving.runner.constraints import Grammars
from serving.runner.engine import Engine
from serving.runner.programs import process_compiles
from serving.runner.sampling import SamplingParams

__all__ = ["DoneEvent", "EngineStopped", "InvalidRequest", "Orchestrator", "QueueFull",
           "RequestStream", "Sample", "TokenEvent", "UpdateResult", "decode_groups"]


@dataclasses.dataclass(frozen=True)
class UpdateResult:
    version: int
    transfer_s: float   # checks + device-to-device copy + cast, done beside decoding
    pause_s: float      # time decoding was held to swap the weights in
    adapters: bool = False  # a LoRA model's adapters alone, the base kept


class Orchestrator:
    def __init__(self, engine: Engine, params, *, version: int = 0, eos_id: int | None = None,
                 max_queued: int = 1024, longest_first: bool = False,
                 grammars: Grammars | None = None, speculator: Speculator | None = None):
        """Serves `engine` with the weights `params` (any placement: they are checked and
        placed on the engine's mesh here), numbered `version`; it owns them from now on and
        `update_params` replaces them.
        `longest_first`: admit the requests predicted to generate the most tokens first
        (StreamRL), by the caller's `predicted_len` or else a LengthPredictor that learns from
        every finished request; otherwise first come, first served.
        `grammars`: matchers for the model's tokenizer (serving/runner/constraints.py), for requests
        whose sampling has a grammar; without them such a request is refused.
        `speculator`: how the tail is decoded speculatively (serving/core/speculation.py); by
        default the drafter `engine.cfg.speculative` names, under the measured load rule."""
        self.engine = engine
        self.eos_id = eos_id
        self.vocab_size = engine.model_cfg.vocab_size
        e = engine.cfg
        self.scheduler = Scheduler(slots=e.max_concurrent_decodes, num_pages=engine.num_pages,
                                   page_size=e.page_size, max_len=e.max_len,
                                   prefill_chunk=e.prefill_chunk,
                                   prefill_budget=e.prefill_budget,
                                   prefill_rows=lambda n: e.prefill_rows(engine.bucket(n)),
                                   longest_first=longest_first)
        self.length_predictor = LengthPredictor() if longest_first else None
        self.grammars = grammars
        if speculator is None and (drafter := make_drafter(e.speculative)) is not None:
            speculator = Speculator(drafter, e.speculative_tokens, lengths=e.draft_lengths)
        self.speculator = speculator
        self._loop = EngineLoop(engine, engine.prepare_params(params), version, self.scheduler,
                                eos_id, self.length_predictor, grammars, speculator)
        self._max_queued = max_queued
        self._update_lock = threading.Lock()     # one update checked and queued at a time
        self._accepted_version = version         # the newest version queued or served
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._compiling: threading.Thread | None = None   # compile_wanted's (compile_later)
        self._carried_tokens = 0            # tokens replayed from `carry`, never regenerated
        self._carry_lock = threading.Lock()

    # what the loop serves and reports, read from any thread
    @property
    def params(self):
        return self._loop.params

    @property
    def version(self) -> int:
        return self._loop.version

    @property
    def pauses_s(self) -> list[float]:
        return self._loop.pauses_s

    @property
    def error(self) -> BaseException | None:
        return self._loop.error

    @property
    def can_score(self) -> bool:
        """`score` works: the engine compiled its score programs (EngineConfig.score)."""
        return self.engine.cfg.score

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def newest_version(self) -> int:
        """The newest weights version served or accepted to be: an update must be newer."""
        return self._accepted_version

    # -- life ----------------------------------------------------------------------------------
    def start(self, compile_later: bool = False) -> "Orchestrator":
        """Compiles every program the engine can run (on this thread; nothing when an engine
        of the same shapes did), then starts the loop: no request ever waits for a compile.
        `compile_later`: compile only what the largest batches and prefill chunks need here;
        a call for a smaller batch or chunk runs padded to a compiled size and asks for its
        own, which a thread beside the loop compiles (serving/runner/programs.py). For a caller
        whose first batch is due before everything could compile (an RL run's first step)."""
        if self._thread is not None:
            raise RuntimeError("this orchestrator was started already")
        t0 = time.perf_counter()
        self.compiled_at_start = self.engine.compile(largest_only=compile_later)
        self.compile_s = time.perf_counter() - t0
        self._thread = threading.Thread(target=self._loop.run, name="engine-loop", daemon=True)
        self._thread.start()
        if compile_later:
            self._compiling = threading.Thread(target=self.engine.compile_wanted,
                                               args=(self._loop.stop,), name="engine-compile",
                                               daemon=True)
            self._compiling.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Ends the loop (every request not finished ends with reason "shutdown") and returns
        once its threads have ended (the loop's, and compile_wanted's after the program it is
        compiling); raises TimeoutError naming one that has not in `timeout`."""
        self._loop.request_stop()
        deadline = time.monotonic() + timeout
        if self._thread is not None:
            threads.join(self._thread, timeout)
        else:
            self._loop.shutdown("shutdown")
        threads.join(self._compiling, max(deadline - time.monotonic(), 0.0))

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def _wait(self, event: threading.Event, timeout: float | None, what: str) -> None:
        """Until the loop sets `event`; EngineStopped if the loop ends first, TimeoutError
        ("{what} within {timeout} s") past `timeout`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not event.wait(0.05):
            if not self.running and not event.is_set():
                raise self._stopped_error()
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{what} within {timeout} s")

    def _stopped_error(self) -> EngineStopped:
        why = f": {type(self.error).__name__}: {self.error}" if self.error else ""
        return EngineStopped(f"the engine loop has stopped{why}")

    def pause(self, timeout: float = 60.0, lease_s: float | None = None) -> None:
        """Stops dispatching prefill and decode calls between two of them and returns once the
        device is free (partial rollouts: the trainer gets it for a step). Every sequence keeps
        its tokens, slot and pages; weight updates, cancellations and new requests are still
        taken, and `resume` continues decoding exactly where it stopped. `lease_s`: resume by
        itself after that long unless resumed (or paused again) before."""
        self._loop.hold(lease_s)
        deadline = time.monotonic() + timeout
        while not self._loop.held.wait(0.05):
            if not self.running:
                return                      # a stopped loop dispatches nothing
            if time.monotonic() > deadline:
                raise TimeoutError(f"the engine loop did not pause within {timeout} s")

    def resume(self) -> None:
        self._loop.release()

    @property
    def paused(self) -> bool:
        """Paused, its lease (if any) not run out."""
        return self._loop.paused()

    # -- requests ------------------------------------------------------------------------------
    def validate(self, prompt: Seq[int], sampling: SamplingParams,
                 session: str | Seq[str] | None = None) -> None:
        validate(self.engine.cfg, self.scheduler.pool, self.vocab_size, prompt, sampling,
                 session)
        check_adapter(self.engine.model_cfg, sampling.adapter)
        if sampling.grammar is not None:
            if self.grammars is None:
                raise InvalidRequest("this engine has no tokenizer to constrain decoding with "
                                     "(Orchestrator(grammars=...); `jaxrl serve` has one)")
            if self.engine.cfg.steps_per_dispatch != 1:
                raise InvalidRequest(f"constrained decoding draws one token per dispatch; the "
                                     f"engine draws {self.engine.cfg.steps_per_dispatch} "
                                     f"(steps_per_dispatch)")
            try:
                self.grammars.check(sampling.grammar)
            except ValueError as e:
                raise InvalidRequest(str(e)) from None

    def submit(self, prompt: Seq[int], sampling: SamplingParams = SamplingParams(), *,
               predicted_len: float | None = None, carry: Seq[Sample] | None = None,
               session: str | Seq[str] | None = None) -> RequestStream:
        """Queues a request; raises InvalidRequest or QueueFull at once rather than later.
        `predicted_len`: its expected output length, for length-aware admission.
        `session`: one turn of a multi-turn episode (n=1): the prompt (the episode's whole
        history) continues from the pages the session's previous turn kept, and this turn's
        pages are kept for the next (serving/core/sessions.py). A list of n keys: a group's first
        turn, each sample's pages kept for its own session. `end_session` frees them.
        `carry`: the request's n samples as a previous run left them (serving/core/carry.py):
        replayed into the new stream, each unfinished one decoded on from where it stopped,
        with the same random draws."""
        prompt = [int(t) for t in prompt]
        self.validate(prompt, sampling, session)
        carried = (carry_replay.carried_sequences(sampling, carry, self.vocab_size)
                   if carry is not None else None)
        if carry is not None and sampling.grammar is not None:
            for i, sample in enumerate(carry):     # the loop would start their matchers there
                try:
                    self.grammars.matcher(sampling.grammar, sample.tokens)
                except ValueError as e:
                    raise InvalidRequest(f"carried sample {i}: {e}") from None
        stream = RequestStream(next(self._ids), sampling.n)
        if predicted_len is None and self.length_predictor is not None:
            predicted_len = self.length_predictor.predict(prompt)
        request = Request(prompt, sampling, stream, predicted_len)
        if isinstance(session, str):
            request.session, request.keep = session, [session]
        elif session is not None:
            request.keep = list(session)
        if carried is not None:
            replayed = carry_replay.replay(request, carried, self._loop.stop_reason)
            with self._carry_lock:
                self._carried_tokens += replayed
            if not request.fresh and not request.carried:
                return stream              # every sample had finished
        loop = self._loop
        with loop.admit_lock:         # the loop's end takes every request queued before it
            if loop.closed or loop.stop.is_set():
                raise self._stopped_error()
            if not self.scheduler.add(request, self._max_queued):
                raise QueueFull(f"{self.scheduler.queued()} requests are queued (max_queued="
                                f"{self._max_queued})")
        loop.notify()
        return stream

    def generate(self, prompt: Seq[int], sampling: SamplingParams = SamplingParams()
                 ) -> list[Sample]:
        return self.submit(prompt, sampling).result()

    def score(self, tokens: Seq[int], timeout: float | None = None, adapter: int = 0):
        """Log-probs of `tokens` under the weights serving now, each given those before it:
        (logprobs [n-1], top ids [n-1, 20], top log-probs [n-1, 20]) (Engine.score), computed
        by the loop between two of its calls. Raises InvalidRequest for tokens it cannot score
        (the engine compiled without `score`, too long, out of the vocabulary)."""
        tokens = [int(t) for t in tokens]
        check_tokens(tokens, self.vocab_size, "score: ")
        check_adapter(self.engine.model_cfg, adapter)
        if not self.running:
            raise self._stopped_error()
        job = Score(tokens, adapter)
        self._loop.post_score(job)
        self._wait(job.done, timeout, f"scoring {len(tokens)} tokens did not end")
        if isinstance(job.error, ValueError):
            raise InvalidRequest(str(job.error))
        if job.error is not None:
            raise self._stopped_error()
        return job.result

    def end_session(self, key: str) -> None:
        """The episode `key` has ended: the pages kept for its next turn go back to the pool."""
        self._loop.end_session(key)

    # -- weights -------------------------------------------------------------------------------
    def update_params(self, params, version: int, timeout: float | None = None, *,
                      resume: bool = False, pulled: bool = False) -> UpdateResult:
        """Checks and moves `params` to the engine (in this thread, beside decoding), then has
        the loop swap them in between two decode steps. Raises WeightUpdateError, leaving the
        old weights serving, if the update is bad, and StaleVersion if `version` is not newer
        than every version served or accepted before it (versions never go back), unless
        `resume`: a trainer resumed from a checkpoint restarts the sequence at its version.
        `pulled`: the arrays a pull made for this server, checked for NaN/Inf already and
        nobody else's (serving/weights/pulls.py)."""
        if self._thread is None:
            raise RuntimeError("the orchestrator is not running: call start() first")
        if not self._thread.is_alive():
            raise self._stopped_error()
        with self._update_lock:
            if version <= self.newest_version and not resume:
                raise StaleVersion(f"weight update version {version} is not newer than the "
                                   f"served version {self.newest_version}")
            t0 = time.perf_counter()
            prepared = self.engine.prepare_params(params, pulled=pulled)
            transfer = time.perf_counter() - t0
            update = Update(prepared, version, adapters=self.engine.adapters_only(params))
            self._accepted_version = version
            self._loop.post_update(update)
        self._wait(update.applied, timeout, f"weight update {version} not applied")
        update.retired = None       # the replaced weights are freed here, beside decoding
        return UpdateResult(version, transfer, update.pause_s, update.adapters)

    # -- metrics -------------------------------------------------------------------------------
    def metrics(self) -> dict:
        s, sched, cfg = self._loop.stats(), self.scheduler, self.engine.cfg
        steps = max(s["steps"], 1)
        updates = list(self.pauses_s)
        pauses = updates or [0.0]
        return {"version": self.version, "quantize": self.engine.model_cfg.quantize,
                "admission": "longest_first" if self.scheduler.longest_first else "fifo",
                "slots": sched.num_slots, "max_len": cfg.max_len,
                "max_prefill_length": cfg.max_prefill_length, "vocab_size": self.vocab_size,
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
                "updates": len(updates),
                "paused": self.paused,
                "pause_leases_expired": s["hold_leases_expired"],
                "held_iterations": s["held_iterations"],
                "update_pause_ms_max": 1e3 * max(pauses),
                "update_pause_ms_mean": 1e3 * sum(pauses) / len(pauses),
                "programs": self.engine.programs.compiled,
                "process_compiles": process_compiles(),
                "late_compiles": self.engine.programs.late_compiles,
                "spec_decode_verify_steps": s["verify_steps"],
                **(self.speculator.stats() if self.speculator is not None else {})}
