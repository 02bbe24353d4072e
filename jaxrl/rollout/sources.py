"""Where the actor's groups come from: one interface (`GroupSource`), three sources.

- `Completions`: a single-turn task's group is one request with n = group_size samples of one
  prompt (one prefill), scored by the task's reward.
- `EnvEpisodes`: a multi-turn task's group is n episodes run turn by turn against the task's
  environment (jaxrl/rollout/episodes.py), each scored by its return.
- `AgentEpisodes`: with rl.agent, external agent programs run the episodes through the
  OpenAI-compatible endpoint (jaxrl/rollout/agents.py).

A source `open`s a group and `collect`s it (waits for its end and scores it). What a
checkpoint keeps of a group in flight is `carry(handle)`, JSON, which `open` takes back to
continue the group rather than generate it again: a single-turn group's samples so far, an
episode group's histories and current turns.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Callable

import numpy as np

from jaxrl.data.rollouts import Rollout
from jaxrl.errors import UserError
from jaxrl.models.tokenizer import Tokenizer, prompt_ids
from jaxrl.rl.advantages import turn_advantages
from jaxrl.rl.config import RLConfig
from jaxrl.rl.env import Trajectory, is_multi_turn
from jaxrl.rl.rewards import Scorer
from jaxrl.rl.tasks.base import Problem, Task
from jaxrl.rollout.episodes import EpisodeGroup
from jaxrl.rollout.group import Group
from serving.core.stream import FINISHED, Sample
from serving.fleet.generation import Generation
from serving.runner.sampling import SamplingParams


@dataclasses.dataclass(frozen=True)
class ScoredGroup:
    """A finished group, scored: each rollout's reward [n], its length in tokens, and its
    (finish reason, the rollout given its advantage), in order."""

    rewards: np.ndarray
    lengths: list[int]
    candidates: list[tuple[str, Callable[[float], Rollout]]]


class GroupSource:
    """What every source shares: the task problems come from, the tokenizer, the generation
    the groups run on, and rl's settings. Subclasses say how a group runs."""

    def __init__(self, generation: Generation, task: Task, tokenizer: Tokenizer, cfg: RLConfig):
        self.generation, self.task, self.tokenizer, self.cfg = generation, task, tokenizer, cfg

    def problem(self, seed: int, index: int) -> Problem:
        """Problem `index` of the stream: a pure function of (seed, index), so the stream
        resumes by index alone."""
        return self.task.sample(np.random.default_rng((seed, index, 1)))

    def prompt(self, problem: Problem) -> list[int]:
        return prompt_ids(self.tokenizer, problem.prompt)

    @property
    def slots(self) -> int:
        """The slots of the engines generating now (rl.engine.max_concurrent_decodes for a bare
        engine)."""
        return getattr(self.generation, "slots", None) or self.cfg.engine.max_concurrent_decodes

    def open(self, group: Group, carry):
        """Starts the group's rollouts, continuing `carry` (None: from the start); returns its
        handle."""
        raise NotImplementedError

    def carry(self, handle):
        """What a checkpoint keeps of a group in flight (JSON), for `open` to continue."""
        raise NotImplementedError

    def carried_tokens(self, carry) -> int:
        """Tokens generated of a group in flight, as `carry` holds them."""
        raise NotImplementedError

    def collect(self, handle, group: Group, stats: Counter) -> tuple[bool, ScoredGroup | None]:
        """Waits for the group's end: (complete, the group scored). Incomplete: cut short
        (shutdown, a lost engine), it stays in flight. Complete with None: nothing of it can
        be trained on (counted in `stats`)."""
        raise NotImplementedError


