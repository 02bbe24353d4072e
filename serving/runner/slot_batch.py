"""The host side of an insert and a first-token draw: the K sequences that take their slots
(`SlotBatch`) as the per-slot arrays the programs take (dicts keyed by the fields of
serving/runner/steps.py's DecodeState), padded to a row bucket by repeating the last entry."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import numpy as np

from serving.runner.sampling import MAX_LOGIT_BIAS, SamplingParams
from serving.runner.steps import HISTORY_CHUNK


@dataclasses.dataclass(frozen=True)
class SlotBatch:
    """K sequences to decode on (`Engine.insert`), row i: slot `slots[i]` decodes on from
    `next_tokens[i]` at position `lengths[i]` (the tokens its cache holds), having sampled
    `counts[i]` tokens (`histories[i]`, needed where its sampling has penalties) as sample
    `sample_indices[i]` of its request, under `samplings[i]`."""

    slots: Sequence[int]
    lengths: Sequence[int]
    next_tokens: Sequence[int]
    counts: Sequence[int]
    samplings: Sequence[SamplingParams]
    sample_indices: Sequence[int]
    histories: Sequence[Sequence[int]] | None = None

    def __post_init__(self):
        for slot, h, n, s in zip(self.slots, self._histories(), self.counts, self.samplings,
                                 strict=True):
            if s.penalized and len(h) != n:
                raise ValueError(f"slot {slot}: a sample with penalties needs the {n} tokens it "
                                 f"has sampled to count them, got {len(h)}")

    @classmethod
    def of(cls, seqs) -> "SlotBatch":
        """The batch of serving Sequences (serving/core/sequence.py) that took their slots."""
        return cls([s.slot for s in seqs], [s.cached for s in seqs],
                   [s.tokens[-1] for s in seqs], [len(s.tokens) for s in seqs],
                   [s.request.sampling for s in seqs], [s.index for s in seqs],
                   [s.tokens for s in seqs])

    def rows(self, k: int, eos_id: int | None) -> dict[str, np.ndarray]:
        """Every per-slot field's values for the K entries, padded to k rows. Padding repeats
        the last entry: the same slot written twice with the same data."""
        samplings = self.samplings
        return {"lengths": padded(self.lengths, k, np.int32),
                "tokens": padded(self.next_tokens, k, np.int32),
                "counts": padded(self.counts, k, np.int32),
                "sample_index": padded(self.sample_indices, k, np.int32),
                "presence": padded([s.presence_penalty for s in samplings], k, np.float32),
                "frequency": padded([s.frequency_penalty for s in samplings], k, np.float32),
                "adapter": padded([s.adapter for s in samplings], k, np.int32),
                **sampling_rows(samplings, k, eos_id)}

    def history_chunks(self, k: int) -> Iterator[tuple[np.ndarray, bool]]:
        """The penalized entries' sampled tokens, HISTORY_CHUNK at a time ([k, HISTORY_CHUNK],
        -1 padding; padding rows have none, so a history is counted once), each with whether
        it is the first (which zeroes the counts). One all-padding chunk when none has one."""
        histories = self._histories()
        longest = max(len(h) for h in histories)
        for start in range(0, max(longest, 1), HISTORY_CHUNK):
            chunk = np.full((k, HISTORY_CHUNK), -1, np.int32)
            for i, h in enumerate(histories):
                part = h[start: start + HISTORY_CHUNK]
                chunk[i, : len(part)] = part
            yield chunk, start == 0

    def _histories(self) -> list:
        """Each entry's history where its sampling has penalties (which count it), else ()."""
        given = self.histories or [()] * len(self.slots)
        return [h if s.penalized else () for h, s in zip(given, self.samplings, strict=True)]


def padded(values, k: int, dtype) -> np.ndarray:
    """`values` as an array of length k, the last value repeated."""
    values = list(values)
    return np.asarray(values + values[-1:] * (k - len(values)), dtype)


def sampling_rows(samplings, k: int, eos_id: int | None) -> dict[str, np.ndarray]:
    """Per-entry sampling arrays of length k, keyed by spec.SAMPLING's names (temperature,
    top_k, top_p, seeds, banned token, min_tokens, logit_bias ids and values). min_tokens
    bans EOS where the request stops at it; stop tokens are drawn and ignored until then
    (serving/core/engine_loop.py, stop_reason)."""
    def ban(s):
        return eos_id if s.min_tokens and s.stop_at_eos and eos_id is not None else -1

    bias_ids = np.full((k, MAX_LOGIT_BIAS), -1, np.int32)
    bias_values = np.zeros((k, MAX_LOGIT_BIAS), np.float32)
    for i in range(k):
        pairs = samplings[min(i, len(samplings) - 1)].logit_bias   # padding repeats the last
        if pairs:
            bias_ids[i, : len(pairs)], bias_values[i, : len(pairs)] = zip(*pairs)
    return {"temperature": padded([s.temperature for s in samplings], k, np.float32),
            "top_k": padded([s.top_k for s in samplings], k, np.int32),
            "top_p": padded([s.top_p for s in samplings], k, np.float32),
            "seeds": padded([s.seed for s in samplings], k, np.uint32),
            "banned": padded([ban(s) for s in samplings], k, np.int32),
            "min_tokens": padded([s.min_tokens for s in samplings], k, np.int32),
            "bias_ids": bias_ids, "bias_values": bias_values}
