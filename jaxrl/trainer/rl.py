"""Reinforcement learning after the warm-up: the trainer loop. The parts it wires, each in a
module of its own: the trainer's state and step (rl_trainer.py), the rollout fleet and weight
publisher (generation.py, fleet.py, publisher.py: this process's engine or `jaxrl serve`
processes), the actor that feeds the fleet problems (actor.py), the Grain pipeline that feeds
the trainer rollouts (jaxrl/data/pipeline.py) and the per-step metrics (rl_metrics.py).

mode=async (PipelineRL): the actor keeps every slot busy; after each optimizer step the trainer
publishes its weights and the engines swap them in between two decode steps, so sequences in
flight continue under the new weights (every token records the version that produced it).
mode=sync (conventional RL): generate one step's samples with fixed weights, train, publish,
repeat; the engines idle while the trainer trains and the trainer while the engines generate.
mode=partial (sync with partial rollouts; in-process engine only): the actor keeps the engine
full as in async mode, but the engine pauses while the trainer steps; sequences unfinished when
a batch is complete are not waited for: they keep their tokens and continue under the new
weights after the step.
"""

from __future__ import annotations

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
from jaxrl.rollout import generation
from jaxrl.rollout.actor import Actor
from jaxrl.rollout.agents import Agents
from jaxrl.telemetry.metrics import MetricsLogger
from jaxrl.telemetry.plots import save_run_plots
from jaxrl.telemetry.progress import Progress
from jaxrl.telemetry.rl_metrics import StepMetrics, rate
from jaxrl.trainer.lockstep import Lockstep
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


def check_rl_config(cfg: RunConfig, mesh) -> None:
    dp = shd.data_parallel_size(mesh)
    if cfg.rl.microbatch_rows % dp:
        raise ConfigError(f"rl.microbatch_rows={cfg.rl.microbatch_rows} is not divisible by the "
                          f"{dp}-way data-parallel trainer mesh (mesh.data x mesh.fsdp)")


class _Clock:
    """Wall time of the run without the time spent on held-out evaluation."""

    def __init__(self, offset: float = 0.0):
        self._start = time.perf_counter() - offset
        self._paused = 0.0

    def __call__(self) -> float:
        return time.perf_counter() - self._start - self._paused

    def exclude(self, seconds: float) -> None:
        self._paused += seconds


def reinforce(cfg: RunConfig, log: Callable[[str], None] = print,
              task: Task | None = None) -> dict | None:
    """Runs (or resumes) the RL phase: optimizer steps train.steps .. train.steps + rl.steps.
    Needs a checkpoint at train.steps or later in the checkpoint directory (the warm-up's).
    On several processes (jaxrl/trainer/lockstep.py) process 0 leads and returns the summary; the
    others train beside it and return None. `task`: the Python API's task, instead of the
    config's."""
    model_cfg = model_config(cfg)
    trainer_devices, engine_devices = generation.placement(cfg)
    mesh = shd.make_mesh(cfg.mesh, trainer_devices)
    check_rl_config(cfg, mesh)
    if not cfg.rl.generation.remote:
        generation.engine_config(cfg, model_cfg)
    trainer = RLTrainer(cfg, model_cfg, mesh, log)
    lockstep = Lockstep()
    if lockstep.processes == 1:
        weights = lambda: trainer.params      # noqa: E731
    else:     # process 0 pushes the weights: every process helps gather them
        weights = lambda: trainer.gathered_params(model_cfg.dtype)   # noqa: E731
    with lockstep.collective():
        first_weights = weights()
    if not lockstep.leader:
        return _follow(cfg, trainer, lockstep, weights)
    try:
        return _lead(cfg, model_cfg, trainer, lockstep, weights, first_weights,
                     engine_devices, log, task)
    except BaseException:
        lockstep.abort()
        raise


def _saves(cfg: RunConfig, step: int) -> bool:
    return step % cfg.checkpoint.every == 0 or step == cfg.train.steps + cfg.rl.steps


