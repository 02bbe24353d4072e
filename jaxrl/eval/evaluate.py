"""Held-out accuracy of a model on a task, decoded greedily by the serving engine (batched, on the
paged KV cache): through the RL run's own engine, or an engine started for the occasion."""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import math
from typing import Sequence

from jaxrl.models.tokenizer import Tokenizer, prompt_ids
from jaxrl.models.transformer import Transformer, split_params
from jaxrl.rl.config import RLConfig
from jaxrl.rl.env import is_multi_turn
from jaxrl.rl.rewards import Scorer
from jaxrl.rl.tasks.base import Problem, Task
from jaxrl.rollout.episodes import EpisodeGroup
from jaxrl.rollout.group import Group
from serving.core.orchestrator import InvalidRequest, Orchestrator, QueueFull
from serving.runner.engine import Engine, EngineConfig
from serving.runner.sampling import SamplingParams


def evaluate(orchestrator: Orchestrator, task: Task, tokenizer: Tokenizer, num_problems: int,
             max_new_tokens: int = 8, rl: RLConfig | None = None,
             problems: Sequence[Problem] | None = None) -> dict:
    """{"accuracy", "problems", "examples", "too_long"}: the share of held-out problems (or of
    `problems`) answered exactly, greedy, by whatever weights `orchestrator` serves. A prompt the
    engine cannot take (too long) counts as wrong and is reported in "too_long". A multi-turn
    task's problems are greedy episodes within `rl`'s turn and token limits, solved when their
    return is >= 1."""
    if problems is None:
        problems = task.held_out(num_problems)
    if is_multi_turn(task):
        return _evaluate_episodes(orchestrator, task, tokenizer, problems, rl)
    prompts = _prompts(problems, tokenizer)
    completions = greedy_completions(orchestrator, prompts, max_new_tokens)
    # A reward that raises or hangs scores the problem as unsolved (counted in reward_errors).
    scorer = Scorer(task, timeout_s=(rl or RLConfig()).reward_timeout_s,
                    max_failures=len(problems) + 1, warn=lambda _: None)
    scores, examples = [], []
    for problem, ids in zip(problems, completions):
        completion = tokenizer.decode(ids) if ids is not None else ""
        reward = scorer.group(problem, [completion]) if ids is not None else None
        scores.append(float(reward is not None and reward[0] >= 1.0))
        if len(examples) < 5:
            examples.append(f"{problem.prompt}{completion}")
    return {"accuracy": sum(scores) / max(len(scores), 1), "problems": len(scores),
            "examples": examples, "too_long": sum(c is None for c in completions),
            "reward_errors": scorer.failures}


def _evaluate_episodes(generation, task, tokenizer, problems: Sequence[Problem],
                       rl: RLConfig) -> dict:
    prompts = _prompts(problems, tokenizer)
    groups = [EpisodeGroup(generation, task, tokenizer, Group(i, problem, prompt, seed=i), rl,
                           temperature=0.0) for i, (problem, prompt) in
              enumerate(zip(problems, prompts))]
    with concurrent.futures.ThreadPoolExecutor(32, thread_name_prefix="eval-episode") as pool:
        episodes = [t[0] for t in pool.map(lambda g: g.run(), groups)]
    return {"accuracy": sum(e.episode_return >= 1 for e in episodes) / max(len(episodes), 1),
            "problems": len(episodes),
            "examples": [p.prompt + tokenizer.decode(e.tokens) for p, e in
                         zip(problems[:5], episodes)],
            "too_long": 0,
            "turns_mean": sum(len(e.turns) for e in episodes) / max(len(episodes), 1)}


def evaluate_model(model: Transformer, task: Task, tokenizer: Tokenizer, num_problems: int,
                   max_new_tokens: int = 8, rl: RLConfig | None = None) -> dict:
    """`evaluate` on an engine started for `model` alone."""
    problems = task.held_out(num_problems)
    with task_engine(model, task, tokenizer, problems, max_new_tokens, rl) as o:
        return evaluate(o, task, tokenizer, num_problems, max_new_tokens, rl, problems)


@contextlib.contextmanager
def task_engine(model: Transformer, task: Task, tokenizer: Tokenizer,
                problems: Sequence[Problem], max_new_tokens: int, rl: RLConfig | None):
    """A started Orchestrator serving `model`, sized for `problems` (a multi-turn task's: for
    `rl`'s episodes)."""
    longest, new = max(map(len, _prompts(problems, tokenizer))), max_new_tokens
    if is_multi_turn(task):
        longest, new = rl.prefill_len, rl.episode_tokens
    with local_engine(model, tokenizer.eos_id, longest, new) as orchestrator:
        yield orchestrator


def greedy_completions(orchestrator: Orchestrator, prompts: Sequence[list[int]],
                       max_new_tokens: int) -> list[list[int] | None]:
    """Greedy completions, each cut before its EOS; None for a prompt the engine refuses. When
    the engine's queue is full (it may be busy with rollouts), waits for the oldest request of
    this call before submitting more."""
    eos = orchestrator.eos_id
    sampling = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    out: list[list[int] | None] = [None] * len(prompts)
    pending: collections.deque = collections.deque()   # (index, stream), oldest first

    def collect():
        i, stream = pending.popleft()
        tokens = stream.result()[0].tokens
        out[i] = tokens[: tokens.index(eos)] if eos in tokens else tokens

    for i, ids in enumerate(prompts):
        while True:
            try:
                pending.append((i, orchestrator.submit(ids, sampling)))
                break
            except InvalidRequest:
                break
            except QueueFull:
                if not pending:
                    raise
                collect()
    while pending:
        collect()
    return out


@contextlib.contextmanager
def local_engine(model: Transformer, eos_id: int | None, longest_prompt: int,
                 max_new_tokens: int, slots: int = 64):
    """A started Orchestrator serving `model` (its dtype), sized for prompts of up to
    `longest_prompt` tokens and `max_new_tokens` more."""
    chunk = min(1 << max(longest_prompt - 1, 7).bit_length(), 512)
    cfg = EngineConfig(max_concurrent_decodes=slots, max_len=longest_prompt + max_new_tokens,
                       max_prefill_length=longest_prompt, prefill_chunk=chunk,
                       prefill_budget=max(chunk, 256), dtype=model.cfg.dtype,
                       page_size=min(16, 1 << math.ceil(math.log2(longest_prompt + 1))))
    engine = Engine(model.cfg, cfg)
    with Orchestrator(engine, split_params(model)[1], eos_id=eos_id,
                      max_queued=4 * slots) as orchestrator:
        yield orchestrator


def _prompts(problems, tokenizer: Tokenizer) -> list[list[int]]:
    return [prompt_ids(tokenizer, p.prompt) for p in problems]
