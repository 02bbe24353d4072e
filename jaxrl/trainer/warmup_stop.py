"""The warm-up's early stop (train.stop_at_accuracy): every train.check_every steps, greedy
accuracy on a fixed set of training problems, decoded by one engine kept for the whole warm-up
and given each check's weights as an in-flight update (no recompilation between checks).

A fixed step budget puts different seeds at different points of the supervised learning curve
(the demo's seeds cross it hundreds of steps apart); stopping at an accuracy hands RL the same
amount of room whatever the seed."""

from __future__ import annotations

import contextlib
from typing import Callable

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxrl.config import RunConfig
from jaxrl.eval.evaluate import evaluate, task_engine
from jaxrl.models import merge_params
from jaxrl.models.tokenizer import Tokenizer
from jaxrl.models.transformer import split_params
from jaxrl.rl.tasks.base import Task
from jaxrl.trainer.distributed import is_leader
from sharding.hosts import fully_addressable

_PROBLEM_STREAM = 0x5709   # seeds the check's problems apart from the warm-up's data order


class AccuracyStop:
    """`check(step, params)` after each step: the accuracy at a check step, else None. On
    several processes every one calls it: process 0 decodes, and all get its answer."""

    def __init__(self, cfg: RunConfig, task: Task, tokenizer: Tokenizer, graphdef):
        t = cfg.train
        self.target, self.every, self.last_step = t.stop_at_accuracy, t.check_every, t.steps
        rng = np.random.default_rng([t.seed, _PROBLEM_STREAM])
        self.problems = ([task.sample(rng) for _ in range(t.check_problems)]
                         if self.target else [])
        self._cfg, self._task, self._tokenizer, self._graphdef = cfg, task, tokenizer, graphdef
        self._engines = contextlib.ExitStack()
        self._orchestrator = None

    def check(self, step: int, params: Callable[[], dict]) -> float | None:
        """Greedy accuracy at `step` if it is a check step (`params()`: the weights, asked for
        only then), else None."""
        if not self.target or step % self.every or step >= self.last_step:
            return None
        params = fully_addressable(params())   # a collective: every process takes part
        accuracy = np.float32(self._decode(step, params) if is_leader() else 0.0)
        if jax.process_count() > 1:
            accuracy = multihost_utils.broadcast_one_to_all(accuracy)
        return float(accuracy)

    def _decode(self, step: int, params) -> float:
        model = merge_params(self._graphdef, params)
        if self._orchestrator is None:
            self._orchestrator = self._engines.enter_context(task_engine(
                model, self._task, self._tokenizer, self.problems,
                self._cfg.rl.max_new_tokens, self._cfg.rl))
        else:
            self._orchestrator.update_params(split_params(model)[1], version=step)
        return evaluate(self._orchestrator, self._task, self._tokenizer, len(self.problems),
                        self._cfg.rl.max_new_tokens, self._cfg.rl, self.problems)["accuracy"]

    def close(self) -> None:
        self._engines.close()
