"""Reinforcement learning after the warm-up: one loop object, `RLRun`, run by every process.

It wires parts that live in modules of their own: the trainer's state and step
(rl_trainer.py), the rollout fleet and weight publisher (jaxrl/rollout/generation.py: this
process's engine or `jaxrl serve` processes), the actor that feeds the fleet problems
(jaxrl/rollout/actor.py), the Grain pipeline that feeds the trainer rollouts
(jaxrl/data/pipeline.py), how generation and training take turns (modes.py: sync, async,
partial), what a checkpoint carries to resume the same stream (resume.py) and the per-step
metrics (jaxrl/telemetry/rl_metrics.py).

On several processes (lockstep.py) every process runs the same collectives in the same order
(the train step, the gather of the weights to publish, the checkpoint); process 0 alone leads:
it runs the actor, the fleet, the pipeline, evaluation and metrics, and shares each batch.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path
from typing import Callable

import jax
import numpy as np

from jaxrl.config import ConfigError, RunConfig, to_dict
from jaxrl.data.pipeline import pack, rl_batches
from jaxrl.data.rollouts import Rollout, RolloutLog, source_position
from jaxrl.errors import UserError
from jaxrl.eval.evaluate import evaluate
from jaxrl.recipe import build_task, model_config
from jaxrl.rl.tasks.base import Task
from jaxrl.rollout import generation, local_servers
from jaxrl.rollout.actor import Actor
from jaxrl.rollout.agents import Agents
from jaxrl.telemetry.metrics import MetricsLogger
from jaxrl.telemetry.progress import Progress
from jaxrl.telemetry.rl_metrics import StepMetrics, rate
from jaxrl.trainer.lockstep import Lockstep
from jaxrl.trainer.modes import MODES
from jaxrl.trainer.resume import ResumeState
from jaxrl.trainer.rl_trainer import RLTrainer
from sharding import mesh as shd


def check_config(cfg: RunConfig) -> None:
    """Everything about the RL config that can be wrong, checked before any training (the
    warm-up included) starts."""
    if jax.process_count() > 1 and not cfg.rl.generation.remote:
        raise ConfigError(f"RL across {jax.process_count()} processes generates on `jaxrl "
                          f"serve` processes: set rl.generation.servers (process 0 drives "
                          f"them; an in-process engine would sit on one host's devices)")
    trainer_devices, _ = generation.placement(cfg)
    check_rl_config(cfg, shd.make_mesh(cfg.mesh, trainer_devices))
    generation.engine_config(cfg, model_config(cfg))
    generation.update_token(cfg.rl.generation.token_file)
    g = cfg.rl.generation
    if g.launch:
        if g.servers:
            raise ConfigError(f"rl.generation.launch={g.launch} starts its own servers; "
                              f"rl.generation.servers lists others ({list(g.servers)}): set one")
        if jax.process_count() > 1:
            raise ConfigError("rl.generation.launch starts servers beside a one-process "
                              "trainer; across processes, list them in rl.generation.servers")
        local_servers.plan(g.launch, g.cpus)


def check_rl_config(cfg: RunConfig, mesh) -> None:
    dp = shd.data_parallel_size(mesh)
    if cfg.rl.microbatch_rows % dp:
        raise ConfigError(f"rl.microbatch_rows={cfg.rl.microbatch_rows} is not divisible by the "
                          f"{dp}-way data-parallel trainer mesh (mesh.data x mesh.fsdp)")
    if cfg.rl.moe_routing == "replay":
        if not model_config(cfg).num_experts:
            raise ConfigError(f"rl.moe_routing=replay replays a mixture-of-experts model's "
                              f"routing; model.family={cfg.model.family} has no experts")
        if cfg.sharding.pipeline.stages > 1:
            raise ConfigError(f"rl.moe_routing=replay cannot run in a pipeline (sharding."
                              f"pipeline.stages={cfg.sharding.pipeline.stages}): the stages do "
                              f"not take per-token inputs beside the activations")


def reinforce(cfg: RunConfig, log: Callable[[str], None] = print,
              task: Task | None = None) -> dict | None:
    """Runs (or resumes) the RL phase: optimizer steps train.steps .. train.steps + rl.steps.
    Needs a checkpoint at train.steps or later in the checkpoint directory (the warm-up's).
    Process 0 returns the summary; the others return None. `task`: the Python API's task,
    instead of the config's."""
    with RLRun(cfg, log, task) as run:
        return run.run()


class _Clock:
    """Wall time of the run without the time spent on held-out evaluation."""

    def __init__(self, offset: float = 0.0):
        self._start = time.perf_counter() - offset
        self._paused = 0.0

    def __call__(self) -> float:
        return time.perf_counter() - self._start - self._paused

    def exclude(self, seconds: float) -> None:
        self._paused += seconds


class RLRun:
    """The RL phase on this process. Every resource it builds (the trainer, the fleet, the
    agents, the rollout log, the actor, the pipeline, the metrics files, the progress bar) is
    owned by one ExitStack and closed, in the reverse order, when the run ends or when a later
    one fails to build; a leader that fails between collectives releases the other processes
    first (Lockstep.abort)."""

    def __init__(self, cfg: RunConfig, log: Callable[[str], None] = print,
                 task: Task | None = None):
        self.cfg, self.log = cfg, log
        self.lockstep: Lockstep | None = None
        self._stack = contextlib.ExitStack()
        try:
            self._servers = None
            if cfg.rl.generation.launch:
                self.cfg = cfg = self._launch(cfg)
            self._build_trainer()
            if self._servers is not None:     # they compiled while the trainer did
                self._servers.wait_ready(cfg.rl.generation.wait_s)
            if self.leader:
                self._build_leader(task)
            self.first_weights = None    # served now (leader): not kept for the whole run
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise

    def __enter__(self) -> "RLRun":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and self.lockstep is not None:
            self.lockstep.abort()    # before the clean-up: the others may wait at a share
        self._stack.close()

    @property
    def leader(self) -> bool:
        return self.lockstep.leader

    # -- building ------------------------------------------------------------------------------
    def _launch(self, cfg: RunConfig) -> RunConfig:
        """Starts rl.generation.launch `jaxrl serve` processes, each on its cores, and pins this
        process to the others (a no-op when `jaxrl train` already did, before JAX started);
        returns `cfg` with them as its servers. They compile while the trainer builds."""
        check_config(cfg)
        g = cfg.rl.generation
        cores = local_servers.plan(g.launch, g.cpus)
        if cores.trainer and sorted(os.sched_getaffinity(0)) != cores.trainer:
            local_servers.pin_trainer(cfg)
            self.log(f"warning: the trainer was pinned to cores {cores.trainer} after JAX had "
                     f"started: its thread pools were sized for more; run it with `jaxrl "
                     f"train`, which pins it first")
        model_cfg = model_config(cfg)
        servers = local_servers.LocalServers(
            cfg.checkpoint_dir, generation.engine_config(cfg, model_cfg), model_cfg.dtype,
            cores.servers, Path(cfg.run_dir), self.log, model_cfg.lora)
        self._stack.callback(servers.close)
        self._servers = servers
        if cores.trainer:
            self.log(f"trainer pinned to cores {cores.trainer}")
        return servers.config(cfg)

    def _build_trainer(self) -> None:
        cfg = self.cfg
        self.model_cfg = model_config(cfg)
        trainer_devices, self.engine_devices = generation.placement(cfg)
        mesh = shd.make_mesh(cfg.mesh, trainer_devices)
        check_rl_config(cfg, mesh)
        if not cfg.rl.generation.remote:
            generation.engine_config(cfg, self.model_cfg)
        self.trainer = RLTrainer(cfg, self.model_cfg, mesh, self.log)
        self._stack.callback(self.trainer.close)
        self.trainer.compile_async(pack([], cfg.rl)["arrays"])   # beside the engine's
        self.lockstep = Lockstep()
        self.end = cfg.train.steps + cfg.rl.steps
        self.config_dict = to_dict(cfg)
        with self.lockstep.collective():
            self.first_weights = self._weights()

    def _weights(self):
        """The weights to publish; with several processes every one helps gather them."""
        if self.lockstep.processes == 1:
            return self.trainer.params
        return self.trainer.gathered_params(self.model_cfg.dtype)

    def _build_leader(self, task: Task | None) -> None:
        cfg, rl, log, stack = self.cfg, self.cfg.rl, self.log, self._stack
        r = self.resume = ResumeState.from_saved(self.trainer.data)
        self.task, self.tokenizer = build_task(cfg, self.model_cfg, task)
        step = self.trainer.step
        gen = self.gen = generation.start(cfg, self.model_cfg, self.tokenizer,
                                          self.first_weights, step, self.engine_devices, log)
        stack.callback(gen.close)
        self.agents = None
        if rl.agent.command:
            self.agents = Agents(rl, gen.local, self.tokenizer, "jaxrl", Path(cfg.run_dir),
                                 warn=log)
            stack.callback(self.agents.close)
            log(f"agents: {rl.agent.workers} x {list(rl.agent.command)} against "
                f"{self.agents.url} (their stderr: {Path(cfg.run_dir) / 'agents'})")
        self.rollout_log = RolloutLog(r.position, [Rollout.from_json(x) for x in r.rollouts])
        stack.callback(self.rollout_log.close)
        self.actor = Actor(gen.fleet, self.task, self.tokenizer, self.rollout_log, rl,
                           seed=cfg.train.seed, warn=log, agents=self.agents,
                           resume={"next_problem": r.next_problem, "redo": r.redo,
                                   "partial": r.partial, "stats": r.stats})
        stack.callback(self.actor.stop)
        self.actor.notify_trained(r.position)
        self._build_pipeline(r)
        self.clock = _Clock(r.time_s)
        self.metrics_log = MetricsLogger(Path(cfg.run_dir), wandb=cfg.log.wandb,
                                         wandb_project=cfg.log.wandb_project,
                                         config=self.config_dict, resume_step=step, name="RL",
                                         phase="rl", phase_restarts=self.trainer.restarted)
        stack.callback(self.metrics_log.close)
        self.mode = MODES[rl.mode](self.actor, gen.publisher, self.batches, self.rollout_log,
                                   rl.batch_size, fleet=gen.fleet)

    def _build_pipeline(self, r: ResumeState) -> None:
        """The rollout pipeline. One process: batches go onto the trainer's devices in the
        pipeline's thread. Several: they stay in host memory, are shared, and each process
        puts its own rows (RLTrainer.train)."""
        multi, sharding = self.lockstep.processes > 1, self.trainer.batch_sharding
        dataset, self.lag_stats = rl_batches(
            self.rollout_log, self.cfg.rl, current_step=lambda: self.trainer.step,
            put=(lambda a: a) if multi else (lambda a: jax.device_put(a, sharding)),
            start=r.position, lag_state=r.lag_stats)
        self.batches = iter(dataset)
        self._stack.callback(_close, self.batches)
        self._stack.callback(self.rollout_log.close)    # first: it wakes the prefetch thread
        if r.iterator is not None:
            self.batches.set_state(r.iterator)

    # -- running -------------------------------------------------------------------------------
    def run(self) -> dict | None:
        """Steps until train.steps + rl.steps; the leader's summary, None elsewhere."""
        lead = self.leader
        if lead:
            self._begin()
        like = None if lead else pack([], self.cfg.rl)["arrays"]
        while self.trainer.step < self.end:
            t0 = time.perf_counter()
            batch = self._next_batch() if lead else None
            arrays = self.lockstep.share((lambda: batch["arrays"]) if lead else None, like)
            wait_s = time.perf_counter() - t0
            with self.mode.stepping() if lead else contextlib.nullcontext():
                t0 = time.perf_counter()
                with self.lockstep.collective():
                    train_metrics = self.trainer.train(arrays)
                    published = self._weights()
                step_s = time.perf_counter() - t0
                step = self.trainer.step     # the pipeline's lag filter reads it too
                update = self.gen.publisher.publish(published, step) if lead else None
            if lead:
                self._record(step, batch, train_metrics, wait_s, step_s, update)
            if self._saves(step):
                self.lockstep.sync()
                with self.lockstep.collective():
                    self.trainer.save(self.config_dict, self._resume_data() if lead else {})
                if lead:
                    self.rollout_log.release(self.position)
        return self._summary() if lead else None

    def _begin(self) -> None:
        rl, step = self.cfg.rl, self.trainer.step
        self.eval_before = self.resume.eval_before
        if self.eval_before is None and self.cfg.train.eval_problems:
            self.eval_before = self._held_out()["accuracy"]
            self.metrics_log.log(step, {"eval_accuracy": self.eval_before,
                                        "time_s": self.clock()})
        mesh, processes = self.trainer.mesh, self.lockstep.processes
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
        self.progress = Progress(total=self.end, completed=step, enabled=self.cfg.log.progress,
                                 log=self.log)
        self._stack.callback(self.progress.close)

    def _next_batch(self) -> dict:
        """The next training batch; an actor failure (it closes the log) surfaces here."""
        self.mode.before_batch(self.trainer.step)
        try:
            return next(self.batches)
        except StopIteration:
            if isinstance(self.actor.error, UserError):     # e.g. no server answers: one line
                raise self.actor.error from None
            raise RuntimeError("the rollout stream ended early") from self.actor.error

    def _record(self, step: int, batch: dict, train_metrics, wait_s: float, step_s: float,
                update) -> None:
        """The leader's bookkeeping after a step: the stream's position, metrics, evaluation."""
        self.position = source_position(self.batches.get_state())
        self.actor.notify_trained(self.position)
        self.now = self.clock()
        row, lags, lengths = self.recorder.row(step, batch, train_metrics, now=self.now,
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

    def _saves(self, step: int) -> bool:
        return step % self.cfg.checkpoint.every == 0 or step == self.end

    def _resume_data(self) -> dict:
        snapshot = self.actor.snapshot(self.position)
        return ResumeState(**snapshot, iterator=self.batches.get_state(),
                           lag_stats=self.lag_stats.state(), trained=self.recorder.trained,
                           time_s=self.now, eval_before=self.eval_before).to_saved()

    def _held_out(self) -> dict:
        """Greedy accuracy of the weights the fleet serves (the trainer's newest), decoded by
        the engines beside the rollouts."""
        t0 = time.perf_counter()
        out = evaluate(self.gen.fleet, self.task, self.tokenizer, self.cfg.train.eval_problems,
                       max_new_tokens=self.cfg.rl.max_new_tokens, rl=self.cfg.rl)
        self.clock.exclude(time.perf_counter() - t0)
        return out

    def _summary(self) -> dict:
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
