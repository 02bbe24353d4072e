"""Supervised warm-up: train the model on the task's reference answers, with checkpoints.

Wiring only: the data comes from jaxrl/data, the step from jaxrl/train, the mesh from sharding/.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Callable

import jax
import numpy as np

from jaxrl.config import ConfigError, RunConfig, from_dict, to_dict
from jaxrl.data.sft import sft_dataset
from jaxrl.eval.evaluate import evaluate_model
from jaxrl.heap import frozen_heap
from jaxrl.models import (
    ModelConfig,
    abstract_model,
    from_hf,
    load_hf_config,
    merge_params,
)
from jaxrl.models.lora import LoraConfig
from jaxrl.models.transformer import split_params
from jaxrl.recipe import build_task, model_config
from jaxrl.rl.tasks.base import Task
from jaxrl.telemetry.metrics import open_metrics
from jaxrl.train.checkpoint import Checkpointer, CheckpointError
from jaxrl.train.objectives import SupervisedLoss
from jaxrl.train.state import abstract_state, init_state
from jaxrl.trainer.distributed import is_leader
from jaxrl.trainer.trainer import Phase, Trainer, check_resume
from jaxrl.trainer.warmup_stop import AccuracyStop
from sharding.hosts import fully_addressable, global_batch, local_box
from sharding.mesh import batch_sharding, data_parallel_size, make_mesh


def _check_batch(cfg: RunConfig, mesh) -> None:
    dp, t = data_parallel_size(mesh), cfg.train
    pipe = cfg.sharding.pipeline
    micro, name = ((pipe.microbatches, "sharding.pipeline.microbatches") if pipe.enabled else
                   (t.microbatches, "train.microbatches"))
    per_micro = t.batch_size // micro
    if per_micro % dp:
        raise ConfigError(
            f"train.batch_size={t.batch_size} / {name}={micro} = {per_micro} sequences per "
            f"microbatch, not divisible by the {dp}-way data-parallel mesh (mesh.data x "
            f"mesh.fsdp)")


def _check_same_model(saved: dict, model_cfg: ModelConfig, path: Path) -> None:
    saved_model = from_dict(RunConfig, saved).model if saved.get("hf_path") is None else \
        load_hf_config(saved["hf_path"])
    ours, theirs = to_dict(model_cfg), to_dict(saved_model)
    # Settings of how the model runs, not of its weights; adapters (model.lora) are checked by
    # the restore itself (a warm-up from a random initialisation saves none, see `train`).
    runtime = ("dtype", "attention", "scan_layers", "mlp_backward", "packed_attention",
               "mlp_chunks", "context_attention", "lora", "quantize")
    diff = [k for k in ours if k not in runtime and ours[k] != theirs[k]]
    if diff:
        k = diff[0]
        raise CheckpointError(f"the checkpoint in {str(path)!r} is of another model: "
                              f"model.{k}={theirs[k]!r} there, {ours[k]!r} in this config")


def train(cfg: RunConfig, log: Callable[[str], None] = print, *,
          evaluate_at_end: bool = True, task: Task | None = None) -> dict:
    """Runs (or resumes) supervised warm-up; returns a summary of the run. `task`: the Python
    API's task, instead of the config's."""
    # Everything that can be wrong with the user's input is checked before anything is written.
    latest = check_resume(cfg)
    model_cfg = warmup_model(cfg, log)
    task, tokenizer = build_task(cfg, model_cfg, task)
    mesh = make_mesh(cfg.mesh)
    _check_batch(cfg, mesh)
    # This process builds only the rows of each batch its devices hold (all of them on one
    # host): batch rows laid out as the step takes them, [microbatch, row], cut to its box.
    t = cfg.train
    batch_shard = batch_sharding(mesh, 3, leading=1)
    shape = (t.microbatches, t.batch_size // t.microbatches, t.seq_len)
    rows = np.arange(t.batch_size).reshape(shape[:2])[local_box(batch_shard, shape)[:2]]
    dataset = sft_dataset(task, tokenizer, batch_size=t.batch_size, seq_len=t.seq_len,
                          seed=t.seed, rows=rows)
    dataset[0]  # fails here, naming the example, if train.seq_len is too short
    trainer = Trainer(cfg, model_cfg, mesh, Phase(SupervisedLoss(t.logits_chunk), cfg.optim,
                                                  t.steps), _restore_or_init(cfg, latest, log))

    def batch(step: int) -> dict:
        """Step `step`'s global batch, from the rows this process holds."""
        local = {k: v.reshape(*rows.shape, *v.shape[1:]) for k, v in dataset[step].items()}
        return global_batch(local, batch_shard, dict.fromkeys(local, shape))

    try:
        with frozen_heap():     # the trainer and the data: alive until the end (jaxrl/heap.py)
            return _train(cfg, trainer, (task, tokenizer), batch, log, evaluate_at_end)
    finally:
        trainer.close()


