"""LoRA adapters in and out of PEFT's format, and merged into their base.

A PEFT LoRA folder holds `adapter_config.json` (peft_type LORA, r, lora_alpha,
target_modules, use_rslora, base_model_name_or_path...) and `adapter_model.safetensors`, whose
keys are the base model's module paths under `base_model.model.`, e.g.
`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` (A as [r, in]) and
`...lora_B.weight` (B as [out, r]), the layout of PyTorch's `nn.Linear` weights. jaxrl's
adapters (jaxrl/models/lora.py) are A [L, in..., r] and B [L, r, out...] in the base matrices'
own axis order, which Hugging Face's flattens the same way (jaxrl/models/hf.py), so each layer's
A and B are a reshape and a transpose away.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file, save_file

from jaxrl.models import lora, quant
from jaxrl.models.config import ModelConfig
from jaxrl.models.lora import LoraConfig

_MODULE = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def _key(i: int, target: str, which: str) -> str:
    return f"base_model.model.model.layers.{i}.{_MODULE[target]}.{target}.lora_{which}.weight"


def merged(params: dict, cfg: ModelConfig) -> dict:
    """The base parameters with every adapter folded in (W + s * A @ B, in float32, cast back
    to W's dtype), the adapters dropped: the model a LoRA run has learned, adapter-free. An
    int8 base (model.quantize) is dequantized first."""
    params = quant.dequantized(params, cfg)
    layers = dict(lora.frozen(params)["layers"])
    for target in cfg.lora.modules(moe=bool(cfg.num_experts)):
        a, b = params["layers"][f"{target}_lora_a"], params["layers"][f"{target}_lora_b"]
        w = layers[target]
        delta = jnp.einsum("lir,lro->lio", a.reshape(a.shape[0], -1, a.shape[-1]),
                           b.reshape(b.shape[0], b.shape[1], -1).astype(jnp.float32))
        layers[target] = (w.astype(jnp.float32) + cfg.lora.scale * delta.reshape(w.shape)
                          ).astype(w.dtype)
    return {**params, "layers": layers}


def with_adapter(model, path: str | Path):
    """`model` (a jaxrl Transformer without adapters) with the PEFT LoRA folder at `path`
    merged into its weights: what `jaxrl serve --lora` serves (no adapter products per token).
    ValueError for a folder that does not fit the model."""
    from jaxrl.models.transformer import merge_params, split_params

    cfg = dataclasses.replace(model.cfg, lora=read_config(path))
    graphdef, params = split_params(model)
    adapters = read_adapter(path, cfg)
    fold = jax.jit(lambda p, a: merged(lora.with_trainable(p, a), cfg))
    return merge_params(graphdef, fold(params, adapters))


def write_adapter(params: dict, cfg: ModelConfig, path: str | Path, base: str) -> Path:
    """Writes the adapters of `params` as a PEFT LoRA folder for base model `base` (its name or
    folder, as PEFT's `base_model_name_or_path`)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    targets = cfg.lora.modules(moe=bool(cfg.num_experts))
    tensors = {}
    for target in targets:
        a = np.asarray(jax.device_get(params["layers"][f"{target}_lora_a"]), np.float32)
        b = np.asarray(jax.device_get(params["layers"][f"{target}_lora_b"]), np.float32)
        for i in range(cfg.num_layers):
            tensors[_key(i, target, "A")] = np.ascontiguousarray(
                a[i].reshape(-1, cfg.lora.rank).T)
            tensors[_key(i, target, "B")] = np.ascontiguousarray(
                b[i].reshape(cfg.lora.rank, -1).T)
    save_file(tensors, path / WEIGHTS, metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
              "r": cfg.lora.rank, "lora_alpha": cfg.lora.alpha,
              "lora_dropout": cfg.lora.dropout,
              "target_modules": list(targets), "use_rslora": cfg.lora.use_rslora,
              "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
              "init_lora_weights": True, "modules_to_save": None, "use_dora": False}
    (path / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return path


def read_config(path: str | Path) -> LoraConfig:
    """`model.lora` of a PEFT LoRA folder; ValueError for what jaxrl's LoRA does not run."""
    path = Path(path)
    if not (path / CONFIG).is_file():
        raise ValueError(f"{str(path)!r} is not a PEFT adapter folder: no {CONFIG}")
    c = json.loads((path / CONFIG).read_text())
    problems = []
    if c.get("peft_type") != "LORA":
        problems.append(f"peft_type={c.get('peft_type')!r} (LORA only)")
    for key, ok in (("use_dora", False), ("fan_in_fan_out", False), ("modules_to_save", None)):
        if c.get(key, ok) not in (ok, [] if ok is None else ok):
            problems.append(f"{key}={c[key]!r}")
    if c.get("bias", "none") != "none":
        problems.append(f"bias={c['bias']!r} (none only)")
    targets = c.get("target_modules")
    if isinstance(targets, str):
        targets = ["all-linear"] if targets == "all-linear" else [targets]
    if problems:
        raise ValueError(f"the adapter in {str(path)!r} uses {', '.join(problems)}, which "
                         f"jaxrl's LoRA does not run")
    return LoraConfig(rank=int(c["r"]), alpha=float(c["lora_alpha"]),
                      targets=tuple(targets or ("all-linear",)),
                      use_rslora=bool(c.get("use_rslora", False)))


def read_adapter(path: str | Path, cfg: ModelConfig) -> dict:
    """The adapters of a PEFT LoRA folder as jaxrl parameters ({"layers": {...}}, float32) for
    model `cfg` (whose `lora` must be the folder's, `read_config`). ValueError naming a
    missing or misshapen tensor."""
    path = Path(path)
    tensors = load_file(path / WEIGHTS)
    shapes = lora.adapter_shapes(cfg)
    out = {}
    for name, (shape, _) in shapes.items():
        target, which = name.rsplit("_lora_", 1)
        per_layer = []
        for i in range(cfg.num_layers):
            key = _key(i, target, which.upper())
            if key not in tensors:
                raise ValueError(f"{str(path)!r} has no {key}")
            t = tensors[key].astype(np.float32)
            want = (cfg.lora.rank, int(np.prod(shape[1:-1]))) if which == "a" else \
                (int(np.prod(shape[2:])), cfg.lora.rank)
            if t.shape != want:
                raise ValueError(f"{key} is {t.shape}, expected {want} for this model")
            per_layer.append(t.T.reshape(shape[1:]))
        out[name] = jnp.asarray(np.stack(per_layer))
    return {"layers": out}