class Completions(GroupSource):
    """A single-turn task: n completions of one prompt, scored by the task's reward."""

    def __init__(self, generation: Generation, task: Task, tokenizer: Tokenizer, cfg: RLConfig,
                 warn: Callable[[str], None] = print):
        super().__init__(generation, task, tokenizer, cfg)
        self.scorer = Scorer(task, timeout_s=cfg.reward_timeout_s,
                             max_failures=cfg.max_reward_failures, warn=warn)

    def open(self, group: Group, carry):
        sampling = SamplingParams(temperature=self.cfg.temperature, n=self.cfg.group_size,
                                  seed=group.seed, **self._length_limits(group.problem))
        samples = None if carry is None else [Sample(**s) for s in carry]
        oracle = len(self.tokenizer.encode(group.problem.answer)) + 1 \
            if self.cfg.admission == "longest_first_oracle" else None
        return self.generation.submit(group.prompt, sampling, carry=samples,
                                      predicted_len=oracle)

    def carry(self, stream) -> list[dict]:
        return [dataclasses.asdict(s) for s in stream.snapshot()]

    def carried_tokens(self, carry) -> int:
        return sum(len(s["tokens"]) for s in carry)

    def _length_limits(self, problem: Problem) -> dict:
        """max_tokens (and min_tokens) of a problem's samples: rl.completion_length."""
        budget = self.cfg.max_new_tokens
        if self.cfg.completion_length == "free":
            return {"max_tokens": budget}
        answer = len(self.tokenizer.encode(problem.answer))
        return {"max_tokens": min(answer + 1, budget), "min_tokens": min(answer, budget - 1)}

    def collect(self, stream, group: Group, stats: Counter) -> tuple[bool, ScoredGroup | None]:
        samples = stream.result()
        if not all(s.finish_reason in FINISHED for s in samples):
            return False, None
        eos = self.tokenizer.eos_id
        completions = [self.tokenizer.decode(s.tokens[:-1] if s.tokens and s.tokens[-1] == eos
                                             else s.tokens) for s in samples]
        if self.cfg.moe_routing == "replay" and any(s.routes is None for s in samples):
            raise UserError("rl.moe_routing=replay: a generation server sent samples without "
                            "their routing; start `jaxrl serve` with --record-routes")
        rewards = self.scorer.group(group.problem, completions)
        if rewards is None:      # reported by the scorer; the run goes on without the group
            stats["dropped_reward_error"] += len(samples)
            return True, None
        return True, ScoredGroup(rewards, [len(s.tokens) for s in samples], [
            (s.finish_reason, lambda a, s=s, r=r: Rollout(
                prompt=list(group.prompt), completion=list(s.tokens),
                logprobs=list(s.logprobs), versions=list(s.versions), reward=float(r),
                advantage=float(a), group=group.index, finish=s.finish_reason,
                routes=s.routes)) for s, r in zip(samples, rewards)])


class Episodes(GroupSource):
    """A group of episodes, each scored by its return (per turn with
    rl.turn_advantage=per_turn)."""

    def carry(self, group) -> dict:
        return group.snapshot()

    def carried_tokens(self, carry) -> int:
        return sum(len(t["tokens"]) for t in carry["trajectories"]) + sum(
            len(s["tokens"]) for s in carry["turns"] if s)

    def collect(self, group_run, group: Group, stats: Counter
                ) -> tuple[bool, ScoredGroup | None]:
        trajectories = group_run.run()      # None: cut short
        stats["dropped_agent"] += len(getattr(group_run, "failures", ()))
        if trajectories is None:
            return False, None
        return True, self.score(group.index, trajectories, stats)

    def score(self, index: int, trajectories: list[Trajectory], stats: Counter) -> ScoredGroup:
        """The episodes of group `index` scored by their returns, counted in `stats`."""
        for t in trajectories:
            stats.update(episodes=1, turns=len(t.turns), tool_calls=t.tool_calls,
                         tool_errors=t.tool_errors, model_tokens=t.model_tokens,
                         env_tokens=t.env_tokens)
        per_turn = [None] * len(trajectories)
        if self.cfg.turn_advantage == "per_turn" and len(trajectories) >= 2:
            per_turn = turn_advantages([t.turn_rewards for t in trajectories],
                                       discount=self.cfg.turn_discount,
                                       normalize_std=self.cfg.normalize_std)
        return ScoredGroup(
            np.asarray([t.episode_return for t in trajectories], np.float32),
            [len(t.tokens) for t in trajectories],
            [(t.finish, lambda a, t=t, turns=turns: t.to_rollout(index, float(a), turns))
             for t, turns in zip(trajectories, per_turn)])


class EnvEpisodes(Episodes):
    """A multi-turn task's episodes against its environment."""

    def open(self, group: Group, carry):
        return EpisodeGroup(self.generation, self.task, self.tokenizer, group, self.cfg,
                            state=carry)


class AgentEpisodes(Episodes):
    """Episodes run by external agent programs (an unfinished one starts again after a
    restart: nothing is carried)."""

    def __init__(self, generation: Generation, task: Task, tokenizer: Tokenizer, cfg: RLConfig,
                 agents):
        super().__init__(generation, task, tokenizer, cfg)
        self.agents = agents

    def open(self, group: Group, carry):
        return self.agents.group(group.problem, self.cfg, index=group.index, seed=group.seed)


def group_source(generation: Generation, task: Task, tokenizer: Tokenizer, cfg: RLConfig, *,
                 agents=None, warn: Callable[[str], None] = print) -> GroupSource:
    """The source of a run's groups: the agents' episodes with rl.agent, the environment's
    for a multi-turn task, else completions."""
    if agents is not None:
        return AgentEpisodes(generation, task, tokenizer, cfg, agents)
    if is_multi_turn(task):
        return EnvEpisodes(generation, task, tokenizer, cfg)
    return Completions(generation, task, tokenizer, cfg, warn)