def warmup_model(cfg: RunConfig, log: Callable[[str], None] = lambda _: None) -> ModelConfig:
    """The model the warm-up trains: the config's, but without LoRA adapters and in full
    precision when it starts from a random initialisation (adapters adapt a trained base; RL
    quantizes the warm-up's weights if asked and adds the adapters). From a Hugging Face
    folder the warm-up trains the adapters alone."""
    model_cfg = model_config(cfg)
    if model_cfg.lora.enabled and not cfg.hf_path:
        log(f"model.lora.rank={model_cfg.lora.rank} adapts a trained base: the warm-up from a "
            f"random initialisation trains every weight, RL the adapters")
        model_cfg = dataclasses.replace(model_cfg, lora=LoraConfig(), quantize="none")
    return model_cfg


def _restore_or_init(cfg: RunConfig, latest: int | None, log: Callable[[str], None]):
    """The warm-up's restore (jaxrl/trainer/trainer.py): the newest readable checkpoint of the
    same model, else the Hugging Face folder's weights, else a random initialisation."""
    def restore(ckpt, model_cfg, tx, shardings):
        if latest is not None:
            target = abstract_state(model_cfg, tx, shardings)

            def load(step):   # the model check first: another model's checkpoint is not broken
                _check_same_model(ckpt.saved_config(step), model_cfg, ckpt.path)
                return ckpt.restore(target, step)

            step, state = ckpt.restore_newest(load, log)
            if step is not None:
                log(f"resumed from {ckpt.path}/{step}")
                return None, state
        params = None
        if cfg.hf_path:
            params = split_params(from_hf(cfg.hf_path, model_cfg.dtype,
                                          param_dtype=model_cfg.param_dtype))[1]
        return None, init_state(model_cfg, tx, shardings, cfg.train.seed, params)
    return restore


