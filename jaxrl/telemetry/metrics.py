"""Training metrics to three sinks: `metrics.jsonl` (the record tests and plots read back),
TensorBoard event files, and optionally Weights & Biases."""

from __future__ import annotations

import json
import logging
import math
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

import numpy as np

from jaxrl.errors import UserError

METRICS_FILE = "metrics.jsonl"


class MetricsLogger:
    """Appends one row per step; reopening the same run_dir (a resumed run) appends to it."""

    def __init__(self, run_dir, *, tensorboard: bool = True, wandb: str | None = None,
                 config: dict | None = None, resume_step: int | None = None,
                 name: str | None = None, phase: str | None = None,
                 phase_restarts: bool = False):
        """`wandb`: the Weights & Biases project to log to as well (None: none), with the run's
        `config`. `resume_step`: the step a resumed run restarts from; rows a crashed run logged after
        it (and will log again) are dropped, from metrics.jsonl and from TensorBoard's view.
        `name`: the phase (warm-up, RL), which names the W&B run `<run_dir>/<name>`.
        `phase`: written into every row as "phase"; with `phase_restarts` (the phase starts
        over: no checkpoint of it was written), every earlier row of that phase is dropped too,
        e.g. the evaluation row logged at the phase's first step before the crash."""
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._phase = phase
        # W&B first: when it cannot start, the run's files are left as they were.
        self._wandb, self._wandb_histogram = \
            _start_wandb(wandb, self.run_dir, config, name) if wandb else (None, None)
        path = self.run_dir / METRICS_FILE
        if path.exists():
            _drop_partial_last_line(path)
            _drop_rows(path, lambda row: (resume_step is None or row["step"] <= resume_step)
                       and not (phase_restarts and row.get("phase") == phase))
        self._jsonl = path.open("a", encoding="utf-8")
        # tensorboardX takes most of a second to import: it is opened beside the run's start
        # (compiling, loading weights) and joined by the first row logged.
        self._tb_opening = _beside(_open_tensorboard, self.run_dir / "tensorboard",
                                   resume_step) if tensorboard else None
        self._tb_writer = None

    @property
    def _tb(self):
        if self._tb_opening is not None:
            opening, self._tb_opening = self._tb_opening, None
            self._tb_writer = opening.result()
        return self._tb_writer

    def log(self, step: int, metrics: dict[str, float]) -> None:
        values = {name: float(value) for name, value in metrics.items()}
        row = {"step": int(step), **{k: v if math.isfinite(v) else None for k, v in values.items()}}
        if self._phase is not None:
            row["phase"] = self._phase
        self._jsonl.write(json.dumps(row, allow_nan=False) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for name, value in values.items():
                self._tb.add_scalar(name, value, int(step))
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(values, step=int(step))

    def histogram(self, step: int, name: str, values: Sequence[float]) -> None:
        values = np.asarray(values, dtype=np.float64).ravel()
        if values.size == 0:  # a step may have no samples, and tensorboardX raises on none
            return
        if self._tb is not None:
            self._tb.add_histogram(name, values, int(step))
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({name: self._wandb_histogram(values)}, step=int(step))

    def close(self) -> None:
        if not self._jsonl.closed:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
            self._tb_writer = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_metrics(run_dir) -> list[dict]:
    """The rows of `<run_dir>/metrics.jsonl` in order; non-finite values come back as None."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        raise UserError(f"no {METRICS_FILE} in {run_dir}: is it a training run directory?")
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    rows = []
    for k, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if k < len(lines) - 1:  # only the last line may be cut short, by a killed run
                raise UserError(f"{path}: line {k + 1} is not JSON") from None
    return rows


def _drop_partial_last_line(path: Path) -> None:
    """A run killed mid-write can leave half a row; cut it so the resumed rows start clean."""
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with path.open("r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)


def _drop_rows(path: Path, keep) -> None:
    """Rewrites metrics.jsonl without the rows `keep` refuses, atomically (a kill during the
    rewrite leaves the old file or the new one, never a cut one)."""
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    kept = [line for line in lines if not line.strip() or keep(json.loads(line))]
    if len(kept) != len(lines):
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(kept), encoding="utf-8")
        tmp.replace(path)


def _beside(build, *args) -> Future:
    """`build(*args)` on a thread of its own; the future's result() waits for what it built,
    or raises what it raised."""
    pool = ThreadPoolExecutor(1, thread_name_prefix=f"open-{build.__name__}")
    try:
        return pool.submit(build, *args)
    finally:
        pool.shutdown(wait=False)      # the thread ends once `build` returns


class _Refuse:
    """A meta path finder that refuses to import module `name` on the thread that made it, and
    lets every other thread import it as before."""

    def __init__(self, name: str):
        self.name, self.thread = name, threading.get_ident()

    def find_spec(self, name, path=None, target=None):
        if name == self.name and threading.get_ident() == self.thread:
            raise ImportError(f"{name} is not imported on this thread")
        return None


def _summary_writer():
    """tensorboardX's SummaryWriter, imported without torch: tensorboardX imports torch when
    it can, only to recognise torch tensors (1.4 s of a run's start where torch is installed),
    and this logger passes it numbers and numpy arrays. Only this thread is refused torch
    (the import runs beside the run's start, whose other threads may import it)."""
    finder = _Refuse("torch")
    sys.meta_path.insert(0, finder)
    try:
        from tensorboardX import SummaryWriter
    finally:
        sys.meta_path.remove(finder)
    return SummaryWriter


def _open_tensorboard(logdir: Path, resume_step: int | None = None):
    # Event files are named by the second they were opened in and opened with "wb", so a run
    # resumed within the same second would erase the last one; number them to keep each.
    earlier = len(list(logdir.glob("events.out.tfevents.*"))) if logdir.exists() else 0
    purge = None if resume_step is None else resume_step + 1  # TensorBoard hides later events
    # A NaN (e.g. the reward of a step where nothing finished) is logged on purpose; tensorboardX
    # would warn about every one.
    logging.getLogger("tensorboardX.x2num").setLevel(logging.ERROR)
    return _summary_writer()(str(logdir), filename_suffix=f".{earlier}", purge_step=purge)


def _start_wandb(project: str, run_dir: Path, config: dict | None, name: str | None = None):
    """A W&B run writing under `<run_dir>/wandb`; WANDB_MODE=offline keeps it on disk (upload
    later with `wandb sync`). Returns the run and wandb's Histogram, not the module's global run."""
    try:
        import wandb
    except ImportError:
        raise UserError("log.wandb=true needs Weights & Biases: `pip install wandb`, "
                        "or turn it off with log.wandb=false") from None
    try:
        # create_new: never finish or reuse a run someone else opened in this process.
        run = wandb.init(project=project, dir=str(run_dir), config=config, reinit="create_new",
                         name=f"{run_dir.name}/{name}" if name else None)
    except wandb.errors.Error as e:
        raise UserError(f"log.wandb=true: Weights & Biases did not start ({e}); log in with "
                        f"`wandb login`, set WANDB_MODE=offline, or set log.wandb=false") from None
    return run, wandb.Histogram


class NoMetrics:
    """What a process other than the first logs: nothing (process 0 writes the run's metrics)."""

    def log(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def histogram(self, step: int, name: str, values: Sequence[float]) -> None:
        pass

    def close(self) -> None:
        pass


def open_metrics(run_dir, **kwargs) -> MetricsLogger | NoMetrics:
    """A MetricsLogger on process 0 (the only one on a single host), NoMetrics elsewhere."""
    import jax
    return MetricsLogger(run_dir, **kwargs) if jax.process_index() == 0 else NoMetrics()
