"""`jaxrl train`: the supervised warm-up (train.steps optimizer steps), then RL (rl.steps more),
each resumed from the newest checkpoint; ends with a summary table."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import rich.console
import rich.table

from jaxrl.config import RunConfig
from jaxrl.errors import UserError
from jaxrl.rl.tasks.base import Task
from jaxrl.trainer import rl, warmup
from jaxrl.trainer.trainer import check_resume


def check_run_dir(path) -> None:
    """One line naming the path and the problem when `path` (a run or checkpoint directory)
    cannot be used: a file in the way (there or above it), no permission, a read-only disk.
    Creates nothing: every input is checked before anything is written."""
    path = Path(path).absolute()
    for p in (path, *path.parents):
        if p.exists():
            if not p.is_dir():
                raise UserError(f"run_dir {str(path)!r} cannot be used: {str(p)!r} is a file, "
                                f"not a directory")
            if not os.access(p, os.W_OK | os.X_OK):
                raise UserError(f"run_dir {str(path)!r} cannot be used: {str(p)!r} is not "
                                f"writable")
            return


def run(cfg: RunConfig, log: Callable[[str], None] = print, task: Task | None = None) -> dict:
    """The warm-up, then RL, each resumed from the newest checkpoint. `task`: a task object
    (e.g. `CustomTask.from_rows(rows, reward)`) instead of the config's `task` section."""
    check_run_dir(cfg.run_dir)
    check_run_dir(cfg.checkpoint_dir)
    latest = check_resume(cfg)
    end = cfg.train.steps + cfg.rl.steps
    if cfg.rl.steps:
        rl.check_config(cfg)
    if latest is not None and latest >= end:
        log(f"{cfg.checkpoint_dir} already holds the last step ({latest}); nothing to train")
    summary = {"warmup": None, "rl": None}
    if cfg.train.steps and (latest is None or latest < cfg.train.steps):
        summary["warmup"] = warmup.train(cfg, log, evaluate_at_end=cfg.rl.steps == 0,
                                         task=task)
    if cfg.rl.steps and (latest is None or latest < end):
        summary["rl"] = rl.reinforce(cfg, log, task)
    return summary


def format_summary(summary: dict) -> rich.table.Table | str:
    """The end-of-run table."""
    w, r = summary["warmup"], summary["rl"]
    table = rich.table.Table(title="jaxrl train", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    if w is not None:
        stopped = (f" (stopped at greedy accuracy {w['stop_accuracy']:.1%} on training "
                   f"problems)" if w.get("stopped_at") else "")
        table.add_row("warm-up", f"{w['steps']} steps{stopped}, final loss {w['loss']:.4f}, "
                                 f"{w['samples_per_s']:.0f} samples/s")
        if "eval" in w:
            table.add_row("held-out accuracy", f"{w['eval']['accuracy']:.1%}")
    if r is not None:
        table.add_row("RL", f"{r['mode']}, {r['rl_steps']} steps in {r['seconds']:.0f} s")
        if r.get("eval_before") is not None:
            gain = r["eval_after"] - r["eval_before"]
            table.add_row("held-out accuracy", f"{r['eval_before']:.1%} before RL -> "
                                               f"{r['eval_after']:.1%} after ({gain:+.1%})")
            table.add_row("examples", ", ".join(r["examples"][:4]))
        table.add_row("RL samples/s", f"{r['samples_per_s']:.0f}")
        if r["lag_mean"] is not None:
            table.add_row("lag (steps)", f"mean {r['lag_mean']:.2f}, max {r['lag_max']}")
        for name, path in r["plots"].items():
            table.add_row(f"plot: {name}", path)
    last = r or w
    if last is not None:
        table.add_row("checkpoint", last["checkpoint"])
    return table


def print_summary(summary: dict) -> None:
    rich.console.Console(width=120).print(format_summary(summary))
