"""When the engine loop speculates, and what it proposes: the drafter (serving/core/drafts.py)
and the load rule.

A verify step of R rows feeds K+1 tokens a row where a decode step feeds one; it pays when the
tokens it keeps a row (1 + the accepted draft tokens) outweigh its cost over a decode step's.
In a full batch a step is bound by compute and a wider one costs about K+1 times as much: no
drafting. In the tail a step's cost is fixed per step (reading the weights on an accelerator,
dispatch and host work here) and a wider one costs little more: draft (FastGRPO's
concurrency-aware rule). The rule compares seconds per generated token of the two ways at the
batch's row count, as the engine measures them:

- at start-up (`measure`), its compiled decode and verify programs timed on this device per
  row count, the verify step's divided by the tokens a row is expected to keep
  (`tokens_per_row`: a moving average over verify steps from an optimistic prior, half the
  draft accepted; a row that found no draft counts as one);
- while it serves (`timed`), each dispatch's wall time over the tokens it produced, an average
  per way and row count (the mean of the first 1/SMOOTHING dispatches, then a moving average)
  that replaces the start-up figure once there is one. It holds what the programs' timings
  leave out: host work, drafting, attention over the rows' real lengths, and the overlap a
  speculating dispatch gives up (its drafts continue the tokens read back). Each way is
  charged its own work only: a verify step from after it read back the decode step in flight,
  a decode step only when it read back the one before it (the first after a verify step,
  which overlaps nothing yet, is not timed).

    speculate with R rows  <=>  seconds per token verifying(R) < decoding(R)

Now and then PROBE dispatches in a row go the other way (two: the first of a switch to
decoding is not timed), so that both averages follow the text being written (a tail that turns
repetitive, a batch that fills): after FIRST_PROBE dispatches at a row count, then at intervals
that double while the choice holds (up to LAST_PROBE, so that a way that does not pay costs
little), back to FIRST_PROBE when the choice changes.
"""

from __future__ import annotations

import time

import numpy as np

from serving.core.drafts import Drafter
from serving.core.sequence import Sequence


