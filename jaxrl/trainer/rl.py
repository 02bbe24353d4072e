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
its `Leader` (rl_leader.py) runs the actor, the fleet, the pipeline, evaluation and metrics,
and shares each batch; the others' `Follower` takes it. The loop is the same on every process.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path
from typing import Callable

import jax

from jaxrl.config import ConfigError, RunConfig, to_dict
from jaxrl.data.pipeline import pack
from jaxrl.heap import frozen_heap
from jaxrl.recipe import model_config
from jaxrl.rl.tasks.base import Task
from jaxrl.rollout import generation, local_servers
from jaxrl.trainer.lockstep import Lockstep
from jaxrl.trainer.rl_leader import Follower, Leader
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
    if cfg.rl.multiplex:
        if not cfg.rl.generation.remote and cfg.rl.placement == "colocated":
            raise ConfigError("rl.multiplex=true lends the trainer's devices to generation "
                              "while it waits; with rl.placement=colocated they generate "
                              "already: set rl.placement=split or generation servers")
        if jax.process_count() > 1:
            raise ConfigError(f"rl.multiplex=true runs an engine on this process's trainer "
                              f"devices; across {jax.process_count()} processes it would sit "
                              f"on one host's: leave it false")
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
        if unheld := local_servers.unlaunchable(cfg.rl.engine):
            raise ConfigError(f"rl.generation.launch starts jaxrl serve, which has no flag for "
                              f"{', '.join(unheld)}: leave them at their defaults, or generate "
                              f"in this process")


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
            self.part = Follower(cfg) if not self.leader else Leader(
                cfg, self.trainer, task=task, first_weights=self.first_weights,
                engine_devices=self.engine_devices, processes=self.lockstep.processes,
                stack=self._stack, log=log)
            self.first_weights = None    # served now (leader): not kept for the whole run
            self._stack.enter_context(frozen_heap())     # the first to end (jaxrl/heap.py)
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
        served = generation.rollout_model(model_config(cfg), g.weights)
        servers = local_servers.LocalServers(
            cfg.checkpoint_dir, generation.engine_config(cfg, served), served, cores.servers,
            Path(cfg.run_dir), self.log, admission=generation.server_admission(cfg.rl.admission))
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

    # -- running -------------------------------------------------------------------------------
    def run(self) -> dict | None:
        """Steps until train.steps + rl.steps; the leader's summary, None elsewhere. Every
        process runs the same collectives in the same order; what only the leader does is
        its `part`'s (jaxrl/trainer/rl_leader.py)."""
        part = self.part
        part.begin()
        while self.trainer.step < self.end:
            t0 = time.perf_counter()
            arrays = part.next_arrays(self.lockstep)
            wait_s = time.perf_counter() - t0
            with part.stepping():
                t0 = time.perf_counter()
                with self.lockstep.collective():
                    train_metrics = self.trainer.train(arrays)
                    published = self._weights()
                step_s = time.perf_counter() - t0
                step = self.trainer.step     # the pipeline's lag filter reads it too
                update = part.publish(published, step)
            part.record(step, train_metrics, wait_s, step_s, update)
            if self._saves(step):
                self.lockstep.sync()
                with self.lockstep.collective():
                    self.trainer.save(self.config_dict, part.resume_data())
                part.saved()
        return part.summary()

    def _saves(self, step: int) -> bool:
        return step % self.cfg.checkpoint.every == 0 or step == self.end


