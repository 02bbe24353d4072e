"""Your own task, without editing jaxrl: prompts from a data set and reward functions of yours.

From a config (`task.name=custom`):
- `task.prompts` is a .jsonl / .json / .parquet file, one object per problem. Its
  `task.prompt_key` column is the prompt: a string, or chat messages (`[{"role", "content"}]`,
  as in TRL's conversational data sets) written with the model's own chat template. Every other
  column is passed to the reward as a keyword argument (`answer`, `tests`, ...).
- `task.reward` names reward functions by import path, `my_pkg.rewards:exact` or
  `path/to/file.py:exact` (relative paths from the working directory, which is also importable),
  summed with `task.reward_weights`. A reward is `reward(prompt, completion, **fields) -> float`,
  or with `task.batched=true`, TRL's form: `reward(prompts=[...], completions=[...],
  **fields_as_lists) -> [float, ...]`, called once per group.
- or `task.factory` names a function `make_task(cfg) -> Task` that builds the whole task
  (jaxrl/rl/tasks/base.py: `sample`, `held_out`, `score`).

From Python, `CustomTask.from_rows(rows, reward)` takes the rows and callables directly
(`jaxrl.train(..., task=...)`).

Held-out accuracy counts a completion as solved when its reward is >= 1. A problem's reference
answer (`task.answer_key`) is what the supervised warm-up trains on; without one, start RL from
`hf_path` with `train.steps=0`.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Literal, Mapping, Sequence

import numpy as np

from jaxrl.deprecation import renamed_arguments
from jaxrl.errors import UserError
from jaxrl.models.chat import render_chat
from jaxrl.rl.tasks.base import Problem
from jaxrl.rl.tasks.rows import EXTENSIONS, TaskDataError, is_held_out, read_rows

# Argument names a reward is called with: a data set column may not take them.
_RESERVED = ("prompt", "completion", "prompts", "completions")


@dataclasses.dataclass(frozen=True)
class CustomConfig:
    """A task of the user's: prompts from a file and reward functions by import path, or a
    factory that builds the whole task."""

    name: Literal["custom"] = "custom"  # the user's prompts and reward (task.factory or task.prompts + task.reward)
    factory: str = ""               # "module:function" -> a Task; then leave the rest unset
    prompts: str = ""               # .jsonl / .json / .parquet, one object per problem
    eval_prompts: str = ""          # held-out problems; "" = a hash-selected share of prompts
    held_out_percent: int = 5       # that share, when eval_prompts is ""
    prompt_key: str = "prompt"      # a string, or chat messages [{role, content}, ...]
    answer_key: str = ""            # the reference answer (the warm-up's target); "" = none
    reward: tuple[str, ...] = ()    # "module:function" or "file.py:function", one or more
    reward_weights: tuple[float, ...] = ()  # one per reward; () = all 1.0
    batched: bool = False           # rewards take a group at once, TRL's keyword form
    max_problems: int = 0           # read only the first this-many rows of each file; 0 = all

    def __post_init__(self):
        if self.factory:
            if ":" not in self.factory:
                raise ValueError(f"task.factory={self.factory!r} must be 'module:function'")
            given = [k for k in ("prompts", "eval_prompts", "answer_key", "reward")
                     if getattr(self, k)]
            if given:
                raise ValueError(f"task.factory={self.factory!r} builds the whole task; "
                                 f"task.{given[0]} cannot be set beside it")
            return
        if not self.prompts:
            raise ValueError("task.name=custom needs task.prompts (a "
                             f"{' / '.join(EXTENSIONS)} file of problems) and task.reward, "
                             "or task.factory")
        if not self.reward:
            raise ValueError("task.reward is empty: name a reward function, e.g. "
                             "task.reward=my_rewards:exact_match")
        bad = [r for r in self.reward if ":" not in r]
        if bad:
            raise ValueError(f"task.reward entry {bad[0]!r} must be 'module:function' or "
                             f"'path/to/file.py:function'")
        if self.reward_weights and len(self.reward_weights) != len(self.reward):
            raise ValueError(f"task.reward_weights has {len(self.reward_weights)} values for "
                             f"{len(self.reward)} rewards")
        if not 1 <= self.held_out_percent <= 50:
            raise ValueError(f"task.held_out_percent={self.held_out_percent} must be in [1, 50]")
        if self.max_problems < 0:
            raise ValueError(f"task.max_problems={self.max_problems} must be >= 0 (0 = all)")
        if self.prompt_key in _RESERVED[1:] or self.answer_key in _RESERVED:
            raise ValueError(f"task.prompt_key / task.answer_key may not be one of {_RESERVED}")


def load_object(path: str, what: str) -> Any:
    """The object an import path names: `package.module:name` (the working directory is
    importable) or `file.py:name`."""
    module_name, _, attr = path.rpartition(":")
    if not module_name or not attr:
        raise UserError(f"{what}={path!r} must be 'module:name' or 'path/to/file.py:name'")
    try:
        if module_name.endswith(".py"):
            file = Path(module_name)
            if not file.is_file():
                raise UserError(f"{what}={path!r}: no file {str(file.absolute())!r}")
            spec = importlib.util.spec_from_file_location(f"_jaxrl_user_{file.stem}", file)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path and "" not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(module_name)
    except UserError:
        raise
    except ImportError as e:
        raise UserError(f"{what}={path!r}: cannot import {module_name!r} ({e})") from e
    except Exception as e:
        raise UserError(f"{what}={path!r}: importing {module_name!r} raised {e!r}") from e
    try:
        return getattr(module, attr)
    except AttributeError:
        raise UserError(f"{what}={path!r}: module {module_name!r} has no {attr!r}") from None


Reward = Callable[..., Any]


class CustomTask:
    """Problems from rows (mappings), scored by reward functions of the user's."""

    name = "custom"

    def __init__(self, train: Sequence[Problem], held: Sequence[Problem],
                 rewards: Sequence[Reward], weights: Sequence[float] = (), *,
                 batched: bool = False):
        if not train:
            raise TaskDataError("the custom task has no training problems")
        if not rewards or not all(callable(r) for r in rewards):
            raise UserError(f"the custom task's rewards must be callables, got {rewards!r}")
        self._train, self._eval = list(train), list(held)
        self.rewards, self.weights = list(rewards), list(weights) or [1.0] * len(rewards)
        self.batched = batched

    # -- building ------------------------------------------------------------------------------
    @classmethod
    @renamed_arguments(held_out_percent="held_out")
    def from_rows(cls, rows: Iterable[Mapping], reward: Reward | Sequence[Reward], *,
                  held_out: int | Iterable[Mapping] = 5, weights: Sequence[float] = (),
                  batched: bool = False, prompt_key: str = "prompt", answer_key: str = "",
                  tokenizer=None) -> "CustomTask":
        """The Python API: `rows` are mappings (a list, a Hugging Face `datasets.Dataset`, a
        Grain MapDataset), `reward` one callable or several. `held_out`: the problems held out
        for evaluation, a percent of `rows` (chosen by a hash of the prompt) or rows of their
        own (any of `rows` with the same prompt is then not trained on). `tokenizer` writes
        chat-message prompts with its chat template."""
        problems = [_problem(row, prompt_key, answer_key, tokenizer, f"row {n}")
                    for n, row in enumerate(rows, 1)]
        if isinstance(held_out, bool) or not isinstance(held_out, int):
            held = [_problem(row, prompt_key, answer_key, tokenizer, f"held-out row {n}")
                    for n, row in enumerate(held_out, 1)]
            held_prompts = {p.prompt for p in held}
            train = [p for p in problems if p.prompt not in held_prompts]
        else:
            if not 0 <= held_out <= 100:
                raise ValueError(f"held_out={held_out}: a percent of the rows (0 to 100) or "
                                 f"rows of their own")
            train = [p for p in problems if not is_held_out(p.prompt, held_out)]
            held = [p for p in problems if is_held_out(p.prompt, held_out)]
        rewards = list(reward) if isinstance(reward, (list, tuple)) else [reward]
        return cls(train, held, rewards, weights, batched=batched)

    @classmethod
    def from_config(cls, cfg: CustomConfig, tokenizer=None) -> "CustomTask":
        def rows(path: str) -> list[Mapping]:
            read = read_rows(Path(path))
            read = read[:cfg.max_problems] if cfg.max_problems else read
            if not read:
                raise TaskDataError(f"task data file {path} is empty")
            for n, row in read:
                if not isinstance(row, Mapping):
                    raise TaskDataError(f"{path} row {n} is a {type(row).__name__}, not an "
                                        f"object")
            return [dict(row, **{_ROW: f"{path} row {n}"}) for n, row in read]

        rewards = [load_object(r, "task.reward") for r in cfg.reward]
        for path, r in zip(cfg.reward, rewards):
            if not callable(r):
                raise UserError(f"task.reward={path!r} is a {type(r).__name__}, not a function")
        task = cls.from_rows(rows(cfg.prompts), rewards, weights=cfg.reward_weights,
                             held_out=rows(cfg.eval_prompts) if cfg.eval_prompts
                             else cfg.held_out_percent,
                             batched=cfg.batched, prompt_key=cfg.prompt_key,
                             answer_key=cfg.answer_key,
                             tokenizer=tokenizer)
        if not task._eval and not cfg.eval_prompts:
            raise TaskDataError(f"holding out {cfg.held_out_percent}% of the problems in "
                                f"{cfg.prompts} leaves none for evaluation; set "
                                f"task.eval_prompts or raise task.held_out_percent")
        return task

    # -- the Task API --------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._train)

    def sample(self, rng: np.random.Generator) -> Problem:
        return self._train[int(rng.integers(len(self._train)))]

    def warmup_sample(self, rng: np.random.Generator) -> Problem:
        problem = self.sample(rng)
        if not problem.answer:
            raise UserError("the supervised warm-up trains on reference answers, and this "
                            "task's problems have none: set task.answer_key (the column of the "
                            "answers), or start RL from hf_path with train.steps=0")
        return problem

    def held_out(self, n: int) -> list[Problem]:
        return self._eval[:max(n, 0)]

    def score(self, problem: Problem, completion: str) -> float:
        return float(self.score_group(problem, [completion])[0])

    def score_group(self, problem: Problem, completions: Sequence[str]) -> list[float]:
        """The weighted sum of the rewards for each completion."""
        total = np.zeros(len(completions))
        for reward, weight in zip(self.rewards, self.weights):
            if self.batched:
                n = len(completions)
                values = list(reward(prompts=[problem.prompt] * n, completions=list(completions),
                                     **{k: [v] * n for k, v in problem.fields.items()}))
                if len(values) != n:
                    raise ValueError(f"{_name(reward)} returned {len(values)} rewards for {n} "
                                     f"completions")
            else:
                values = [reward(problem.prompt, c, **problem.fields) for c in completions]
            for v in values:
                if v is None or isinstance(v, bool) or not isinstance(v, (int, float, np.number)):
                    raise ValueError(f"{_name(reward)} returned {v!r}; a reward is a number")
            total += weight * np.asarray(values, np.float64)
        return total.tolist()


