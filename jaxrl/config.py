"""Typed run configuration: frozen dataclasses, YAML files that override them, `key=value` overrides.

The dataclasses are the one source of defaults. A YAML file in `configs/` overrides some fields,
`section.key=value` on the command line overrides the YAML, and an unknown key, a value of the
wrong type or a key given twice is a `ConfigError` that names the key and what is allowed.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

import yaml

from jaxrl.errors import UserError
from jaxrl.models.config import ModelConfig
from jaxrl.optim_config import OptimConfig
from jaxrl.rl.config import RLConfig
from jaxrl.rl.tasks.arithmetic import ArithmeticConfig
from jaxrl.rl.tasks.countdown import CountdownConfig
from jaxrl.rl.tasks.custom import CustomConfig
from jaxrl.rl.tasks.math import MathConfig
from jaxrl.rl.tasks.toolcalc import ToolCalcConfig
from jaxrl.train.config import CheckpointConfig, TrainConfig
from sharding.mesh import MeshConfig
from sharding.pipeline import PipelineConfig


class ConfigError(UserError):
    """A configuration value or key that is not allowed; the message names it."""


def from_dict(cls: type, data: Mapping[str, Any], prefix: str = "") -> Any:
    """Builds dataclass `cls` from a nested mapping, checking every key and type."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"'{prefix.rstrip('.') or 'config'}' must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    unknown = sorted(set(data) - set(names))
    renamed = [k for k in unknown if k in getattr(cls, "RENAMED", {})]
    if renamed:
        raise ConfigError(f"config key '{prefix}{renamed[0]}' is now "
                          f"'{prefix}{cls.RENAMED[renamed[0]]}'")
    if unknown:
        where = f"section '{prefix.rstrip('.')}'" if prefix else "the top level"
        raise ConfigError(
            f"unknown config key '{prefix}{unknown[0]}'; {where} allows: {', '.join(names)}")
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    kwargs = {k: _convert(hints[k], _with_default(defaults[k], v), prefix + k)
              for k, v in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e)) from e


def _with_default(default: Any, value: Any) -> Any:
    """A section's values over its field's default instance (not the class defaults): e.g.
    rl.optim keeps RL's own optimizer defaults when only rl.optim.lr is set."""
    if not (dataclasses.is_dataclass(default) and isinstance(value, Mapping)):
        return value
    if value.get("name", getattr(default, "name", None)) != getattr(default, "name", None):
        return value  # another member of a tagged union
    return merge(dataclasses.asdict(default), value)


def _convert(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) > 1:
            return _convert_tagged(options, value, key)
        return _convert(options[0], value, key)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value if value is not None else {}, key + ".")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}={value!r} is not allowed; choose one of: "
                              + ", ".join(repr(a) for a in args))
        return value
    if origin is tuple:
        if isinstance(value, str) and args[0] is str:   # "a,b" from the command line
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={value!r}: expected a list")
        elem = args[0]
        return tuple(_convert(elem, v, f"{key}[{i}]") for i, v in enumerate(value))
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}={value!r}: expected true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}={value!r}: expected an integer")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}={value!r}: expected a number")
        return float(value)
    if tp is str:
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)     # YAML reads a string of digits (a core, a name) as a number
        if not isinstance(value, str):
            raise ConfigError(f"{key}={value!r}: expected a string")
        return value
    raise TypeError(f"config field {key} has unsupported type {tp}")


def _convert_tagged(options: list[type], value: Any, key: str) -> Any:
    """A union of dataclasses told apart by their `name` field (the first is the default)."""
    names = {dataclasses.fields(c)[0].default: c for c in options}
    value = value if value is not None else {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"'{key}' must be a mapping, got {value!r}")
    name = value.get("name", next(iter(names)))
    if name not in names:
        raise ConfigError(f"{key}.name={name!r} is not allowed; choose one of: "
                          + ", ".join(repr(n) for n in names))
    return from_dict(names[name], value, key + ".")


def parse_overrides(overrides: Sequence[str]) -> dict[str, Any]:
    """`["train.steps=10", "model.dtype=bfloat16"]` -> nested dict; values parse as YAML scalars."""
    nested: dict[str, Any] = {}
    seen: set[str] = set()
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form section.key=value")
        if key in seen:
            raise ConfigError(f"override key '{key}' is given twice")
        seen.add(key)
        node = nested
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{key}' conflicts with another override of '{p}'")
        if leaf in node and isinstance(node[leaf], dict):
            raise ConfigError(f"override '{key}' conflicts with overrides inside it")
        node[leaf] = yaml.safe_load(raw) if raw.strip() else ""
    return nested


