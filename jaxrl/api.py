"""The Python API: `jaxrl train` from a script or a notebook, with your own task.

    from jaxrl.api import CustomTask, train

    def exact(prompt, completion, answer):          # reward(prompt, completion, **fields)
        return float(completion.strip() == answer)

    rows = [{"prompt": "2+2=", "answer": "4"}, ...]  # or a datasets.Dataset, a Grain source
    task = CustomTask.from_rows(rows, exact, tokenizer=None)
    summary = train("configs/my_run.yaml", ["rl.steps=100"], task=task)

TRL's batched reward functions (`reward(prompts=..., completions=..., **columns)`, one list
each) are taken with `batched=True`. The config's `task` section is ignored when `task` is given.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

from jaxrl.config import RunConfig, load_run_config
from jaxrl.rl.tasks.base import Problem, Task
from jaxrl.rl.tasks.custom import CustomTask

__all__ = ["CustomTask", "Problem", "RunConfig", "Task", "load_run_config", "train"]


def train(config: RunConfig | str | Path | None = None, overrides: Sequence[str] = (), *,
          task: Task | None = None, log: Callable[[str], None] = print) -> dict:
    """Runs `jaxrl train` in this process: `config` is a RunConfig or a YAML file (None: the
    defaults), `overrides` are `section.key=value` strings, `task` replaces the config's task.
    Returns the run's summary (the warm-up's and RL's). Compiled programs are cached as
    `jaxrl train` caches them (jaxrl/platform.py)."""
    from jaxrl.commands.job import run
    from jaxrl.platform import use_compilation_cache

    use_compilation_cache()

    if isinstance(config, RunConfig):
        if overrides:
            raise ValueError("overrides apply to a YAML config; build the RunConfig with them "
                             "instead (load_run_config(path, overrides))")
        cfg = config
    else:
        cfg = load_run_config(config, overrides)
    return run(cfg, log, task)
