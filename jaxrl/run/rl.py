"""Reinforcement learning after the warm-up, in one process: the trainer (a jitted, sharded
step on its mesh), the serving engine (orchestrator + engine on its devices), the actor that
feeds the engine problems, and the Grain pipeline that feeds the trainer rollouts.

mode=async (PipelineRL): the actor keeps every slot busy; after each optimizer step the trainer
publishes its weights and the engine swaps them in between two decode steps, so sequences in
flight continue under the new weights (every token records the version that produced it).
mode=sync (conventional RL): generate one step's samples with fixed weights, train, publish,
repeat; the engine idles while the trainer trains and the trainer while the engine generates.
mode=partial (sync with partial rollouts): the actor keeps the engine full as in async mode, but
the engine pauses while the trainer steps; sequences unfinished when a batch is complete are
not waited for: they keep their tokens and continue under the new weights after the step.

Wiring only: the parts live in serving/, jaxrl/data, jaxrl/rl and jaxrl/train.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.config import ConfigError, RunConfig, to_dict
from jaxrl.data.pipeline import rl_batches
from jaxrl.data.rollouts import Rollout, RolloutLog, source_position
from jaxrl.models import abstract_model, from_hf
from jaxrl.models.transformer import split_params
from jaxrl.run.actor import Actor
from jaxrl.run.evaluate import evaluate
from jaxrl.run.metrics import MetricsLogger
from jaxrl.run.plots import save_run_plots
from jaxrl.run.progress import Progress
from jaxrl.run.warmup import build_task, model_config
from jaxrl.train.checkpoint import Checkpointer
from jaxrl.train.objectives import PolicyGradientLoss
from jaxrl.train.optim import lr_schedule, make_optimizer
from jaxrl.train.step import (abstract_state, init_state, make_train_step,
                              optimizer_on_device, state_shardings)
from serving.engine import Engine, EngineConfig
from serving.orchestrator import Orchestrator
from sharding import mesh as shd


def placement(cfg: RunConfig, devices=None):
    """(trainer devices, engine devices)."""
    devices = list(devices if devices is not None else jax.devices())
    if cfg.rl.placement == "colocated":
        return devices, devices
    k = cfg.rl.engine_devices
    if k >= len(devices):
        raise ConfigError(f"rl.placement=split with rl.engine_devices={k} leaves no device to "
                          f"train on ({len(devices)} devices)")
    return devices[:-k], devices[-k:]


def engine_config(cfg: RunConfig, model_cfg) -> EngineConfig:
    rl = cfg.rl
    if rl.sample_len > model_cfg.max_seq_len:
        raise ConfigError(f"rl.max_prompt_len + rl.max_new_tokens = {rl.sample_len} exceeds "
                          f"the model's max_seq_len={model_cfg.max_seq_len}")
    chunk = max(8, min(2 ** math.ceil(math.log2(rl.max_prompt_len)), 512))
    return EngineConfig(max_concurrent_decodes=rl.slots, max_len=rl.sample_len + 1,
                        max_prefill_length=rl.max_prompt_len, prefill_chunk=chunk,
                        prefill_budget=max(64, chunk), dtype=model_cfg.dtype,
                        attention=rl.engine_attention)


def make_objective(cfg: RunConfig) -> PolicyGradientLoss:
    rl = cfg.rl
    return PolicyGradientLoss(kind=rl.loss, temperature=rl.temperature, tis_cap=rl.tis_cap,
                              clip_low=rl.clip_low, clip_high=rl.clip_high,
                              kl_coef=rl.kl_coef, max_segments=rl.max_segments,
                              logits_chunk=cfg.train.logits_chunk)


def check_config(cfg: RunConfig) -> None:
    """Everything about the RL config that can be wrong, checked before any training (the
    warm-up included) starts."""
    trainer_devices, _ = placement(cfg)
    check_rl_config(cfg, shd.make_mesh(cfg.mesh, trainer_devices))
    engine_config(cfg, model_config(cfg))


def check_rl_config(cfg: RunConfig, mesh) -> None:
    dp = shd.data_parallel_size(mesh)
    if cfg.rl.microbatch_rows % dp:
        raise ConfigError(f"rl.microbatch_rows={cfg.rl.microbatch_rows} is not divisible by the "
                          f"{dp}-way data-parallel trainer mesh (mesh.data x mesh.fsdp)")


def batch_stats(rollouts: list[Rollout], step: int) -> dict:
    """Statistics of the samples a step trained on (after the filters)."""
    rewards = np.asarray([r.reward for r in rollouts])
    lags = np.asarray([step - min(r.versions) for r in rollouts])
    return {"trained_reward": float(rewards.mean()),
            "lag_min": int(lags.min()), "lag_mean": float(lags.mean()),
            "lag_max": int(lags.max()),
            "completion_tokens": float(np.mean([len(r.completion) for r in rollouts]))}, lags


class _Clock:
    """Wall time of the run without the time spent on held-out evaluation."""

    def __init__(self, offset: float = 0.0):
        self._start = time.perf_counter() - offset
        self._paused = 0.0

    def __call__(self) -> float:
        return time.perf_counter() - self._start - self._paused

    def exclude(self, seconds: float) -> None:
        self._paused += seconds


def reinforce(cfg: RunConfig, log: Callable[[str], None] = print) -> dict:
    """Runs (or resumes) the RL phase: optimizer steps train.steps .. train.steps + rl.steps.
    Needs a checkpoint at train.steps or later in the checkpoint directory (the warm-up's)."""
    rl, first_rl = cfg.rl, cfg.train.steps
    end = first_rl + rl.steps
    model_cfg = model_config(cfg)
    task, tokenizer = build_task(cfg, model_cfg)
    trainer_devices, engine_devices = placement(cfg)
    mesh = shd.make_mesh(cfg.mesh, trainer_devices)
    check_rl_config(cfg, mesh)
    engine_cfg = engine_config(cfg, model_cfg)

    ckpt = Checkpointer(cfg.checkpoint_dir, keep=cfg.checkpoint.keep,
                        async_save=cfg.checkpoint.async_save)
    latest = ckpt.latest_step()
    if first_rl and (latest is None or latest < first_rl):
        raise ConfigError(f"RL starts from the warm-up's checkpoint at step {first_rl}; "
                          f"{ckpt.path} holds {latest}")
    tx = make_optimizer(rl.optim, rl.steps)
    schedule = lr_schedule(rl.optim, rl.steps)
    shardings = state_shardings(model_cfg, tx, mesh,
                                offload_optimizer=cfg.train.offload_optimizer)
    if rl.kl_coef > 0:
        shardings["ref_params"] = shardings["params"]
    target = abstract_state(model_cfg, tx, shardings)
    if rl.kl_coef > 0:
        target["ref_params"] = target["params"]

    def load(step):   # an RL checkpoint: (data, state); the warm-up's: (None, params)
        data = ckpt.saved_data(step)
        if data is not None:
            return data, ckpt.restore(target, step)
        return None, ckpt.restore({"params": target["params"]}, step, params_only=True)["params"]

    if latest is not None:
        latest, loaded = ckpt.restore_newest(load, log)
    data, restored = loaded if latest is not None else (None, None)
    if first_rl and (latest is None or latest < first_rl):
        raise ConfigError(f"RL starts from the warm-up's checkpoint at step {first_rl}; "
                          f"{ckpt.path} holds {latest} (after setting aside unreadable steps)")
    rl_restarts = data is None      # no RL checkpoint yet: RL starts (over) from the warm-up's
    if data is not None:  # an RL checkpoint: resume everything
        state = restored
        log(f"resumed RL from {ckpt.path}/{latest}")
    else:  # fresh RL optimizer on the warm-up's weights (or, without warm-up, the model's)
        if latest is not None:
            params = restored
        elif cfg.hf_path:
            params = split_params(from_hf(cfg.hf_path, model_cfg.dtype,
                                          param_dtype=model_cfg.param_dtype))[1]
            log(f"RL starts from {cfg.hf_path} (no warm-up)")
        else:
            params = None  # random initialisation
        state = init_state(model_cfg, tx, {k: v for k, v in shardings.items()
                                           if k != "ref_params"}, cfg.train.seed, params)
        state["step"] = jax.device_put(jnp.asarray(first_rl, jnp.int32), shardings["step"])
        if rl.kl_coef > 0:
            state["ref_params"] = jax.tree.map(jnp.copy, state["params"])
    graphdef, _ = split_params(abstract_model(model_cfg))
    step_fn = jax.jit(make_train_step(graphdef, tx, lambda s: schedule(s - first_rl),
                                      make_objective(cfg), remat=cfg.train.remat,
                                      pipeline=cfg.sharding.pipeline, mesh=mesh,
                                      opt_device=optimizer_on_device(shardings)),
                      in_shardings=(shardings, shd.batch_sharding(mesh, 3, leading=1)),
                      out_shardings=(shardings, shd.replicated(mesh)), donate_argnums=0)
    step = int(state["step"])

    engine_mesh = shd.make_mesh(shd.MeshConfig(fsdp=1, tensor=-1), engine_devices)
    engine = Engine(model_cfg, engine_cfg, mesh=engine_mesh)
    engine.load_params(state["params"], version=step)
    orchestrator = Orchestrator(engine, eos_id=tokenizer.eos_id, max_queued=4 * rl.batch_size,
                                longest_first=rl.admission == "longest_first").start()
    data = data or {"position": 0, "rollouts": [], "redo": [], "next_problem": 0,
                    "iterator": None, "time_s": 0.0, "eval_before": None}
    rollout_log = RolloutLog(data["position"],
                             [Rollout.from_json(r) for r in data["rollouts"]])
    actor = Actor(orchestrator, task, tokenizer, rollout_log, rl, seed=cfg.train.seed,
                  next_problem=data["next_problem"], redo=tuple(data["redo"]),
                  carry=Actor.carry_from(data), stats=data.get("stats"), warn=log)
    actor.notify_trained(data["position"])
    batch_sharding = shd.batch_sharding(mesh, 3, leading=1)
    trainer_step = [step]
    dataset, lag_stats = rl_batches(
        rollout_log, rl, current_step=lambda: trainer_step[0],
        put=lambda a: jax.device_put(a, batch_sharding), start=data["position"],
        lag_state=data.get("lag_stats"))
    batches = iter(dataset)
    if data["iterator"] is not None:
        batches.set_state(data["iterator"])

    run_dir = Path(cfg.run_dir)
    config_dict = to_dict(cfg)
    clock = _Clock(data["time_s"])
    metrics_log = MetricsLogger(run_dir, wandb=cfg.log.wandb,
                                wandb_project=cfg.log.wandb_project, config=config_dict,
                                resume_step=step, name="RL", phase="rl",
                                phase_restarts=rl_restarts)

    def held_out() -> dict:
        """Greedy accuracy of the weights the engine serves (the trainer's newest), decoded
        by the engine beside the rollouts."""
        t0 = time.perf_counter()
        out = evaluate(orchestrator, task, tokenizer, cfg.train.eval_problems,
                       max_new_tokens=rl.max_new_tokens)
        clock.exclude(time.perf_counter() - t0)
        return out

    eval_before = data["eval_before"]
    if eval_before is None and cfg.train.eval_problems:
        eval_before = held_out()["accuracy"]
        metrics_log.log(step, {"eval_accuracy": eval_before, "time_s": clock()})
    log(f"RL ({rl.mode}, {rl.placement}, loss {rl.loss}): steps {step}..{end}; "
        f"{rl.prompts_per_step} prompts x {rl.group_size} samples per step; trainer on "
        f"{len(trainer_devices)} device(s) {dict(mesh.shape)}, engine on "
        f"{len(engine_devices)}; held-out accuracy {eval_before}")

    all_lags, rows = [], []
    trained_total = data.get("trained", 0)
    engine_before, actor_before = orchestrator.metrics(), actor.stats.copy()
    t_start = t_prev = clock()
    if rl.mode in ("async", "partial"):
        actor.start()
    progress = Progress(total=end, completed=step, enabled=cfg.log.progress, log=log)
    try:
        while step < end:
            if rl.mode == "sync":
                trained = source_position(batches.get_state())
                actor.generate(max(0, rl.batch_size - (rollout_log.end - trained)))
            t0 = time.perf_counter()
            batch = _next_batch(batches, actor)
            wait_s = time.perf_counter() - t0
            if rl.mode == "partial":
                orchestrator.pause()
            t0 = time.perf_counter()
            state, metrics = jax.block_until_ready(step_fn(state, batch["arrays"]))
            step_s = time.perf_counter() - t0
            step += 1
            trainer_step[0] = step
            update = orchestrator.update_params(state["params"], version=step)
            if rl.mode == "partial":
                orchestrator.resume()
            position = source_position(batches.get_state())
            actor.notify_trained(position)

            now = clock()
            engine_now = orchestrator.metrics()
            stats, lags = batch_stats(batch["rollouts"], step - 1)
            trained_total += len(batch["rollouts"])
            # Reward and success of everything generated since the last step, before filters.
            # NaN (logged as null) when nothing finished since the last step.
            scored = actor.stats["scored"] - actor_before["scored"]
            stats["reward"] = (actor.stats["reward_sum"] - actor_before["reward_sum"]) / scored \
                if scored else math.nan
            stats["success_rate"] = (actor.stats["solved"] - actor_before["solved"]) / scored \
                if scored else math.nan
            actor_before = actor.stats.copy()
            all_lags.extend(lags.tolist())
            slot_steps = engine_now["steps"] - engine_before["steps"]
            row = {**{k: float(v) for k, v in jax.device_get(metrics).items()}, **stats,
                   "time_s": now, "samples_per_s": rl.batch_size / max(now - t_prev, 1e-9),
                   "generated_tokens_per_s": (engine_now["generated_tokens"] -
                                              engine_before["generated_tokens"])
                   / max(now - t_prev, 1e-9),
                   "trainer_wait_s": wait_s, "step_s": step_s, "update_pause_ms": 1e3 * update.pause_s,
                   "update_transfer_ms": 1e3 * update.transfer_s,
                   "slots_busy_fraction": (engine_now["busy_slot_steps"] -
                                           engine_before["busy_slot_steps"])
                   / max(slot_steps * rl.slots, 1),
                   **lag_stats.fractions(), **sample_counts(actor.stats, trained_total,
                                                            lag_stats.total),
                   "microbatches": batch["microbatches"]}
            row["trained_tokens_per_s"] = row["trained_tokens"] / max(now - t_prev, 1e-9)
            row["held_tokens_mean"] = (engine_now["held_tokens"] - engine_before["held_tokens"]) \
                / max(engine_now["busy_slot_steps"] - engine_before["busy_slot_steps"], 1)
            lengths = actor.take_lengths()
            row.update(length_quantiles(lengths))
            engine_before, t_prev = engine_now, now
            if rl.eval_every and (step - first_rl) % rl.eval_every == 0 and step < end:
                row["eval_accuracy"] = held_out()["accuracy"]
            metrics_log.log(step, row)
            metrics_log.histogram(step, "lag", lags)
            metrics_log.histogram(step, "completion_len", lengths)
            rows.append({"step": step, **row})
            progress.update(step, row)
            if step % cfg.checkpoint.every == 0 or step == end:
                data = {**actor.snapshot(position), "iterator": batches.get_state(),
                        "lag_stats": lag_stats.state(), "trained": trained_total, "time_s": now,
                        "eval_before": eval_before}
                ckpt.save(state, config_dict, data=data)
                rollout_log.release(position)
        if cfg.train.eval_problems:
            final_eval = held_out()
    finally:
        progress.close()
        actor.stop()
        rollout_log.close()
        orchestrator.stop()
        _close(batches)
        ckpt.wait()
        ckpt.close()
    summary = {"mode": rl.mode, "steps": end, "rl_steps": len(rows),
               "samples_per_s": _rate(rows, rl.batch_size),
               "lag_mean": float(np.mean(all_lags)) if all_lags else None,
               "lag_max": int(np.max(all_lags)) if all_lags else None,
               "checkpoint": str(ckpt.path / str(end)), "eval_before": eval_before,
               "seconds": clock() - t_start}
    if cfg.train.eval_problems:
        result = final_eval
        summary["eval_after"] = result["accuracy"]
        summary["examples"] = result["examples"]
        metrics_log.log(end, {"eval_accuracy": result["accuracy"], "time_s": clock()})
    metrics_log.close()
    summary["plots"] = {k: str(v) for k, v in save_run_plots(run_dir, rows, all_lags).items()}
    return summary


def sample_counts(actor_stats: dict, trained: int, dropped_lag: int) -> dict:
    """Where every sample went, cumulative over the run (a resumed run continues the counts):
    generated = dropped_zero_advantage + dropped_overlong + kept, and
    kept = trained + dropped_lag + what waits in the rollout stream (a checkpoint's `rollouts`,
    when the checkpoint is taken)."""
    return {"samples_generated": actor_stats["scored"], "samples_kept": actor_stats["samples"],
            "samples_trained": trained, "dropped_lag": dropped_lag,
            "dropped_zero_advantage": actor_stats["dropped_zero_advantage"],
            "dropped_overlong": actor_stats["dropped_overlong"],
            "carried_tokens": actor_stats["carried_tokens"]}


def length_quantiles(lengths: list[int]) -> dict:
    """The output-length distribution of the samples generated during a step (before filters):
    completion_len_{p10,p50,p90,max}; none when no group finished during the step."""
    if not lengths:
        return {}
    p10, p50, p90 = np.percentile(lengths, [10, 50, 90])
    return {"completion_len_p10": float(p10), "completion_len_p50": float(p50),
            "completion_len_p90": float(p90), "completion_len_max": float(max(lengths))}


def _rate(rows: list[dict], batch_size: int) -> float:
    if len(rows) < 2:
        return 0.0
    return batch_size * (len(rows) - 1) / max(rows[-1]["time_s"] - rows[0]["time_s"], 1e-9)


def _next_batch(batches, actor: Actor) -> dict:
    """The next training batch; an actor failure (it closes the log) surfaces here."""
    try:
        return next(batches)
    except StopIteration:
        raise RuntimeError("the rollout stream ended early") from actor.error


def _close(iterator) -> None:
    close = getattr(iterator, "close", None)
    if close is not None:
        close()
