"""A long-tailed reasoning-length task that runs on CPU: count down in binary, every step written.

    prompt  00101101>00101001:        (from b = 45 down to a = 41, 8-bit numbers)
    answer  00101100,00101011,00101010,00101001

The answer lists b-1, b-2, ..., a: n = b - a numbers of 9 characters each (8 bits and a comma),
so its length is 9n - 1 tokens. n is drawn log-normally, most problems take a handful of
steps and a few take up to `max_steps` (1,619 tokens at the default 180): the long tail of
reasoning RL, with a reward checked exactly. Each step is a local rule (decrement a binary
number: flip the trailing zeros and the last one) and the stop is local too (the number just
written equals the prompt's a), so a small model can learn the rule on short problems in the
supervised warm-up and RL has to make it reliable over hundreds of steps.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Literal

import numpy as np

from jaxrl.errors import UserError
from jaxrl.rl.tasks.base import Problem

BITS = 8


@dataclasses.dataclass(frozen=True)
class CountdownConfig:
    """The countdown task's length distribution."""

    name: Literal["countdown"] = "countdown"  # count down in binary
    median_steps: float = 8.0       # n ~ log-normal with this median ...
    sigma: float = 1.1              # ... and this log-space spread (the tail's weight)
    max_steps: int = 180            # n is clipped to [1, max_steps]; answers up to 9n-1 tokens
    warmup_max_steps: int = 24      # the supervised warm-up only sees n up to this
    held_out_percent: int = 5       # share of (a, n) pairs reserved for evaluation
    # Reward for a wrong answer: half the share of the expected numbers written correctly
    # before the first mistake, over the expected or the written count, whichever is larger (a
    # dense signal on long answers that never pays for writing past the end); false: 0.
    partial_credit: bool = True

    def __post_init__(self):
        if not 1 <= self.max_steps < 2**BITS:
            raise ValueError(f"task.max_steps={self.max_steps} must be in [1, {2**BITS - 1}]")
        if not 1 <= self.warmup_max_steps <= self.max_steps:
            raise ValueError(f"task.warmup_max_steps={self.warmup_max_steps} must be in "
                             f"[1, task.max_steps={self.max_steps}]")
        if self.median_steps < 1 or self.sigma <= 0:
            raise ValueError(f"task.median_steps={self.median_steps} must be >= 1 and "
                             f"task.sigma={self.sigma} > 0")
        if not 1 <= self.held_out_percent <= 50:
            raise ValueError(f"task.held_out_percent={self.held_out_percent} must be in [1, 50]")


def _bits(x: int) -> str:
    return format(x, f"0{BITS}b")


class CountdownTask:
    name = "countdown"
    alphabet = "01>:,"

    def __init__(self, cfg: CountdownConfig = CountdownConfig()):
        self.cfg = cfg

    @staticmethod
    def problem(a: int, n: int) -> Problem:
        return Problem(prompt=f"{_bits(a + n)}>{_bits(a)}:",
                       answer=",".join(_bits(x) for x in range(a + n - 1, a - 1, -1)))

    def _is_held_out(self, a: int, n: int) -> bool:
        digest = hashlib.blake2b(f"{a}:{n}".encode(), digest_size=4).digest()
        return int.from_bytes(digest, "little") % 100 < self.cfg.held_out_percent

    def _draw(self, rng: np.random.Generator, max_steps: int) -> tuple[int, int]:
        n = int(np.clip(round(math.exp(rng.normal(math.log(self.cfg.median_steps),
                                                  self.cfg.sigma))), 1, max_steps))
        return int(rng.integers(0, 2**BITS - n)), n

    def sample(self, rng: np.random.Generator) -> Problem:
        while True:
            a, n = self._draw(rng, self.cfg.max_steps)
            if not self._is_held_out(a, n):
                return self.problem(a, n)

    def warmup_sample(self, rng: np.random.Generator) -> Problem:
        """Short problems only (n <= warmup_max_steps): the rule, not the tail."""
        while True:
            a, n = self._draw(rng, self.cfg.warmup_max_steps)
            if not self._is_held_out(a, n):
                return self.problem(a, n)

    def held_out(self, n: int) -> list[Problem]:
        """Held-out problems drawn from the training distribution (the tail included)."""
        total = sum(self._is_held_out(a, k) for k in range(1, self.cfg.max_steps + 1)
                    for a in range(2**BITS - k))
        if n > total:
            raise UserError(f"train.eval_problems={n} exceeds the {total} held-out problems of "
                            f"task.max_steps={self.cfg.max_steps}")
        rng = np.random.default_rng(12345)
        out, seen = [], set()
        while len(out) < n:
            a, k = self._draw(rng, self.cfg.max_steps)
            if self._is_held_out(a, k) and (a, k) not in seen:
                seen.add((a, k))
                out.append(self.problem(a, k))
        return out

    def score(self, problem: Problem, completion: str) -> float:
        """1.0 for the exact countdown; otherwise 0, or partial credit (see the config)."""
        got, want = completion.strip(), problem.answer
        if got == want:
            return 1.0
        if not self.cfg.partial_credit:
            return 0.0
        expected, written = want.split(","), got.split(",")
        correct = 0
        for e, w in zip(expected, written):
            if e != w:
                break
            correct += 1
        return 0.5 * correct / max(len(expected), len(written))
