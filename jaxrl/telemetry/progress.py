"""The live view of a run: a rich progress bar with reward, lag and throughput on a terminal,
one plain line every few steps elsewhere (CI logs, notebooks' captured output)."""

from __future__ import annotations

from typing import Callable

import rich.console
import rich.progress


def _describe(row: dict) -> str:
    return (f"reward {row['reward']:.3f}  success {row['success_rate']:.2f}  lag "
            f"{row['lag_mean']:.1f} (max {row['lag_max']})  {row['samples_per_s']:.0f} "
            f"samples/s  {row['generated_tokens_per_s']:.0f} gen tok/s  wait "
            f"{row['trainer_wait_s']:.2f}s")


class Progress:
    def __init__(self, *, total: int, completed: int, enabled: bool = True,
                 log: Callable[[str], None] = print, every: int = 10):
        console = rich.console.Console(stderr=True)
        self._log, self._every = log, every
        self._bar = None
        if enabled and console.is_terminal:
            self._bar = rich.progress.Progress(
                rich.progress.TextColumn("RL step"), rich.progress.BarColumn(),
                rich.progress.MofNCompleteColumn(), rich.progress.TimeElapsedColumn(),
                rich.progress.TextColumn("{task.description}"), console=console)
            self._task = self._bar.add_task("", total=total, completed=completed)
            self._bar.start()

    def update(self, step: int, row: dict) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=step, description=_describe(row))
        elif step % self._every == 0:
            self._log(f"step {step:>5}  {_describe(row)}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
