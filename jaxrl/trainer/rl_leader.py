"""What process 0 does in an RL run besides the collectives every process runs (jaxrl/trainer/
rl.py): it leads. `Leader` owns the generation fleet and its publisher, the actor, the rollout
log and the Grain pipeline that turns it into batches, the mode (how generation and training
take turns), evaluation, the metrics and the progress bar; each step it decides the batch,
publishes the new weights, records the step, and says what a checkpoint must carry to resume
the same stream. On the other processes a `Follower` takes the batch it is given and does
nothing else, so the run's loop reads the same on every process."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Callable

import jax
import numpy as np

from jaxrl.config import to_dict
from jaxrl.data.pipeline import pack, rl_batches
from jaxrl.data.rollouts import Rollout, RolloutLog, source_position
from jaxrl.errors import UserError
from jaxrl.eval.evaluate import evaluate
from jaxrl.recipe import build_task
from jaxrl.rl.tasks.base import Task
from jaxrl.rollout import generation
from jaxrl.rollout.actor import Actor
from jaxrl.rollout.agents import Agents
from jaxrl.rollout.sources import group_source
from jaxrl.telemetry.metrics import MetricsLogger
from jaxrl.telemetry.progress import Progress
from jaxrl.telemetry.rl_metrics import StepMetrics, rate
from jaxrl.trainer.modes import MODES
from jaxrl.trainer.resume import ResumeState


class Clock:
    """Wall time of the run without the time spent on held-out evaluation."""

    def __init__(self, offset: float = 0.0):
        self._start = time.perf_counter() - offset
        self._paused = 0.0

    def __call__(self) -> float:
        return time.perf_counter() - self._start - self._paused

    def exclude(self, seconds: float) -> None:
        self._paused += seconds


class Follower:
    """A process that does not lead: it trains on the batch process 0 shares."""

    def __init__(self, cfg):
        self._like = pack([], cfg.rl)["arrays"]     # the shapes and dtypes of a shared batch

    def begin(self) -> None:
        pass

    def next_arrays(self, lockstep):
        return lockstep.share(None, self._like)

    def stepping(self):
        return contextlib.nullcontext()

    def publish(self, weights, step: int):
        return None

    def record(self, step: int, train_metrics, wait_s: float, step_s: float, update) -> None:
        pass

    def resume_data(self) -> dict:
        return {}

    def saved(self) -> None:
        pass

    def summary(self) -> None:
        return None


class Leader:
    """Process 0's part of the run (the module docstring). Built in `stack` (closed with the
    run); `trainer` the RL trainer, `end` the last step, `first_weights` what the fleet serves
    first, `engine_devices` where an in-process engine runs."""

    def __init__(self, cfg, trainer, *, task: Task | None, first_weights, engine_devices,
                 processes: int, stack: contextlib.ExitStack, log: Callable[[str], None]):
        self.cfg, self.trainer, self.log, self._stack = cfg, trainer, log, stack
        self.end = cfg.train.steps + cfg.rl.steps
        self.config_dict = to_dict(cfg)
        self.engine_devices = engine_devices
        rl, r = cfg.rl, ResumeState.from_saved(trainer.data)
        self.resume = r
        self.task, self.tokenizer = build_task(cfg, trainer.model_cfg, task)
        step = trainer.step
        gen = self.gen = generation.start(cfg, trainer.model_cfg, self.tokenizer, first_weights,
                                          step, engine_devices, log,
                                          trainer_devices=list(trainer.mesh.devices.flat))
        stack.callback(gen.close)
        self.agents = self._agents()
        self.rollout_log = RolloutLog(r.position, [Rollout.from_json(x) for x in r.rollouts])
        stack.callback(self.rollout_log.close)
        source = group_source(gen.fleet, self.task, self.tokenizer, rl, agents=self.agents,
                              warn=log)
        self.actor = Actor(source, self.rollout_log, rl, seed=cfg.train.seed, warn=log,
                           resume={"next_problem": r.next_problem, "redo": r.redo,
                                   "partial": r.partial, "stats": r.stats})
        stack.callback(self.actor.stop)
        self.actor.notify_trained(r.position)
        self.processes = processes
        self._build_pipeline(r)
        self.clock = Clock(r.time_s)
        self.metrics_log = MetricsLogger(Path(cfg.run_dir), wandb=cfg.log.wandb_run,
                                         config=self.config_dict, resume_step=step, name="RL",
                                         phase="rl", phase_restarts=trainer.restarted)
        stack.callback(self.metrics_log.close)
        self.mode = MODES[rl.mode](self.actor, gen.publisher, self.batches, self.rollout_log,
                                   rl.batch_size, fleet=gen.fleet)
        self._batch = None

    def _agents(self) -> Agents | None:
        rl, log = self.cfg.rl, self.log
        if not rl.agent.command:
            return None
        agents = Agents(rl, self.gen.local, self.tokenizer, "jaxrl", Path(self.cfg.run_dir),
                        warn=log)
        self._stack.callback(agents.close)
        log(f"agents: {rl.agent.workers} x {list(rl.agent.command)} against {agents.url} "
            f"(their stderr: {Path(self.cfg.run_dir) / 'agents'})")
        return agents

    def _build_pipeline(self, r: ResumeState) -> None:
        """The rollout pipeline. One process: batches go onto the trainer's devices in the
        pipeline's thread. Several: they stay in host memory, are shared, and each process
        puts its own rows (RLTrainer.train)."""
        sharding = self.trainer.batch_sharding
        dataset, self.lag_stats = rl_batches(
            self.rollout_log, self.cfg.rl, current_step=lambda: self.trainer.step,
            put=(lambda a: a) if self.processes > 1 else (lambda a: jax.device_put(a, sharding)),
            start=r.position, lag_state=r.lag_stats)
        self.batches = iter(dataset)
        self._stack.callback(_close, self.batches)
        self._stack.callback(self.rollout_log.close)    # first: it wakes the prefetch thread
        if r.iterator is not None:
            self.batches.set_state(r.iterator)

    # -- the loop's calls, in order ----------------------------------------------------------
    def begin(self) -> None:
        rl, step, cfg = self.cfg.rl, self.trainer.step, self.cfg
        self.eval_before = self.resume.eval_before
        if self.eval_before is None and cfg.train.eval_problems:
            self.eval_before = self._held_out()["accuracy"]
            self.metrics_log.log(step, {"eval_accuracy": self.eval_before,
                                        "time_s": self.clock()})
        mesh, processes = self.trainer.mesh, self.processes
        where = (f"{len(self.gen.fleet.members)} server(s) {', '.join(rl.generation.servers)}"
                 if rl.generation.remote else
                 f"an engine on {len(self.engine_devices)} device(s)")
        self.log(f"RL ({rl.mode}, {'remote' if rl.generation.remote else rl.placement}, loss "
                 f"{rl.loss}): steps {step}..{self.end}; {rl.prompts_per_step} prompts x "
                 f"{rl.group_size} samples per step; trainer on {mesh.size} device(s)"
                 f"{f' in {processes} processes' if processes > 1 else ''} {dict(mesh.shape)}, "
                 f"generation on {where}; held-out accuracy {self.eval_before}")
        self.all_lags, self.rows = [], []
        self.recorder = StepMetrics(rl.batch_size, self.actor, self.gen.fleet,
                                    self.gen.publisher, self.lag_stats, self.resume.trained,
                                    self.clock())
        self.t_start = self.clock()
        self.position = self.resume.position
        self.mode.start()
        self.progress = Progress(total=self.end, completed=step, enabled=cfg.log.progress,
                                 log=self.log)
        self._stack.callback(self.progress.close)

    def next_arrays(self, lockstep):
        """The next training batch, shared with the other processes; an actor failure (it
        closes the log) surfaces here. With rl.multiplex the trainer's devices generate while
        it waits (jaxrl/rollout/fleet.py: lend, withdraw)."""
        with self._lent():
            self.mode.before_batch(self.trainer.step)
            try:
                self._batch = next(self.batches)
            except StopIteration:
                if isinstance(self.actor.error, UserError):  # e.g. no server answers: one line
                    raise self.actor.error from None
                raise RuntimeError("the rollout stream ended early") from self.actor.error
        return lockstep.share(lambda: self._batch["arrays"], None)

    @contextlib.contextmanager
    def _lent(self):
        lender = self.gen.lender
        if lender is None:
            yield
            return
        self.gen.fleet.lend(lender)
        try:
            yield
        finally:
            self.gen.fleet.withdraw(lender)

    def stepping(self):
        return self.mode.stepping()

    def publish(self, weights, step: int):
        return self.gen.publisher.publish(weights, step)

    def record(self, step: int, train_metrics, wait_s: float, step_s: float, update) -> None:
        """The bookkeeping after a step: the stream's position, metrics, evaluation."""
        self.position = source_position(self.batches.get_state())
        self.actor.notify_trained(self.position)
        self.now = self.clock()
        row, lags, lengths = self.recorder.row(step, self._batch, train_metrics, now=self.now,
                                               wait_s=wait_s, step_s=step_s, update=update)
        self.all_lags.extend(lags.tolist())
        rl, first_rl = self.cfg.rl, self.cfg.train.steps
        if rl.eval_every and (step - first_rl) % rl.eval_every == 0 and step < self.end:
            row["eval_accuracy"] = self._held_out()["accuracy"]
        self.metrics_log.log(step, row)
        self.metrics_log.histogram(step, "lag", lags)
        self.metrics_log.histogram(step, "completion_len", lengths)
        self.rows.append({"step": step, **row})
        self.progress.update(step, row)
        if (drops := self.actor.drop_report()) is not None:
            self.log(drops)

    def resume_data(self) -> dict:
        snapshot = self.actor.snapshot(self.position)
        return ResumeState(**snapshot, iterator=self.batches.get_state(),
                           lag_stats=self.lag_stats.state(), trained=self.recorder.trained,
                           time_s=self.now, eval_before=self.eval_before).to_saved()

    def saved(self) -> None:
        """A checkpoint holds the stream from `position`: the log may drop what is before."""
        self.rollout_log.release(self.position)

    def _held_out(self) -> dict:
        """Greedy accuracy of the weights the fleet serves (the trainer's newest), decoded by
        the engines beside the rollouts."""
        t0 = time.perf_counter()
        out = evaluate(self.gen.fleet, self.task, self.tokenizer, self.cfg.train.eval_problems,
                       max_new_tokens=self.cfg.rl.max_new_tokens, rl=self.cfg.rl)
        self.clock.exclude(time.perf_counter() - t0)
        return out

    def summary(self) -> dict:
        rl, end, lags = self.cfg.rl, self.end, self.all_lags
        final = self._held_out() if self.cfg.train.eval_problems else None
        summary = {"mode": rl.mode, "steps": end, "rl_steps": len(self.rows),
                   "samples_per_s": rate(self.rows, rl.batch_size),
                   "lag_mean": float(np.mean(lags)) if lags else None,
                   "lag_max": int(np.max(lags)) if lags else None,
                   "checkpoint": str(self.trainer.ckpt.path / str(end)),
                   "eval_before": self.eval_before, "seconds": self.clock() - self.t_start}
        if final is not None:
            summary["eval_after"] = final["accuracy"]
            summary["examples"] = final["examples"]
            self.metrics_log.log(end, {"eval_accuracy": final["accuracy"],
                                       "time_s": self.clock()})
        # Imported here: matplotlib costs a second of the run's start, and plots come last.
        from jaxrl.telemetry.plots import save_run_plots

        plots = save_run_plots(Path(self.cfg.run_dir), self.rows, lags)
        summary["plots"] = {k: str(v) for k, v in plots.items()}
        return summary


def _close(iterator) -> None:
    close = getattr(iterator, "close", None)
    if close is not None:
        close()
