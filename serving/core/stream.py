"""What a request's caller receives: a stream of token events, one per generated token, each
with its log-probability and the version of the weights that produced it."""

from __future__ import annotations

import dataclasses
import queue
import threading
from typing import Iterator


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    sample_index: int
    token: int
    logprob: float
    version: int


@dataclasses.dataclass(frozen=True)
class Speculated:
    """What speculative decoding did for one sample (serving/core/speculation.py): the verify
    steps it took part in with a draft, the draft tokens they proposed and those accepted."""
    verify_steps: int
    draft_tokens: int
    accepted_tokens: int

    @property
    def rejected_tokens(self) -> int:
        return self.draft_tokens - self.accepted_tokens

    @property
    def acceptance_length(self) -> float:
        """Tokens a verify step kept for it: the accepted and the one drawn after them."""
        return 1 + self.accepted_tokens / max(self.verify_steps, 1)


@dataclasses.dataclass(frozen=True)
class DoneEvent:
    sample_index: int
    # eos | stop | length: finished. cancelled: the caller let go. shutdown | error: the engine
    # stopped. lost: the connection to a remote engine failed. refused: a remote engine said
    # the request is bad (see RequestStream.error).
    reason: str
    # With EngineConfig.record_routes: the experts each fed token (prompt and sample, all but
    # the last token) was routed to in each layer, int32 [tokens - 1, L, K]. None: not recorded.
    routes: object = None
    # With speculative decoding: what it did for this sample. None: it verified no draft.
    speculation: Speculated | None = None


FINISHED = ("eos", "stop", "length")   # the reasons of a sample that is complete


@dataclasses.dataclass
class Sample:
    tokens: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    versions: list = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    routes: object = dataclasses.field(default=None, compare=False)   # DoneEvent.routes
    speculation: Speculated | None = None                              # DoneEvent.speculation


class RequestStream:
    """The events of one request, in order; iteration ends when all n samples are done."""

    def __init__(self, request_id: int, n: int):
        self.request_id = request_id
        self.n = n
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._cancelled = threading.Event()
        self._so_far = [Sample() for _ in range(n)]   # every event put, for `snapshot`
        self._lock = threading.Lock()
        self._open = n                   # samples without their DoneEvent yet
        self._all_done = threading.Event()
        self.error: str | None = None    # why the samples ended lost or refused, if they did

    def put(self, event: TokenEvent | DoneEvent) -> None:
        """The engine's side: one more event for the reader."""
        with self._lock:
            sample = self._so_far[event.sample_index]
            if isinstance(event, DoneEvent) and sample.finish_reason is None:
                self._open -= 1
                if not self._open:
                    self._all_done.set()
            _apply(sample, event)
            self._events.put(event)

    def end(self, reason: str) -> None:
        """Ends every sample not done yet with `reason` (the engine behind it is gone)."""
        with self._lock:
            open_ = [i for i, s in enumerate(self._so_far) if s.finish_reason is None]
        for i in open_:
            self.put(DoneEvent(i, reason))

    def snapshot(self) -> list[Sample]:
        """Each sample as generated so far, whether or not the reader has seen it yet: what a
        checkpoint keeps of a request in flight (see Orchestrator.submit's `carry`)."""
        with self._lock:
            return [Sample(list(s.tokens), list(s.logprobs), list(s.versions), s.finish_reason)
                    for s in self._so_far]

    def cancel(self) -> None:
        """The client is gone: its slots are freed at the next step."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def __iter__(self) -> Iterator[TokenEvent | DoneEvent]:
        done = 0
        while done < self.n:
            event = self._events.get()
            done += isinstance(event, DoneEvent)
            yield event

    def batches(self, interval_s: float) -> Iterator[list[TokenEvent | DoneEvent]]:
        """The events in lists, in order: each list is what arrived within `interval_s` of its
        first event (a list ends early once every sample is done). The reader wakes once per
        list, not once per token: on a server whose one core also decodes, its stream threads
        had been awake about twice as often as its engine loop."""
        if interval_s <= 0:
            for event in self:
                yield [event]
            return
        done = 0
        while done < self.n:
            batch = [self._events.get()]
            self._all_done.wait(interval_s)
            while True:
                try:
                    batch.append(self._events.get_nowait())
                except queue.Empty:
                    break
            done += sum(isinstance(e, DoneEvent) for e in batch)
            yield batch

    @property
    def done(self) -> bool:
        """All n samples are done: `result` returns at once."""
        return self._all_done.is_set()

    def result(self) -> list[Sample]:
        """Every sample, once all n are done. It waits for the last DoneEvent alone, not for
        each token (an RL actor holds one such wait per group in flight: woken per token, its
        threads took the interpreter from the engine loop thousands of times a step), and
        takes nothing from the events iteration reads."""
        self._all_done.wait()
        with self._lock:
            return [dataclasses.replace(s, tokens=list(s.tokens), logprobs=list(s.logprobs),
                                        versions=list(s.versions)) for s in self._so_far]


def _apply(sample: Sample, event: TokenEvent | DoneEvent) -> None:
    if isinstance(event, TokenEvent):
        sample.tokens.append(event.token)
        sample.logprobs.append(event.logprob)
        sample.versions.append(event.version)
    else:
        sample.finish_reason = event.reason
        sample.routes = event.routes
        sample.speculation = event.speculation
