"""Carry replay: a request's n samples as a previous run left them (`RequestStream.snapshot`
taken at a checkpoint) are checked, replayed into the new request's stream token for token
(log-probs and versions included), and each unfinished sample is recomputed from its prefix
(one prefill, as after a preemption) and decoded on from where it stopped."""

from __future__ import annotations

from typing import Callable
from typing import Sequence as Seq

from serving.core.requests import InvalidRequest, check_tokens
from serving.core.sequence import Request, Sequence
from serving.core.stream import DoneEvent, Sample, TokenEvent
from serving.runner.sampling import SamplingParams


def carried_sequences(sampling: SamplingParams, carry: Seq[Sample], vocab_size: int
                      ) -> list[Sequence | None]:
    """The carried samples as sequences (None for a sample with no token yet); InvalidRequest
    naming the first sample that does not fit the request."""
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
        check_tokens(s.tokens, vocab_size, f"carried sample {i}: ")
        out.append(Sequence(None, i, [int(t) for t in s.tokens],
                            [float(x) for x in s.logprobs], [int(v) for v in s.versions])
                   if s.tokens else None)
    return out


def replay(request: Request, carried: list[Sequence | None],
           stop_reason: Callable[[Sequence], str | None]) -> int:
    """Puts the carried tokens into `request`'s stream and ends the samples that had finished;
    leaves in `request.fresh` the samples to start from the prompt and in `request.carried`
    those to resume. Returns the number of tokens replayed."""
    stream = request.stream
    request.fresh = [i for i, seq in enumerate(carried) if seq is None]
    request.carried = [seq for seq in carried if seq is not None]
    for seq in request.carried:
        seq.request = request
        for event in zip(seq.tokens, seq.logprobs, seq.versions):
            stream.put(TokenEvent(seq.index, *event))
        reason = stop_reason(seq)
        if reason is not None:     # it had finished (the request is not shared yet)
            seq.finished, request.done[seq.index] = True, True
            stream.put(DoneEvent(seq.index, reason))
    request.carried = [seq for seq in request.carried if not seq.finished]
    return sum(len(seq.tokens) for seq in carried if seq)
