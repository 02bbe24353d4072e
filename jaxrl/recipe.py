"""What a run's configuration builds before anything runs: its model configuration (the
config's, or the Hugging Face folder's) and its task and tokenizer. Shared by `jaxrl train`
(warm-up and RL), `jaxrl serve`, `jaxrl eval` and `jaxrl compile`."""

from __future__ import annotations

import dataclasses

from jaxrl.config import ConfigError, RunConfig
from jaxrl.models import ModelConfig, load_hf_config
from jaxrl.models.lora import LoraConfig
from jaxrl.models.peft_io import read_config
from jaxrl.models.tokenizer import CharTokenizer, HFTokenizer, Tokenizer
from jaxrl.rl.tasks.arithmetic import ArithmeticTask
from jaxrl.rl.tasks.base import Task
from jaxrl.rl.tasks.countdown import CountdownTask
from jaxrl.rl.tasks.custom import CustomTask, load_object
from jaxrl.rl.tasks.math import MathTask
from jaxrl.rl.tasks.toolcalc import ToolCalcTask


def model_config(cfg: RunConfig) -> ModelConfig:
    model_cfg = _hf_model(cfg) if cfg.hf_path else cfg.model
    if model_cfg.lora.init_from:
        model_cfg = dataclasses.replace(model_cfg, lora=adapter_settings(model_cfg.lora))
    return model_cfg


def adapter_settings(lora: LoraConfig) -> LoraConfig:
    """`lora` with its rank, alpha, targets and rsLoRA setting taken from the PEFT folder it
    starts from (`init_from`; the dropout, a training setting, stays the run's); ConfigError for a folder that is not one, or a rank set to
    something else."""
    try:
        found = read_config(lora.init_from)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.lora.init_from={lora.init_from!r}: {e}") from e
    if lora.rank not in (0, found.rank):
        raise ConfigError(f"model.lora.rank={lora.rank} but the adapter in "
                          f"model.lora.init_from={lora.init_from!r} has r={found.rank}; leave "
                          f"model.lora.rank unset (or 0) to take the folder's")
    return dataclasses.replace(found, init_from=lora.init_from, dropout=lora.dropout)


def _hf_model(cfg: RunConfig) -> ModelConfig:
    model_cfg = load_hf_config(cfg.hf_path, dtype=cfg.model.dtype,
                               param_dtype=cfg.model.param_dtype, attention=cfg.model.attention,
                               max_segments=cfg.model.max_segments,
                               scan_layers=cfg.model.scan_layers,
                               mlp_backward=cfg.model.mlp_backward,
                               packed_attention=cfg.model.packed_attention,
                               context_attention=cfg.model.context_attention)
    model_cfg = dataclasses.replace(model_cfg, mlp_chunks=cfg.model.mlp_chunks,
                                    lora=cfg.model.lora, quantize=cfg.model.quantize)
    cfg.check_pipeline(model_cfg)
    if cfg.mesh.context > 1:
        cfg.check_context(model_cfg)
    return model_cfg


def build_task(cfg: RunConfig, model_cfg: ModelConfig,
               task: Task | None = None) -> tuple[Task, Tokenizer]:
    """The run's task (`task` when the Python API gives one, else the config's) and tokenizer
    (the model folder's, else the built-in task's characters)."""
    tokenizer = HFTokenizer(cfg.hf_path) if cfg.hf_path else None
    if task is None:
        task = _task_from_config(cfg, tokenizer)
    if tokenizer is None:
        alphabet = getattr(task, "alphabet", None)
        if alphabet is None:
            raise ConfigError(f"the {task.name!r} task writes text the built-in character "
                              f"tokenizer cannot encode: set hf_path to a Hugging Face model "
                              f"folder (its tokenizer.json is used)")
        tokenizer = CharTokenizer(alphabet)
    if tokenizer.vocab_size > model_cfg.vocab_size:
        raise ConfigError(f"the tokenizer has {tokenizer.vocab_size} tokens but "
                          f"model.vocab_size={model_cfg.vocab_size}")
    return task, tokenizer


def _task_from_config(cfg: RunConfig, tokenizer: Tokenizer | None) -> Task:
    name = cfg.task.name
    if name == "math":
        if not cfg.hf_path:
            raise ConfigError("task.name=math needs hf_path: a Hugging Face model folder with "
                              "its tokenizer.json (the demo model only knows arithmetic)")
        return MathTask(cfg.task)
    if name == "custom":
        if cfg.task.factory:
            task = load_object(cfg.task.factory, "task.factory")(cfg.task)
            missing = [m for m in ("sample", "held_out", "score") if not hasattr(task, m)]
            if missing:
                raise ConfigError(f"task.factory={cfg.task.factory!r} returned "
                                  f"{type(task).__name__}, which lacks {', '.join(missing)} "
                                  f"(jaxrl/rl/tasks/base.py: the Task API)")
            return task
        return CustomTask.from_config(cfg.task, tokenizer)
    return {"countdown": CountdownTask, "toolcalc": ToolCalcTask,
            "arithmetic": ArithmeticTask}[name](cfg.task)
