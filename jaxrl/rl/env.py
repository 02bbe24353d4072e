"""The environment API for multi-turn episodes, and the token history of one episode.

An episode starts from a problem's prompt. The model writes a turn; the environment answers it
(`Environment.reply`) with an observation, which is appended to the history for the model's next
turn, and with a reward, or ends the episode. Limits: `rl.max_turns` model turns and
`rl.max_episode_tokens` tokens after the prompt (the model's and the environment's together);
an episode that reaches one ends with the rewards it has.

`reply` is given every model turn so far, not just the last, so an environment keeps no state of
its own: an episode cut by a checkpoint continues after a restart exactly, by replaying its
turns. Rewards: the episode's return is the sum of its replies' rewards (one final reward, or
per-turn rewards as well); with `rl.turn_advantage=per_turn` each turn is credited with the
rewards from that turn on (jaxrl/rl/advantages.py's turn_advantages).

A `Trajectory` is the episode's history in tokens: the model's, each with its log-prob and
weights version, and the environment's, marked untrained (no loss, no advantage, no behaviour
log-prob). It becomes one Rollout, so packing keeps an episode whole.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence

from jaxrl.data.rollouts import Rollout
from jaxrl.rl.tasks.base import Problem, Task


@dataclasses.dataclass(frozen=True)
class Reply:
    observation: str = ""      # appended after the model's turn; "" with done
    reward: float = 0.0        # this turn's reward (the episode's return sums them)
    done: bool = False
    tool_call: bool = False    # the turn called a tool (for the metrics)
    tool_error: bool = False   # ... which failed: bad call, crash, timeout


class Environment(Protocol):
    def reply(self, problem: Problem, turns: Sequence[str]) -> Reply:
        """The answer to the model's latest turn (`turns[-1]`, its text before EOS), given all
        its turns so far. Must not raise for any text the model writes: bad tool calls and
        malformed answers are observations (see jaxrl/rl/tools.py)."""


class MultiTurnTask(Task, Environment, Protocol):
    """A task whose episodes take turns: its `score` is unused; held-out success is an
    episode return of at least 1."""


def is_multi_turn(task: Task) -> bool:
    return callable(getattr(task, "reply", None))


@dataclasses.dataclass
class Trajectory:
    """One episode so far: the prompt, then every token after it in order."""

    prompt: list[int]
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    trained: list[bool] = dataclasses.field(default_factory=list)  # False: environment's
    turns: list[str] = dataclasses.field(default_factory=list)     # the model's, as text
    rewards: list[float] = dataclasses.field(default_factory=list)
    # done (the environment ended it), turns (rl.max_turns), length (rl.max_episode_tokens);
    # None while it goes on
    finish: str | None = None
    tool_calls: int = 0
    tool_errors: int = 0

    @property
    def history(self) -> list[int]:
        """What the model's next turn is prompted with."""
        return self.prompt + self.tokens

    @property
    def done(self) -> bool:
        return self.finish is not None

    @property
    def model_tokens(self) -> int:
        return sum(self.trained)

    @property
    def env_tokens(self) -> int:
        return len(self.trained) - self.model_tokens

    @property
    def episode_return(self) -> float:
        return float(sum(self.rewards))

    def add_model(self, tokens: Sequence[int], logprobs: Sequence[float],
                  versions: Sequence[int], text: str) -> None:
        self.tokens += tokens
        self.logprobs += logprobs
        self.versions += versions
        self.trained += [True] * len(tokens)
        self.turns.append(text)

    def add_reply(self, reply: Reply, tokens: Sequence[int] = ()) -> None:
        """The environment's answer to the last turn, and its observation's tokens; they carry
        the version of the turn they answer (a lag measure ignores them: no loss)."""
        version = self.versions[-1] if self.versions else 0
        self.tokens += tokens
        self.logprobs += [0.0] * len(tokens)
        self.versions += [version] * len(tokens)
        self.trained += [False] * len(tokens)
        self.rewards.append(float(reply.reward))
        self.tool_calls += reply.tool_call
        self.tool_errors += reply.tool_error

    @property
    def turn_rewards(self) -> list[float]:
        """The reward of each model turn: the reply's to it (0 for a last turn cut by a limit
        before any reply)."""
        return [self.rewards[k] if k < len(self.rewards) else 0.0
                for k in range(len(self.turns))]

    def turn_of_tokens(self) -> list[int]:
        """Per token after the prompt: the index of the model turn it belongs to, -1 for the
        environment's."""
        out, turn, previous = [], -1, False
        for trained in self.trained:
            if trained and not previous:
                turn += 1
            out.append(turn if trained else -1)
            previous = trained
        return out

    def to_rollout(self, group: int, advantage: float,
                   turn_advantages: Sequence[float] | None = None) -> Rollout:
        """`turn_advantages`: one per model turn (rl.turn_advantage=per_turn), given to that
        turn's tokens; None: `advantage` for every token."""
        per_token = None
        if turn_advantages is not None:
            per_token = [0.0 if k < 0 else float(turn_advantages[k])
                         for k in self.turn_of_tokens()]
        return Rollout(prompt=list(self.prompt), completion=list(self.tokens),
                       logprobs=list(self.logprobs), versions=list(self.versions),
                       reward=self.episode_return, advantage=advantage, group=group,
                       finish=self.finish or "length", trained=list(self.trained),
                       token_advantages=per_token)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "Trajectory":
        """A copy: the trajectory grows without touching `d`."""
        return cls(**{k: list(v) if isinstance(v, list) else v for k, v in d.items()})
