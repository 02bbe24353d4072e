"""When the engine loop speculates, how far, and what it proposes: the drafter
(serving/core/drafts.py) and the load rule.

A verify step of R rows with drafts of up to k tokens feeds k+1 tokens a row where a decode
step feeds one; it pays when the tokens it keeps a row (1 + the accepted draft tokens)
outweigh its cost over a decode step's. In a full batch a step is bound by compute and a wider
one costs about k+1 times as much: no drafting. In the tail a step's cost is fixed per step
(reading the weights on an accelerator, dispatch and host work here) and a wider one costs
little more: draft, and the thinner the batch the longer (FastGRPO's concurrency-aware rule).
The ways are decoding and verifying at each draft length the engine compiled
(EngineConfig.draft_lengths: K and K/2); the rule takes, at the batch's row count, the way of
fewest seconds per generated token, as the engine measures them:

- at start-up (`measure`), its compiled decode and verify programs timed on this device per
  row count, a verify step's divided by the tokens a row is expected to keep at that draft
  length (`tokens_per_row`: a moving average over its verify steps from an optimistic prior,
  half the draft accepted; a row that found no draft counts as one);
- while it serves (`timed`), each dispatch's wall time, the median of the last RECENT
  dispatches per way and row count (a dispatch that hit a page fault or a busy core does not
  move it), which replaces the start-up figure once there is one: a decode step's over the
  tokens it produced, a verify step's over the sequences it ran, divided by the tokens a row
  keeps now (so that drafts turning better, or worse, show at once, however long ago the
  step was timed). It holds what the programs' timings leave out: host work, drafting,
  attention over the rows' real lengths, and the overlap a speculating dispatch gives up (its
  drafts continue the tokens read back). Each way is
  charged its own work only: a verify step from after it read back the decode step in flight,
  a decode step only when it read back the one before it (the first after a verify step,
  which overlaps nothing yet, is not timed).

    way(R) = the way of fewest seconds per token at R rows (0: decode; k: drafts of k),
             a verify way counted MARGIN dearer than measured (speculating must clearly pay:
             the averages are noisy, and a wrong switch costs more than a missed one)

Now and then PROBE dispatches in a row go another way (the others in turn; two dispatches: the
first of a switch to decoding is not timed), so that every average follows the text being
written (a tail that turns repetitive, a batch that fills): after FIRST_PROBE dispatches at a
row count, then at intervals that double while the choice holds, and are long enough that
probing a way as much slower as it was last measured costs at most PROBE_BUDGET of the time
(up to LAST_PROBE dispatches); back to FIRST_PROBE when the choice changes.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time

import jax
import numpy as np

from serving.core.drafts import Drafter
from serving.core.sequence import Sequence


class Speculator:
    """The drafter, the load rule and what speculation has done (`stats`)."""

    FIRST_PROBE, LAST_PROBE = 8, 512    # dispatches between two probes of another way
    PROBE = 2                 # dispatches a probe lasts
    PROBE_BUDGET = 0.02       # the share of the time probes of a slower way may cost
    MARGIN = 0.1              # how much cheaper a token a verify way must be than decoding
    SMOOTHING = 0.3           # weight of one verify step in the tokens-kept average
    RECENT = 9                # dispatches whose median is a way's measured cost
    DECODE = 0                # the way that decodes (a verify way is its draft length)

    def __init__(self, drafter: Drafter, tokens: int, costs: dict | None = None,
                 always: bool = False, lengths: tuple[int, ...] | None = None):
        """`tokens`: the most draft tokens a row verifies (EngineConfig.speculative_tokens);
        `lengths`: the draft lengths it may choose (EngineConfig.draft_lengths; default
        `tokens` alone). `costs`: {rows: {way: a step's seconds}} (`measure` fills it; a
        (decode s, verify s) pair is the decode step's and the verify step's at `tokens`);
        `always`: speculate at any load with the longest drafts (tests of exactness)."""
        self.drafter, self.k, self.always = drafter, tokens, always
        self.lengths = tuple(sorted(set(lengths or (tokens,))))
        self.costs = {rows: cost if isinstance(cost, dict) else
                      {self.DECODE: cost[0], tokens: cost[1]}
                      for rows, cost in (costs or {}).items()}
        self.drafted = self.accepted = self.verified_rows = 0
        self.tokens_per_row = {k: 1.0 + k / 2 for k in self.lengths}
        # (way, rows) -> the median: seconds a token (decode), seconds a sequence (verify)
        self.measured: dict[tuple[int, int], float] = {}
        self._recent: dict[tuple[int, int], collections.deque] = {}  # its last dispatches
        self._probes: dict[int, _Probes] = {}             # rows -> its probing

    @property
    def ways(self) -> tuple[int, ...]:
        return (self.DECODE, *self.lengths)

    def estimate(self, rows: int) -> dict[int, float] | None:
        """Seconds per token of each way with `rows` rows in the batch: measured while serving
        where it has been, else from the start-up costs at that row count (or the nearest
        larger measured); None while some way has neither."""
        cost = self.costs.get(rows) or next(
            (self.costs[r] for r in sorted(self.costs) if r > rows), {})
        out = {}
        for way in self.ways:
            kept = 1.0 if way == self.DECODE else self.tokens_per_row[way]
            measured = self.measured.get((way, rows))
            if measured is None and way in cost:
                measured = cost[way] / rows
            if measured is None:
                return None
            out[way] = measured / kept
        return out

    def wanted(self, rows: int) -> int:
        """How a batch of `rows` rows (its row bucket) should go: 0 decode, k > 0 verify
        drafts of up to k tokens."""
        if self.always:
            return self.lengths[-1]
        est = self.estimate(rows)
        if est is None:
            return self.DECODE
        choice = min(est, key=lambda w: est[w] * (1 if w == self.DECODE else 1 + self.MARGIN))
        p = self._probes.setdefault(rows, _Probes(self.FIRST_PROBE, choice))
        if p.left:                      # a probe under way
            p.left -= 1
            return p.way
        if p.choice != choice:          # the choice changed: look again soon
            p.since, p.interval, p.choice = 0, self.FIRST_PROBE, choice
        p.since += 1
        if p.since < p.interval:
            return choice
        others = [w for w in self.ways if w != choice]
        p.way = others[p.count % len(others)]
        # a probe costs PROBE dispatches at (slower - 1) times the choice's time
        budget = math.ceil(self.PROBE * (est[p.way] / est[choice] - 1) / self.PROBE_BUDGET)
        p.since, p.interval = 0, min(max(2 * p.interval, budget), self.LAST_PROBE)
        p.left, p.count = self.PROBE - 1, p.count + 1
        return p.way

    def timed(self, way: int, rows: int, seconds: float, count: int) -> None:
        """A dispatch of `way` at row bucket `rows` took `seconds`: a decode dispatch (way 0)
        producing `count` tokens, a verify step (way k, drafts of up to k) of `count`
        sequences."""
        if count <= 0:
            return
        key = (way, rows)
        recent = self._recent.setdefault(key, collections.deque(maxlen=self.RECENT))
        recent.append(seconds / count)
        self.measured[key] = float(np.median(recent))

    def stepped(self, length: int, kept: list[int]) -> None:
        """A verify step at draft length `length` (or a probe that found no draft) kept `kept`
        tokens in its rows."""
        mean = sum(kept) / len(kept)
        self.tokens_per_row[length] += self.SMOOTHING * (mean - self.tokens_per_row[length])

    def draft(self, seq: Sequence, max_len: int, length: int | None = None) -> list[int]:
        """Up to `length` (default K) next tokens for `seq`, no more than its max_tokens and
        max_len leave room for (a verify step keeps one token beyond its draft)."""
        s = seq.request.sampling
        room = min(length or self.k, s.max_tokens - len(seq.tokens) - 1,
                   max_len - seq.total_len() - 1)
        return self.drafter.draft(seq, room)[:room] if room > 0 else []

    def record(self, drafted: int, kept: int) -> None:
        """A row verified a draft of `drafted` tokens and kept `kept` (the accepted ones and
        the one after)."""
        self.verified_rows += 1
        self.drafted += drafted
        self.accepted += kept - 1

    def stats(self) -> dict:
        """vLLM's speculative-decoding counters: drafts (rows that verified a draft), draft
        tokens, accepted tokens, and the mean acceptance length (tokens a verify step keeps a
        row)."""
        return {"spec_decode_num_drafts": self.verified_rows,
                "spec_decode_num_draft_tokens": self.drafted,
                "spec_decode_num_accepted_tokens": self.accepted,
                "spec_decode_mean_acceptance_length":
                    1 + self.accepted / max(self.verified_rows, 1)}

    def measure(self, engine, params, state, repeats: int = 3):
        """Times the engine's decode step and its verify step at each draft length and row
        count, the median of `repeats`, before anything is served: padding rows whose
        attention reads as many keys as a sequence halfway between the longest prompt and
        max_len holds (every page read and written is the null page); fills `costs` and
        returns the state, its slots' lengths back at 0."""
        cfg, programs = engine.cfg, engine.programs
        held = min((cfg.max_prefill_length + cfg.max_len) // 2,
                   cfg.max_len - cfg.speculative_tokens - 2)
        width = cfg.table_width(held + cfg.speculative_tokens + 1)
        lengths = state.lengths
        state = dataclasses.replace(state, lengths=jax.device_put(
            np.full(lengths.shape, held, np.int32), lengths.sharding))
        for rows in cfg.row_sizes:
            if programs.compiled and not all(programs.is_compiled(*shape) for shape in
                                             _shapes(cfg, rows, width)):
                continue        # not compiled yet (compile_all(largest_only)): not timed
            times = {}
            for way in (self.DECODE, *cfg.draft_lengths):
                runs = []
                for _ in range(repeats + 1):       # the first run warms caches
                    t0 = time.perf_counter()
                    state = _idle_call(engine, way, rows, width, params, state)
                    runs.append(time.perf_counter() - t0)
                per = cfg.steps_per_dispatch if way == self.DECODE else 1
                times[way] = float(np.median(runs[1:])) / per
            self.costs[rows] = times
        return dataclasses.replace(state, lengths=jax.device_put(
            np.zeros(lengths.shape, np.int32), lengths.sharding))


@dataclasses.dataclass
class _Probes:
    """How one row count probes the ways it does not choose."""
    interval: int               # dispatches between two probes
    choice: int                 # the way chosen when the interval was set
    since: int = 0              # dispatches since the last probe
    left: int = 0               # dispatches of the probe under way still to go
    way: int = 0                # the way it probes
    count: int = 0              # probes so far (the ways are probed in turn)


def _shapes(cfg, rows: int, width: int) -> list[tuple[str, tuple]]:
    """The programs `measure` times at `rows` rows and `width` pages."""
    k = cfg.steps_per_dispatch
    decode = ("decode", (rows, width)) if k == 1 else ("decode_steps", (rows, width, k))
    return [decode] + [("verify", (rows, width, n)) for n in cfg.draft_lengths]


def _idle_call(engine, way: int, rows: int, width: int, params, state):
    """One call of `way` (0: the decode program; k: the verify program at draft length k) with
    `rows` padding rows, waited for."""
    slots = np.arange(rows, dtype=np.int32)
    table = np.zeros((rows, width), np.int32)
    real = np.zeros((rows,), bool)
    k = engine.cfg.steps_per_dispatch
    if way == Speculator.DECODE and k == 1:
        state, out = engine.programs("decode", (rows, width), params, state, table, slots)
    elif way == Speculator.DECODE:      # multi-step dispatch: its steps, each a k-th of the call
        state, *out = engine.programs("decode_steps", (rows, width, k), params, state, table,
                                      slots, real)
    else:
        drafts = np.zeros((rows, way), np.int32)
        state, *out = engine.programs("verify", (rows, width, way), params, state, table,
                                      slots, drafts, real)
    np.asarray(out[0] if isinstance(out, list) else out)
    return state