class Speculator:
    """The drafter, the load rule and what speculation has done (`stats`)."""

    FIRST_PROBE, LAST_PROBE = 8, 512    # dispatches between two probes of the other way
    PROBE = 2                 # dispatches a probe lasts
    SMOOTHING = 0.1           # weight of one dispatch in the moving averages

    def __init__(self, drafter: Drafter, tokens: int, costs: dict[int, tuple[float, float]]
                 | None = None, always: bool = False):
        """`tokens`: the most draft tokens a row verifies (EngineConfig.speculative_tokens).
        `costs`: {rows: (decode step s, verify step s)} (`measure` fills it); `always`:
        speculate at any load (tests of exactness)."""
        self.drafter, self.k, self.always = drafter, tokens, always
        self.costs = dict(costs or {})
        self.drafted = self.accepted = self.verified_rows = 0
        self.tokens_per_row = 1.0 + tokens / 2
        self.seconds_per_token: dict[tuple[str, int], float] = {}   # (way, rows) -> average
        self._timed: dict[tuple[str, int], int] = {}                # (way, rows) -> dispatches
        # rows -> [since the last probe, interval, choice, probe dispatches left]
        self._probes: dict[int, list] = {}

    def estimate(self, rows: int) -> tuple[float, float] | None:
        """(decoding, verifying) seconds per token with `rows` rows in the batch: measured
        while serving where it has been, else from the start-up costs at that row count (or
        the nearest larger measured); None before anything is measured."""
        cost = self.costs.get(rows) or next(
            (self.costs[r] for r in sorted(self.costs) if r > rows), None)
        prior = (None, None) if cost is None else (
            cost[0] / rows, cost[1] / (rows * self.tokens_per_row))
        plain = self.seconds_per_token.get(("decode", rows), prior[0])
        verify = self.seconds_per_token.get(("verify", rows), prior[1])
        return None if plain is None or verify is None else (plain, verify)

    def wanted(self, rows: int) -> bool:
        """Whether a batch of `rows` rows (its row bucket) should verify drafts."""
        if self.always:
            return True
        est = self.estimate(rows)
        if est is None:
            return False
        choice = est[1] < est[0]
        probe = self._probes.setdefault(rows, [0, self.FIRST_PROBE, choice, 0])
        if probe[3]:                    # a probe under way
            probe[3] -= 1
            return not probe[2]
        if probe[2] != choice:          # the choice changed: look again soon
            probe[:] = [0, self.FIRST_PROBE, choice, 0]
        probe[0] += 1
        if probe[0] >= probe[1]:
            probe[0], probe[1] = 0, min(2 * probe[1], self.LAST_PROBE)
            probe[3] = self.PROBE - 1
            return not choice
        return choice

    def timed(self, way: str, rows: int, seconds: float, tokens: int) -> None:
        """A dispatch of `way` ("decode", "verify") with `rows` rows took `seconds` and
        produced `tokens` tokens."""
        if tokens <= 0:
            return
        x, key = seconds / tokens, (way, rows)
        n = self._timed[key] = self._timed.get(key, 0) + 1
        old = self.seconds_per_token.get(key, x)
        self.seconds_per_token[key] = old + max(self.SMOOTHING, 1 / n) * (x - old)

    def stepped(self, kept: list[int]) -> None:
        """A verify step (or a probe that found no draft) kept `kept` tokens in its rows."""
        mean = sum(kept) / len(kept)
        self.tokens_per_row += self.SMOOTHING * (mean - self.tokens_per_row)

    def draft(self, seq: Sequence, max_len: int) -> list[int]:
        """Up to K next tokens for `seq`, no more than its max_tokens and max_len leave room
        for (a verify step keeps one token beyond its draft)."""
        s = seq.request.sampling
        room = min(self.k, s.max_tokens - len(seq.tokens) - 1, max_len - seq.total_len() - 1)
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
        """Times the engine's decode step and its verify step at each row count, on an idle
        state (padding rows only: every page read and written is the null page, no slot's
        state changes), the median of `repeats`; fills `costs` and returns the state."""
        cfg, programs = engine.cfg, engine.programs
        width = cfg.table_width(cfg.page_size)
        for rows in cfg.row_sizes:
            if programs.compiled and not all(programs.is_compiled(*shape) for shape in
                                             _shapes(cfg, rows, width)):
                continue        # not compiled yet (compile_all(largest_only)): not timed
            times = []
            for name in ("decode", "verify"):
                runs = []
                for _ in range(repeats + 1):       # the first run warms caches
                    t0 = time.perf_counter()
                    state = _idle_call(engine, name, rows, width, params, state)
                    runs.append(time.perf_counter() - t0)
                per = cfg.steps_per_dispatch if name == "decode" else 1
                times.append(float(np.median(runs[1:])) / per)
            self.costs[rows] = (times[0], times[1])
        return state


def _shapes(cfg, rows: int, width: int) -> list[tuple[str, tuple]]:
    """The programs `measure` times at `rows` rows and `width` pages."""
    k = cfg.steps_per_dispatch
    decode = ("decode", (rows, width)) if k == 1 else ("decode_steps", (rows, width, k))
    return [decode, ("verify", (rows, width, cfg.speculative_tokens))]


def _idle_call(engine, name: str, rows: int, width: int, params, state):
    """One call of program `name` with `rows` padding rows, waited for."""
    slots = np.arange(rows, dtype=np.int32)
    table = np.zeros((rows, width), np.int32)
    real = np.zeros((rows,), bool)
    k = engine.cfg.steps_per_dispatch
    if name == "decode" and k == 1:
        state, out = engine.programs("decode", (rows, width), params, state, table, slots)
    elif name == "decode":      # multi-step dispatch: its steps, each a k-th of the call
        state, *out = engine.programs("decode_steps", (rows, width, k), params, state, table,
                                      slots, real)
    else:
        drafts = np.zeros((rows, engine.cfg.speculative_tokens), np.int32)
        state, *out = engine.programs("verify", (rows, width, engine.cfg.speculative_tokens),
                                      params, state, table, slots, drafts, real)
    np.asarray(out[0] if isinstance(out, list) else out)
    return state