def merge(base: dict[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in update.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = merge(dict(out[k]), v)
        else:
            out[k] = v
    return out


def load_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top level")
    return data


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


# ---------------------------------------------------------------------------------------------
# The run: every section of a `jaxrl train` config.


# Model fields that are runtime choices, allowed next to `hf_path` (the rest come from its
# config.json).
RUNTIME_MODEL_KEYS = ("dtype", "param_dtype", "attention", "max_segments", "scan_layers",
                      "mlp_backward", "packed_attention", "context_attention", "mlp_chunks",
                      "lora", "quantize")


@dataclasses.dataclass(frozen=True)
class LogConfig:
    """Where metrics go besides metrics.jsonl and TensorBoard (always written to run_dir)."""

    progress: bool = True          # a live progress bar on a terminal
    wandb: bool = False            # also log to Weights & Biases (pip install wandb; honours
    wandb_project: str = "jaxrl"   # WANDB_MODE=offline)

    @property
    def wandb_run(self) -> str | None:
        """The W&B project to log to, or None."""
        return self.wandb_project if self.wandb else None


@dataclasses.dataclass(frozen=True)
class ShardingConfig:
    """How the train step is laid out beyond the mesh: pipeline parallelism (sharding/)."""

    pipeline: PipelineConfig = PipelineConfig()


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """A training run. YAML files in configs/ override these defaults."""

    run_dir: str = "runs/demo"     # metrics.jsonl, checkpoints/ (unless checkpoint.dir is set)
    hf_path: str | None = None     # start from this local Hugging Face folder; its config.json
    #                                gives the architecture and tokenizer.json the tokenizer
    model: ModelConfig = ModelConfig()
    mesh: MeshConfig = MeshConfig()      # mesh.stage follows sharding.pipeline.stages
    sharding: ShardingConfig = ShardingConfig()
    optim: OptimConfig = OptimConfig()
    train: TrainConfig = TrainConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    task: (ArithmeticConfig | MathConfig | CountdownConfig | ToolCalcConfig
           | CustomConfig) = ArithmeticConfig()
    rl: RLConfig = RLConfig()
    log: LogConfig = LogConfig()

    def __post_init__(self):
        if self.train.seq_len > self.model.max_seq_len:
            raise ConfigError(f"train.seq_len={self.train.seq_len} exceeds "
                              f"model.max_seq_len={self.model.max_seq_len}")
        pipe = self.sharding.pipeline
        if self.mesh.stage not in (1, pipe.stages):
            raise ConfigError(f"mesh.stage={self.mesh.stage} differs from sharding.pipeline."
                              f"stages={pipe.stages}; set the pipeline's stages (the mesh's "
                              f"stage axis follows it)")
        if pipe.enabled:
            object.__setattr__(self, "mesh", dataclasses.replace(self.mesh, stage=pipe.stages))
            if self.train.microbatches > 1:
                raise ConfigError(
                    f"train.microbatches={self.train.microbatches} (gradient accumulation) and "
                    f"sharding.pipeline.stages={pipe.stages} both split the batch; with a "
                    f"pipeline set sharding.pipeline.microbatches instead")
            if self.hf_path is None:  # otherwise the layers come from config.json: checked then
                self.check_pipeline(self.model)
        if self.mesh.context > 1:
            self.check_context(self.model)
        if self.model.lora.adapters != 1:
            raise ConfigError(f"model.lora.adapters={self.model.lora.adapters}: a run trains "
                              f"one adapter set (several side by side are an engine's, for "
                              f"`jaxrl tinker --max-adapters`)")
        if self.model.quantize != "none" and not self.model.lora.enabled and (
                self.train.steps or self.rl.steps):
            raise ConfigError(f"model.quantize={self.model.quantize} holds the projections "
                              f"frozen: train LoRA adapters on them (model.lora.rank > 0)")
        chunks = self.model.mlp_chunks
        for key, length, used in (("train.seq_len", self.train.seq_len, self.train.steps),
                                  ("rl.pack_len", self.rl.pack_len, self.rl.steps)):
            if used and length % (chunks * self.mesh.context):
                raise ConfigError(f"model.mlp_chunks={chunks} x mesh.context="
                                  f"{self.mesh.context} does not divide {key}={length}")
        if self.model.attention == "splash":
            self.check_splash()
        if self.model.attention == "cudnn":
            self.check_cudnn()

    def check_context(self, model: ModelConfig) -> None:
        """ConfigError for what context parallelism (mesh.context > 1) cannot run yet, and
        for sequence lengths that do not split into 2 x mesh.context equal chunks."""
        from jaxrl.models.context_attention import check_length

        c, problems = self.mesh.context, []
        lengths = {}
        if self.train.steps:
            lengths["train.seq_len"] = self.train.seq_len
        if self.rl.steps:
            lengths["rl.pack_len"] = self.rl.pack_len
        for key, length in lengths.items():
            try:
                check_length(length, c, key)
            except ValueError as e:
                problems.append(str(e))
        if self.sharding.pipeline.enabled:
            problems.append(f"a pipeline (sharding.pipeline.stages="
                            f"{self.sharding.pipeline.stages}) is not supported with it yet")
        if model.attention == "cudnn":
            problems.append("model.attention=cudnn is not supported with it yet (use xla)")
        if model.attention == "splash" and model.context_attention == "ring":
            problems.append("model.context_attention=ring runs on the xla path (splash "
                            "gathers: model.context_attention=all-gather)")
        if model.sliding_window is not None:
            problems.append(f"sliding-window attention (model.sliding_window="
                            f"{model.sliding_window}, {model.family}) is not supported with "
                            f"it yet")
        if problems:
            raise ConfigError(f"mesh.context={c}: " + "; ".join(problems))

    def check_cudnn(self) -> None:
        """ConfigError for what cuDNN's flash attention cannot take: float32, head_dim past 256
        or not a multiple of 8, more packed segments than model.max_segments."""
        m, problems = self.model, []
        if m.dtype == "float32":
            problems.append("model.dtype=float32 (it computes in bfloat16 or float16: set "
                            "model.dtype=bfloat16, the master weights stay float32)")
        if m.head_dim > 256 or m.head_dim % 8:
            problems.append(f"model.head_dim={m.head_dim} (a multiple of 8, at most 256)")
        if self.rl.steps and self.rl.max_segments > m.max_segments:
            problems.append(f"rl.max_segments={self.rl.max_segments} above model.max_segments="
                            f"{m.max_segments} (raise model.max_segments or lower "
                            f"rl.max_segments)")
        if problems:
            raise ConfigError("model.attention=cudnn: " + "; ".join(problems))

    def check_splash(self) -> None:
        """ConfigError naming every sequence length the splash kernel cannot take (those the run
        trains on), with the nearest valid values."""
        from jaxrl.models.splash import splash_problems

        lengths = {}
        if self.train.steps:
            lengths["train.seq_len"] = self.train.seq_len
        if self.rl.steps:
            lengths["rl.pack_len"] = self.rl.pack_len
        problems = splash_problems(lengths, self.mesh.context)
        pipe = self.sharding.pipeline
        if pipe.enabled and pipe.table is None and pipe.schedule != "helix":
            problems.append(f"model.attention=splash inside a {pipe.schedule} pipeline is not "
                            f"supported: use a per-stage schedule (1f1b, zb-h1, a V schedule, "
                            f"helix), whose stage programs run the kernel, or "
                            f"model.attention=xla")
        if problems:
            raise ConfigError("model.attention=splash: " + "; ".join(problems))

    def check_pipeline(self, model: ModelConfig) -> None:
        """ConfigError unless the pipeline divides the layers and the warm-up and RL batches,
        and the model's layers are all alike (a stage runs its layers without their indices)."""
        pipe = self.sharding.pipeline
        if not pipe.enabled:
            return
        if len(set(model.sliding_layers())) > 1:
            raise ConfigError(f"sharding.pipeline.stages={pipe.stages}: a pipeline cannot run "
                              f"a model that mixes sliding-window and full-attention layers "
                              f"({model.family}); train it without a pipeline")
        if model.router_aux_loss_coef:
            raise ConfigError(f"sharding.pipeline.stages={pipe.stages}: the load-balancing "
                              f"loss (model.router_aux_loss_coef={model.router_aux_loss_coef}) "
                              f"is not computed inside pipeline stages; set it to 0 or train "
                              f"without a pipeline")
        if model.lora.enabled and (pipe.schedule == "helix" or model.lora.dropout):
            what = (f"model.lora.dropout={model.lora.dropout}" if model.lora.dropout else
                    "sharding.pipeline.schedule=helix")
            raise ConfigError(f"model.lora.rank={model.lora.rank} with {what} inside a "
                              f"pipeline (sharding.pipeline.stages={pipe.stages}) is not "
                              f"supported: use a table schedule (1f1b, zb-h1, v-half...) or "
                              f"gpipe/circular, without LoRA dropout")
        if pipe.schedule == "helix" and self.rl.kl_coef:
            raise ConfigError(f"sharding.pipeline.schedule=helix does not run the KL term's "
                              f"reference model (rl.kl_coef={self.rl.kl_coef}); use a table "
                              f"schedule (1f1b, zb-h1, v-half...) or set rl.kl_coef=0")
        num_layers = model.num_layers
        try:
            if pipe.schedule == "helix":
                pipe.helix(num_layers)
            pipe.check(num_layers, self.train.batch_size, "train.batch_size")
            pipe.check(num_layers, self.rl.max_microbatches * self.rl.microbatch_rows,
                       f"the RL batch (rl.max_microbatches={self.rl.max_microbatches} x "
                       f"rl.microbatch_rows={self.rl.microbatch_rows})")
        except ValueError as e:
            raise ConfigError(str(e)) from e

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir or Path(self.run_dir) / "checkpoints")


def load_run_config(path: str | Path | None = None,
                    overrides: Sequence[str] = ()) -> RunConfig:
    """Defaults <- YAML file at `path` <- `section.key=value` overrides."""
    data = load_yaml(path) if path is not None else {}
    data = merge(data, parse_overrides(overrides))
    if data.get("hf_path"):
        clash = sorted(set(data.get("model") or {}) - set(RUNTIME_MODEL_KEYS))
        if clash:
            raise ConfigError(f"model.{clash[0]} conflicts with hf_path (the architecture comes "
                              f"from {data['hf_path']}/config.json); only model."
                              f"{', model.'.join(RUNTIME_MODEL_KEYS)} may be set with it")
    return from_dict(RunConfig, data)
