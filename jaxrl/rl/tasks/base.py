"""The task API: where problems come from, how a prompt is written, how a completion scores."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Protocol, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Problem:
    prompt: str   # what the model is given
    answer: str   # the reference answer (also the supervised warm-up target)
    # The rest of the problem's row (a custom task's data set), passed to its reward.
    fields: Mapping[str, Any] = dataclasses.field(default_factory=dict, hash=False)


class Task(Protocol):
    name: str

    def sample(self, rng: np.random.Generator) -> Problem:
        """A training problem (never one of the held-out problems)."""

    def warmup_sample(self, rng: np.random.Generator) -> Problem:
        """A problem for the supervised warm-up: `sample`'s, or a narrower share of them (a
        long-tailed task keeps the tail for RL)."""

    def held_out(self, n: int) -> list[Problem]:
        """The first `n` held-out evaluation problems, the same on every call."""

    def score(self, problem: Problem, completion: str) -> float:
        """Reward in [0, 1] for `completion` (the text after the prompt, before EOS); 1.0 means
        correct, which is what accuracy counts."""


class GroupScoredTask(Task, Protocol):
    """A task that scores a group's completions together (a batched reward, TRL's form);
    jaxrl/rl/rewards.py calls `score_group` when a task has it, else `score` per sample."""

    def score_group(self, problem: Problem, completions: Sequence[str]) -> Sequence[float]:
        """One reward per completion, in order."""