def _train(cfg: RunConfig, trainer: Trainer, task_tokenizer: tuple, batch: Callable[[int], dict],
           log: Callable[[str], None], evaluate_at_end: bool) -> dict:
    task, tokenizer = task_tokenizer
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    config_dict = to_dict(cfg)
    if is_leader():
        (run_dir / "config.json").write_text(json.dumps(config_dict, indent=2) + "\n")
    first, model_cfg = trainer.step, trainer.model_cfg
    log(f"model: {model_cfg.family}, {model_cfg.num_params() / 1e6:.2f}M parameters; mesh "
        f"{dict(trainer.mesh.shape)}; steps {first}..{cfg.train.steps}")
    pending, last_metrics, start = [], {}, time.perf_counter()
    metrics_log = open_metrics(run_dir, wandb=cfg.log.wandb_run, config=config_dict,
                               name="warm-up", phase="warm-up",
                               # rows a crashed run logged past its checkpoint; never RL's
                               resume_step=first if first < cfg.train.steps else None)
    stop = AccuracyStop(cfg, task, tokenizer, trainer.graphdef)
    stopped_at = None
    try:
        for step in range(first, cfg.train.steps):
            metrics = trainer.run_step(batch(step))
            if _stops(stop, step + 1, trainer, metrics, log):
                stopped_at = step + 1
            pending.append((step + 1, metrics))
            done = step + 1 == cfg.train.steps or stopped_at is not None
            print_now = (step + 1) % cfg.train.log_every == 0 or done
            save_now = (step + 1) % cfg.checkpoint.every == 0 or done
            if print_now or save_now:   # a checkpoint never covers rows not yet on disk
                for s, m in pending:
                    row = {k: float(v) for k, v in jax.device_get(m).items()}
                    metrics_log.log(s, row)
                pending, last_metrics = [], row
            if print_now:
                log(f"step {s:>5}  loss {row['loss']:.4f}  token_acc "
                    f"{row['token_accuracy']:.3f}  lr {row['lr']:.2e}")
            if save_now:
                trainer.save(config_dict)
            if stopped_at is not None:
                break
    finally:
        stop.close()
        metrics_log.close()
    trainer.ckpt.wait()
    seconds = time.perf_counter() - start
    last = stopped_at or cfg.train.steps
    steps_run = last - first
    summary = {"steps": last, "loss": last_metrics.get("loss"), "stopped_at": stopped_at,
               "stop_accuracy": last_metrics.get("check_accuracy"),
               "checkpoint": str(trainer.ckpt.path / str(trainer.ckpt.latest_step())),
               "samples_per_s": steps_run * cfg.train.batch_size / seconds if steps_run else 0.0,
               "seconds": seconds}
    if cfg.train.eval_problems and evaluate_at_end:
        model = merge_params(trainer.graphdef, fully_addressable(trainer.params))
        summary["eval"] = evaluate_model(model, task, tokenizer, cfg.train.eval_problems,
                                         max_new_tokens=cfg.rl.max_new_tokens, rl=cfg.rl)
    return summary


def _stops(stop: AccuracyStop, step: int, trainer: Trainer, metrics: dict,
           log: Callable[[str], None]) -> bool:
    """Whether the warm-up stops after `step` (train.stop_at_accuracy reached on the training
    problems, checked every so many steps); the check's accuracy goes into `metrics`. A
    stopping trainer's step is renumbered to train.steps, where RL's step numbers begin (the
    optimizer state inside still counts the steps taken)."""
    accuracy = stop.check(step, lambda: trainer.params)
    if accuracy is None:
        return False
    metrics["check_accuracy"] = accuracy
    log(f"step {step:>5}  greedy accuracy {accuracy:.1%} on {len(stop.problems)} training "
        f"problems (train.stop_at_accuracy={stop.target})")
    if accuracy < stop.target:
        return False
    last = stop.last_step
    log(f"the warm-up stops at step {step}; its weights are saved as step {last}, where RL "
        f"begins")
    trainer.set_step(last)
    return True


def restore_for_eval(checkpoint_dir: str | Path, step: int | None = None, *,
                     with_config: bool = False):
    """(model, task, tokenizer, step) from a checkpoint directory written by `train`, and the
    run's config after them if `with_config`."""
    ckpt = Checkpointer(checkpoint_dir, create=False)
    step = ckpt.resolve_step(step)
    cfg = from_dict(RunConfig, ckpt.saved_config(step))
    # An RL checkpoint holds the run's model; a warm-up's, the warm-up's (`warmup_model`).
    model_cfg = model_config(cfg) if ckpt.saved_data(step) is not None else warmup_model(cfg)
    task, tokenizer = build_task(cfg, model_cfg)
    graphdef, abstract = split_params(abstract_model(model_cfg))
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device),
                          abstract)
    params = ckpt.restore({"params": target}, step, params_only=True)["params"]
    ckpt.close()
    out = merge_params(graphdef, params), task, tokenizer, step
    return (*out, cfg) if with_config else out
