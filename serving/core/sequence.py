"""The units the scheduler passes around (nano-vllm's Sequence): a request, the prefill that
writes a prompt into pages, and each sample's sequence."""

from __future__ import annotations

import dataclasses

from serving.core.sessions import Continuation
from serving.core.stream import RequestStream
from serving.runner.sampling import SamplingParams


@dataclasses.dataclass(eq=False)
class Request:
    """A prompt and how to sample it: n samples that share the prompt's prefill and pages."""

    prompt: list[int]
    sampling: SamplingParams
    stream: RequestStream
    # Output tokens the scheduler expects (a length predictor's guess, or the caller's): with
    # length-aware admission, longer ones are admitted first. None: unknown.
    predicted_len: float | None = None
    done: list[bool] = dataclasses.field(default_factory=list)
    longest: int = 0      # tokens of its longest finished sample
    # Samples that start from the prompt's prefill (all n, unless some were carried over).
    fresh: list[int] = dataclasses.field(default_factory=list)
    # Samples carried over with tokens already generated (a resumed run's groups in flight):
    # recomputed like preempted sequences, then decoded on from where they stopped.
    carried: list["Sequence"] = dataclasses.field(default_factory=list)
    # Multi-turn episodes (serving/core/sessions.py): the session whose kept pages the prompt
    # continues, and per sample the session its pages are kept for when it ends.
    session: str | None = None
    keep: list[str | None] = dataclasses.field(default_factory=list)
    continuation: Continuation | None = None     # pages taken back from `session`

    def __post_init__(self):
        self.done = [False] * self.sampling.n
        if not self.keep:
            self.keep = [None] * self.sampling.n
        if not self.fresh and not self.carried:
            self.fresh = list(range(self.sampling.n))


@dataclasses.dataclass(eq=False)
class Sequence:
    """One sample: its tokens so far, with the log-prob and weights version of each, and the
    pages and slot it holds while it runs."""

    request: Request
    index: int                                  # which of the request's n samples
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    pages: list[int] = dataclasses.field(default_factory=list)
    slot: int | None = None
    order: int = -1          # when it last started running: the youngest is preempted first
    finished: bool = False
    inflight: int = 0        # tokens decoded on the device, not read back yet
    matcher: object = None   # its grammar's state (serving/runner/constraints.py), if it has one
    # With EngineConfig.record_routes: each fed position's experts [L, K], recorded the first
    # time the position is computed (a preempted sequence's recompute does not overwrite them).
    routes: list = dataclasses.field(default_factory=list)
    # Speculative decoding: verify steps it took part in with a draft, their draft tokens and
    # the accepted ones (its DoneEvent's `speculation`).
    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def cached(self) -> int:
        """Tokens whose keys and values are in its pages while it runs: the prompt and every
        generated token but the last, which the next decode step feeds; tokens in flight
        count as generated."""
        return len(self.request.prompt) + len(self.tokens) + self.inflight - 1

    def total_len(self) -> int:
        return len(self.request.prompt) + len(self.tokens)


@dataclasses.dataclass(eq=False)
class Prefill:
    """Tokens being written into pages, a chunk at a time: a new request's prompt (forked into
    its n sequences when done) or a preempted sequence's prompt and tokens (all but the last,
    which it feeds next), recomputed. A turn continuing a session starts with `done` at the
    tokens its kept pages already hold."""

    tokens: list[int]
    pages: list[int]
    slots: list[int]                  # decode slots reserved for its sequences
    request: Request
    resumed: Sequence | None = None
    copy_pages: list[int] = dataclasses.field(default_factory=list)  # see Scheduler.admit
    done: int = 0                     # tokens written so far
    routes: list = dataclasses.field(default_factory=list)   # per written token, as Sequence's

    @property
    def remaining(self) -> int:
        return len(self.tokens) - self.done


def stop_reason(seq: Sequence, eos_id: int | None, max_len: int) -> str | None:
    """Why `seq` ends after its last token, if it does."""
    s, token = seq.request.sampling, seq.tokens[-1]
    if len(seq.tokens) >= s.min_tokens:
        if s.stop_at_eos and eos_id is not None and token == eos_id:
            return "eos"
        if token in s.stop_token_ids:
            return "stop"
    if len(seq.tokens) >= s.max_tokens or seq.total_len() >= max_len:
        return "length"
    return None
