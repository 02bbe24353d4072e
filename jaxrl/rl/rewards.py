"""Scoring completions with a task's reward, safely: a user's reward function that raises or
hangs costs its group, not the run.

Each group is scored on a daemon thread of its own, under a deadline (`rl.reward_timeout_s`). A
group whose reward raises or outlives the deadline is dropped and reported with the sample that
caused it; the run stops, with that report, only after `rl.max_reward_failures` groups in a row
failed. A hung reward's thread cannot be stopped from Python: it is left running as a daemon
(it cannot keep the process from exiting) and the next group gets a thread of its own.
"""

from __future__ import annotations

import math
import threading
import traceback
from typing import Callable, Sequence

import numpy as np

from jaxrl.errors import UserError
from jaxrl.rl.tasks.base import Problem, Task


class RewardFailure(UserError):
    """The reward failed on `rl.max_reward_failures` groups in a row; names the last sample."""


def score_samples(task: Task, problem: Problem, completions: Sequence[str]) -> np.ndarray:
    """The task's rewards for `completions` of `problem`: its `score_group` when it has one (a
    batched reward), else `score` per completion. Raises ValueError for a batch of the wrong
    length and for a reward that is not a finite number."""
    group = getattr(task, "score_group", None)
    rewards = (list(group(problem, list(completions))) if group is not None
               else [task.score(problem, c) for c in completions])
    if len(rewards) != len(completions):
        raise ValueError(f"the reward returned {len(rewards)} values for {len(completions)} "
                         f"completions")
    out = []
    for r in rewards:
        if isinstance(r, bool) or not isinstance(r, (int, float, np.number)) \
                or not math.isfinite(float(r)):
            raise ValueError(f"the reward returned {r!r}; a reward is a finite number")
        out.append(float(r))
    return np.asarray(out, np.float32)


def _excerpt(text: str, limit: int = 160) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


class Scorer:
    """`group(problem, completions)`: the rewards, or None when the reward failed on the group
    (reported through `warn`). Thread-safe: the actor's collectors call it concurrently."""

    def __init__(self, task: Task, *, timeout_s: float, max_failures: int,
                 warn: Callable[[str], None] = print):
        self.task, self.timeout_s, self.max_failures = task, timeout_s, max_failures
        self._warn = warn
        self._lock = threading.Lock()   # guards the three counters below
        self.failures = 0               # groups whose reward failed, over the run
        self._in_a_row = 0
        self._last_report = ""

    def group(self, problem: Problem, completions: Sequence[str]) -> np.ndarray | None:
        result: list = []

        def call():
            try:
                result.append(score_samples(self.task, problem, completions))
            except BaseException as e:      # reported below, on the caller's thread
                result.append(e)

        thread = threading.Thread(target=call, name="reward", daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        if result and isinstance(result[0], np.ndarray):
            with self._lock:
                self._in_a_row = 0
            return result[0]
        why = (f"took longer than rl.reward_timeout_s={self.timeout_s:g} s" if not result else
               "raised " + "".join(traceback.format_exception_only(result[0])).strip())
        self._failed(problem, completions, why)
        return None

    def _failed(self, problem: Problem, completions: Sequence[str], why: str) -> None:
        report = (f"the reward {why} on the prompt {_excerpt(problem.prompt)} with the "
                  f"completion {_excerpt(completions[0] if completions else '')}"
                  + (f" (and {len(completions) - 1} more of its group)"
                     if len(completions) > 1 else "")
                  + (f", fields {_excerpt(repr(dict(problem.fields)))}" if problem.fields
                     else ""))
        with self._lock:
            self.failures += 1
            self._in_a_row += 1
            in_a_row, total = self._in_a_row, self.failures
            self._last_report = report
        if in_a_row >= self.max_failures:
            raise RewardFailure(f"{report}; that is {in_a_row} groups in a row whose reward "
                                f"failed (rl.max_reward_failures={self.max_failures}): the run "
                                f"stops. Fix the reward or raise rl.max_reward_failures")
        if total <= 5 or total % 50 == 0:
            self._warn(f"reward: {report}; its group is dropped ({total} groups so far, "
                       f"{in_a_row} in a row; the run stops at rl.max_reward_failures="
                       f"{self.max_failures} in a row)")
