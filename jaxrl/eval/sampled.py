"""pass@k, avg@k and maj@k on a task's held-out problems, as Tunix, verl and NeMo-RL report them:
n samples per problem at a sampling temperature, each scored by the task's own reward (a math
task's is math-verify), a sample counting as correct when its reward is 1.

- pass@k: the unbiased estimator of Chen et al. (2021), 1 - C(n - c, k) / C(n, k) for a problem
  with c correct samples of n, averaged over problems (k <= n);
- avg@n: the mean share of correct samples (the expected accuracy of one sample);
- maj@n: a problem counts as solved when its most common answer (the task's `answer_key` of a
  completion when it has one, else the stripped completion text; ties to the answer seen first)
  is a correct one.

Samples are drawn by the serving engine, one request of n samples per problem, each problem
seeded by its index, so a run repeats exactly."""

from __future__ import annotations

import collections
import dataclasses
from math import comb
from typing import Sequence

from jaxrl.models.tokenizer import Tokenizer, prompt_ids
from jaxrl.rl.config import RLConfig
from jaxrl.rl.rewards import Scorer
from jaxrl.rl.tasks.base import Problem, Task
from serving.core.orchestrator import InvalidRequest, QueueFull
from serving.runner.sampling import SamplingParams


def pass_at_k(n: int, c: int, k: int) -> float:
    """The probability that at least one of k samples drawn without replacement from n, c of
    them correct, is correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    return 1.0 if n - c < k else 1.0 - comb(n - c, k) / comb(n, k)


def majority_correct(completions: Sequence[str], correct: Sequence[bool], key) -> bool:
    """Whether the most common answer among `completions` (by `key`) is a correct one."""
    keys = [key(c) for c in completions]
    counts = collections.Counter(keys)
    winner = max(keys, key=counts.__getitem__)        # the first of the most common
    return any(ok for k, ok in zip(keys, correct) if k == winner)


def sampled_eval(orchestrator, task: Task, tokenizer: Tokenizer, problems: Sequence[Problem],
                 sampling: SamplingParams, ks: Sequence[int], rl: RLConfig | None = None
                 ) -> dict:
    """{"pass@k" for k in ks, "avg@n", "maj@n", "problems", "samples", "too_long",
    "reward_errors"} over `problems`, each sampled n times as `sampling` says (problem i with
    seed i)."""
    n, temperature = sampling.n, sampling.temperature
    bad = [k for k in ks if not 1 <= k <= n]
    if bad:
        raise ValueError(f"--k {bad}: each k must be in [1, --samples={n}]")
    slots = orchestrator.engine.cfg.max_concurrent_decodes
    if n > slots:
        raise ValueError(f"--samples {n} exceeds the engine's {slots} slots (a problem's "
                         f"samples decode side by side)")
    if temperature <= 0 and n > 1:
        raise ValueError(f"--samples {n} at temperature {temperature}: greedy samples are all "
                         f"the same; sample at a temperature above 0")
    scorer = Scorer(task, timeout_s=(rl or RLConfig()).reward_timeout_s,
                    max_failures=len(problems) + 1, warn=lambda _: None)
    key = getattr(task, "answer_key", None) or (lambda text: text.strip())
    eos = orchestrator.eos_id
    per_problem: list = [None] * len(problems)     # (correct flags, completions) per problem
    pending: collections.deque = collections.deque()
    too_long = 0

    def collect():
        i, stream = pending.popleft()
        texts = [tokenizer.decode(s.tokens[: s.tokens.index(eos)] if eos in s.tokens
                                  else s.tokens) for s in stream.result()]
        rewards = scorer.group(problems[i], texts)
        correct = [False] * n if rewards is None else [float(r) >= 1.0 for r in rewards]
        per_problem[i] = (correct, texts)

    for i, problem in enumerate(problems):
        while True:
            try:
                pending.append((i, orchestrator.submit(prompt_ids(tokenizer, problem.prompt),
                                                       dataclasses.replace(sampling, seed=i))))
                break
            except InvalidRequest:       # the engine cannot take the prompt: all wrong
                per_problem[i], too_long = ([False] * n, [""] * n), too_long + 1
                break
            except QueueFull:            # the engine is busy: wait for the oldest first
                if not pending:
                    raise
                collect()
    while pending:
        collect()
    count = max(len(per_problem), 1)
    out = {f"pass@{k}": sum(pass_at_k(n, sum(c), k) for c, _ in per_problem) / count
           for k in sorted(set(ks))}
    out[f"avg@{n}"] = sum(sum(c) / n for c, _ in per_problem) / count
    out[f"maj@{n}"] = sum(majority_correct(t, c, key) for c, t in per_problem) / count
    out.update(problems=len(per_problem), samples=n, temperature=temperature,
               too_long=too_long, reward_errors=scorer.failures)
    return out
