"""The built-in demo task: integer arithmetic such as `37+45=` -> `82`, checked exactly.

A fixed, hash-selected fraction of all (a, op, b) triples is held out for evaluation and never
sampled for training, so accuracy on it measures generalisation, not memorisation.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Literal

import numpy as np

from jaxrl.errors import UserError
from jaxrl.rl.tasks.base import Problem


@dataclasses.dataclass(frozen=True)
class ArithmeticConfig:
    """The demo task's problem space."""

    name: Literal["arithmetic"] = "arithmetic"  # two-operand arithmetic (the demo)
    max_operand: int = 99                   # operands are drawn from [0, max_operand]
    ops: tuple[str, ...] = ("+", "-")       # any of + - *
    held_out_percent: int = 5               # share of triples reserved for evaluation
    # Reward for a wrong answer: half the share of its characters that match the answer's,
    # aligned from the units digit (a dense signal a small model can climb); false: 0.
    partial_credit: bool = True

    def __post_init__(self):
        if self.max_operand < 1:
            raise ValueError(f"task.max_operand={self.max_operand} must be >= 1")
        bad = [op for op in self.ops if op not in "+-*"]
        if bad or not self.ops:
            raise ValueError(f"task.ops={list(self.ops)} must be a non-empty list of '+', '-', '*'")
        if not 1 <= self.held_out_percent <= 50:
            raise ValueError(f"task.held_out_percent={self.held_out_percent} must be in [1, 50]")


class ArithmeticTask:
    name = "arithmetic"
    alphabet = "0123456789+-*="

    def __init__(self, cfg: ArithmeticConfig = ArithmeticConfig()):
        self.cfg = cfg

    def _is_held_out(self, a: int, op: str, b: int) -> bool:
        digest = hashlib.blake2b(f"{a}{op}{b}".encode(), digest_size=4).digest()
        return int.from_bytes(digest, "little") % 100 < self.cfg.held_out_percent

    @staticmethod
    def _problem(a: int, op: str, b: int) -> Problem:
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        return Problem(prompt=f"{a}{op}{b}=", answer=str(value))

    def sample(self, rng: np.random.Generator) -> Problem:
        while True:
            a, b = (int(x) for x in rng.integers(0, self.cfg.max_operand + 1, size=2))
            op = self.cfg.ops[int(rng.integers(len(self.cfg.ops)))]
            if not self._is_held_out(a, op, b):
                return self._problem(a, op, b)

    warmup_sample = sample   # the warm-up sees the whole problem space

    def held_out(self, n: int) -> list[Problem]:
        m = self.cfg.max_operand
        total = sum(self._is_held_out(a, op, b)
                    for a in range(m + 1) for op in self.cfg.ops for b in range(m + 1))
        if n > total:
            raise UserError(f"train.eval_problems={n} exceeds the {total} held-out problems of "
                            f"task.max_operand={m}, task.ops={list(self.cfg.ops)}")
        rng = np.random.default_rng(12345)
        out, seen = [], set()
        while len(out) < n:
            a, b = (int(x) for x in rng.integers(0, self.cfg.max_operand + 1, size=2))
            op = self.cfg.ops[int(rng.integers(len(self.cfg.ops)))]
            if self._is_held_out(a, op, b) and (a, op, b) not in seen:
                seen.add((a, op, b))
                out.append(self._problem(a, op, b))
        return out

    def max_text_length(self) -> int:
        """Characters in the longest prompt plus answer."""
        m = self.cfg.max_operand
        longest = max(len(self._problem(m, op, m).answer) for op in self.cfg.ops)
        return 2 * len(str(m)) + 2 + max(longest, len(str(-m)))

    def score(self, problem: Problem, completion: str) -> float:
        """1.0 for the exact answer; otherwise 0, or partial credit (see the config)."""
        got, want = completion.strip(), problem.answer
        if got == want:
            return 1.0
        if not self.cfg.partial_credit or not got:
            return 0.0
        matches = sum(a == b for a, b in zip(reversed(got), reversed(want)))
        return 0.5 * matches / max(len(got), len(want))