_ROW = "__jaxrl_row__"    # where a file's row came from, for error messages; not a field


def _name(fn) -> str:
    return getattr(fn, "__qualname__", repr(fn))


def _problem(row: Mapping, prompt_key: str, answer_key: str, tokenizer, where: str) -> Problem:
    if not isinstance(row, Mapping):
        raise TaskDataError(f"{where} is a {type(row).__name__}, not a mapping")
    where = row.get(_ROW, where)
    fields = {k: v for k, v in row.items() if k not in (prompt_key, _ROW)}
    clash = [k for k in fields if k in _RESERVED]
    if clash:
        raise TaskDataError(f"{where} has a column {clash[0]!r}, a name the reward is called "
                            f"with; rename it")
    prompt = row.get(prompt_key)
    if isinstance(prompt, (list, tuple)):
        prompt = _render_messages(prompt, tokenizer, where)
    if not isinstance(prompt, str) or not prompt:
        raise TaskDataError(f"{where} has no {prompt_key!r} prompt (a non-empty string or a list "
                            f"of chat messages; its keys: {sorted(k for k in row if k != _ROW)})")
    answer = ""
    if answer_key:
        if row.get(answer_key) is None:
            raise TaskDataError(f"{where} lacks the answer column {answer_key!r}")
        answer = str(row[answer_key])
    return Problem(prompt, answer, fields)


def _render_messages(messages: Sequence, tokenizer, where: str) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise TaskDataError(f"{where}'s prompt is a list of chat messages, and the tokenizer has "
                            f"no chat template to write them with (tokenizer_config.json)")
    if not all(isinstance(m, Mapping) and "role" in m and "content" in m for m in messages):
        raise TaskDataError(f"{where}'s prompt is a list but not of chat messages "
                            f"({{'role', 'content'}} objects): {list(messages)[:2]!r}")
    text = render_chat(template, [dict(m) for m in messages], tokenizer)
    bos = getattr(tokenizer, "bos_token", None)
    # jaxrl adds BOS itself (prompt_ids): the template's own would double it.
    return text[len(bos):] if bos and text.startswith(bos) else text