def _follow(cfg: RunConfig, trainer: RLTrainer, lockstep: Lockstep, weights) -> None:
    """A process other than 0: the same collectives as process 0's loop, in the same order,
    on the batches it shares."""
    end, config_dict = cfg.train.steps + cfg.rl.steps, to_dict(cfg)
    like = pack([], cfg.rl)["arrays"]
    try:
        while trainer.step < end:
            arrays = lockstep.share(None, like)
            with lockstep.collective():
                trainer.train(arrays)
                weights()
            if _saves(cfg, trainer.step):
                lockstep.sync()
                with lockstep.collective():
                    trainer.save(config_dict, {})    # process 0 writes the data item
    finally:
        trainer.close()


def _lead(cfg: RunConfig, model_cfg, trainer: RLTrainer, lockstep: Lockstep, weights,
          first_weights, engine_devices, log: Callable[[str], None],
          task: Task | None) -> dict:
    """Process 0 (the only one on a single host): the actor, the fleet, the rollout pipeline,
    evaluation and metrics, and the trainer's steps."""
    rl, first_rl = cfg.rl, cfg.train.steps
    end = first_rl + rl.steps
    mesh, multi = trainer.mesh, lockstep.processes > 1
    task, tokenizer = build_task(cfg, model_cfg, task)
    step = trainer.step
    gen = generation.start(cfg, model_cfg, tokenizer, first_weights, step, engine_devices, log)
    fleet, publisher = gen.fleet, gen.publisher
    agents = None
    if rl.agent.command:
        try:
            agents = Agents(rl, gen.local, tokenizer, "jaxrl", Path(cfg.run_dir), warn=log)
        except BaseException:
            gen.close()
            raise
        log(f"agents: {rl.agent.workers} x {list(rl.agent.command)} against {agents.url} "
            f"(their stderr: {Path(cfg.run_dir) / 'agents'})")
    data = trainer.data or {"position": 0, "rollouts": [], "redo": [], "next_problem": 0,
                            "iterator": None, "time_s": 0.0, "eval_before": None}
    rollout_log = RolloutLog(data["position"],
                             [Rollout.from_json(r) for r in data["rollouts"]])
    actor = Actor(fleet, task, tokenizer, rollout_log, rl, seed=cfg.train.seed,
                  next_problem=data["next_problem"], redo=tuple(data["redo"]),
                  carry=Actor.carry_from(data), stats=data.get("stats"), warn=log,
                  agents=agents)
    actor.notify_trained(data["position"])
    trainer_step = [step]
    # One process: batches go onto the trainer's devices in the pipeline's thread. Several:
    # they stay in host memory, are shared, and each process puts its own rows (trainer.train).
    dataset, lag_stats = rl_batches(
        rollout_log, rl, current_step=lambda: trainer_step[0],
        put=(lambda a: a) if multi else (lambda a: jax.device_put(a, trainer.batch_sharding)),
        start=data["position"], lag_state=data.get("lag_stats"))
    batches = iter(dataset)
    if data["iterator"] is not None:
        batches.set_state(data["iterator"])

    run_dir = Path(cfg.run_dir)
    config_dict = to_dict(cfg)
    clock = _Clock(data["time_s"])
    metrics_log = MetricsLogger(run_dir, wandb=cfg.log.wandb,
                                wandb_project=cfg.log.wandb_project, config=config_dict,
                                resume_step=step, name="RL", phase="rl",
                                phase_restarts=trainer.restarted)

    def held_out() -> dict:
        """Greedy accuracy of the weights the fleet serves (the trainer's newest), decoded by
        the engines beside the rollouts."""
        t0 = time.perf_counter()
        out = evaluate(fleet, task, tokenizer, cfg.train.eval_problems,
                       max_new_tokens=rl.max_new_tokens, rl=rl)
        clock.exclude(time.perf_counter() - t0)
        return out

    eval_before = data["eval_before"]
    if eval_before is None and cfg.train.eval_problems:
        eval_before = held_out()["accuracy"]
        metrics_log.log(step, {"eval_accuracy": eval_before, "time_s": clock()})
    where = (f"{len(fleet.members)} server(s) {', '.join(rl.generation.servers)}"
             if rl.generation.remote else f"an engine on {len(engine_devices)} device(s)")
    processes = f" in {lockstep.processes} processes" if multi else ""
    log(f"RL ({rl.mode}, {'remote' if rl.generation.remote else rl.placement}, loss {rl.loss}):"
        f" steps {step}..{end}; {rl.prompts_per_step} prompts x {rl.group_size} samples per "
        f"step; trainer on {mesh.size} device(s){processes} {dict(mesh.shape)}, generation on "
        f"{where}; held-out accuracy {eval_before}")

    all_lags, rows = [], []
    recorder = StepMetrics(rl.batch_size, actor, fleet, publisher, lag_stats,
                           data.get("trained", 0), clock())
    t_start = clock()
    if rl.mode in ("async", "partial"):
        actor.start()
    progress = Progress(total=end, completed=step, enabled=cfg.log.progress, log=log)
    try:
        while step < end:
            if rl.mode == "sync":
                publisher.wait(step)
                trained = source_position(batches.get_state())
                actor.generate(max(0, rl.batch_size - (rollout_log.end - trained)))
            t0 = time.perf_counter()
            batch = _next_batch(batches, actor)
            arrays = lockstep.share(lambda: batch["arrays"], None)
            wait_s = time.perf_counter() - t0
            if rl.mode == "partial":
                gen.local.pause()
            t0 = time.perf_counter()
            with lockstep.collective():
                train_metrics = trainer.train(arrays)
                published = weights()
            step_s = time.perf_counter() - t0
            step = trainer_step[0] = trainer.step
            update = publisher.publish(published, step)
            if rl.mode == "partial":
                gen.local.resume()
            position = source_position(batches.get_state())
            actor.notify_trained(position)

            now = clock()
            row, lags, lengths = recorder.row(step, batch, train_metrics, now=now,
                                              wait_s=wait_s, step_s=step_s, update=update)
            all_lags.extend(lags.tolist())
            if rl.eval_every and (step - first_rl) % rl.eval_every == 0 and step < end:
                row["eval_accuracy"] = held_out()["accuracy"]
            metrics_log.log(step, row)
            metrics_log.histogram(step, "lag", lags)
            metrics_log.histogram(step, "completion_len", lengths)
            rows.append({"step": step, **row})
            progress.update(step, row)
            if (drops := actor.drop_report()) is not None:
                log(drops)
            if _saves(cfg, step):
                lockstep.sync()
                with lockstep.collective():
                    trainer.save(config_dict, {
                        **actor.snapshot(position), "iterator": batches.get_state(),
                        "lag_stats": lag_stats.state(), "trained": recorder.trained,
                        "time_s": now, "eval_before": eval_before})
                rollout_log.release(position)
        if cfg.train.eval_problems:
            final_eval = held_out()
    except BaseException:
        lockstep.abort()     # before the clean-up below: the others may wait at a share
        raise
    finally:
        progress.close()
        actor.stop()
        if agents is not None:
            agents.close()
        rollout_log.close()
        gen.close()
        _close(batches)
        trainer.close()
    summary = {"mode": rl.mode, "steps": end, "rl_steps": len(rows),
               "samples_per_s": rate(rows, rl.batch_size),
               "lag_mean": float(np.mean(all_lags)) if all_lags else None,
               "lag_max": int(np.max(all_lags)) if all_lags else None,
               "checkpoint": str(trainer.ckpt.path / str(end)), "eval_before": eval_before,
               "seconds": clock() - t_start}
    if cfg.train.eval_problems:
        result = final_eval
        summary["eval_after"] = result["accuracy"]
        summary["examples"] = result["examples"]
        metrics_log.log(end, {"eval_accuracy": result["accuracy"], "time_s": clock()})
    metrics_log.close()
    summary["plots"] = {k: str(v) for k, v in save_run_plots(run_dir, rows, all_lags).items()}
    return summary


def _next_batch(batches, actor: Actor) -> dict:
    """The next training batch; an actor failure (it closes the log) surfaces here."""
    try:
        return next(batches)
    except StopIteration:
        if isinstance(actor.error, UserError):     # e.g. no server answers: one line
            raise actor.error from None
        raise RuntimeError("the rollout stream ended early") from actor.error


def _close(iterator) -> None:
    close = getattr(iterator, "close", None)
    if close is not None:
        close()
