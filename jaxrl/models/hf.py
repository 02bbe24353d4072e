"""Hugging Face checkpoints in and out: config.json plus safetensors (one file or a sharded index).

`from_hf` reads one tensor at a time from memory-mapped safetensors, stacks the per-layer tensors
on the `layers` axis and places each parameter with the sharding it is given, so a large model is
never materialised whole on one device. `to_hf` writes a folder that `transformers` loads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import jax
import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxrl.models.config import DTYPES, ModelConfig
from jaxrl.models.hf_config import HFCheckpointError, hf_config, load_hf_config
from jaxrl.models.transformer import Transformer, abstract_model, merge_params, split_params

_NUMPY_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def _tensor_map(cfg: ModelConfig):
    """Our parameter path -> (HF name template, HF shape, HF->ours, ours->HF). `{i}` is the layer."""
    D, N, G, H, F, V = (cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                        cfg.mlp_dim, cfg.vocab_size)
    same = (lambda a: a, lambda a: a)

    def proj(heads):  # HF [heads*H, D] <-> ours [D, heads, H]
        return (lambda a: a.T.reshape(D, heads, H), lambda a: a.reshape(D, heads * H).T)

    def bias(heads):
        return (lambda a: a.reshape(heads, H), lambda a: a.reshape(heads * H))

    t = lambda: (lambda a: a.T, lambda a: a.T)  # noqa: E731
    layer, attn, mlp = "model.layers.{i}.", "model.layers.{i}.self_attn.", "model.layers.{i}.mlp."
    # Llama's post_attention_layernorm is the MLP's input norm; Gemma's is the attention's
    # output norm, and pre_feedforward_layernorm its MLP's input norm.
    mlp_norm = "pre_feedforward_layernorm" if cfg.gemma else "post_attention_layernorm"
    m = {
        ("embed",): ("model.embed_tokens.weight", (V, D), *same),
        ("final_norm",): ("model.norm.weight", (D,), *same),
        ("layers", "attn_norm"): ("model.layers.{i}.input_layernorm.weight", (D,), *same),
        ("layers", "q_proj"): (attn + "q_proj.weight", (N * H, D), *proj(N)),
        ("layers", "k_proj"): (attn + "k_proj.weight", (G * H, D), *proj(G)),
        ("layers", "v_proj"): (attn + "v_proj.weight", (G * H, D), *proj(G)),
        ("layers", "o_proj"): (attn + "o_proj.weight", (D, N * H),
                               lambda a: a.T.reshape(N, H, D), lambda a: a.reshape(N * H, D).T),
        ("layers", "mlp_norm"): (layer + mlp_norm + ".weight", (D,), *same),
        ("layers", "gate_proj"): (mlp + "gate_proj.weight", (F, D), *t()),
        ("layers", "up_proj"): (mlp + "up_proj.weight", (F, D), *t()),
        ("layers", "down_proj"): (mlp + "down_proj.weight", (D, F), *t()),
    }
    if cfg.num_experts:
        for key in ("gate_proj", "up_proj", "down_proj"):
            del m[("layers", key)]
        E, FE = cfg.num_experts, cfg.moe_mlp_dim
        expert = mlp + "experts.{j}."
        m[("layers", "router")] = (mlp + "gate.weight", (E, D), *t())
        m[("layers", "experts_gate")] = (expert + "gate_proj.weight", (FE, D), *t())
        m[("layers", "experts_up")] = (expert + "up_proj.weight", (FE, D), *t())
        m[("layers", "experts_down")] = (expert + "down_proj.weight", (D, FE), *t())
    if not cfg.tie_embeddings:
        m[("lm_head",)] = ("lm_head.weight", (V, D), *t())
    if cfg.qkv_bias:
        m[("layers", "q_bias")] = (attn + "q_proj.bias", (N * H,), *bias(N))
        m[("layers", "k_bias")] = (attn + "k_proj.bias", (G * H,), *bias(G))
        m[("layers", "v_bias")] = (attn + "v_proj.bias", (G * H,), *bias(G))
    if cfg.qk_norm:
        m[("layers", "q_norm")] = (attn + "q_norm.weight", (H,), *same)
        m[("layers", "k_norm")] = (attn + "k_norm.weight", (H,), *same)
    if cfg.gemma:
        m[("layers", "post_attn_norm")] = (layer + "post_attention_layernorm.weight", (D,), *same)
        m[("layers", "post_mlp_norm")] = (layer + "post_feedforward_layernorm.weight", (D,),
                                          *same)
    return m


class _SafetensorsFolder:
    """Lazy reader over model.safetensors or a sharded model.safetensors.index.json."""

    def __init__(self, path: Path):
        index = path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {name: path / f for name, f in weight_map.items()}
        else:
            files = sorted(path.glob("*.safetensors"))
            if not files:
                raise HFCheckpointError(f"no safetensors weights in {str(path)!r} "
                                        f"(expected model.safetensors or an index)")
            self.files = {}
            for f in files:
                with safe_open(f, framework="numpy") as h:
                    self.files.update({name: f for name in h.keys()})
        self._handles = {}

    def names(self) -> set[str]:
        return set(self.files)

    def get(self, name: str) -> np.ndarray:
        f = self.files[name]
        if f not in self._handles:
            if not f.is_file():
                raise HFCheckpointError(f"shard {str(f)!r} named in the index does not exist")
            self._handles[f] = safe_open(f, framework="numpy")
        return self._handles[f].get_tensor(name)


def from_hf(path: str | Path, dtype="float32", *, param_dtype=None, attention: str = "xla",
            shardings: dict | None = None) -> Transformer:
    """Loads a Llama 3 / Qwen2 / Qwen3 / Qwen3-MoE / Gemma 2 / Gemma 3 (text) Hugging Face
    folder into a `Transformer`.

    dtype: compute dtype; param_dtype: stored weights (default: dtype); shardings: optional pure
    dict of `jax.sharding.Sharding` shaped like the parameters (see `sharding.mesh`).
    """
    path = Path(path)
    dtype, param_dtype = _dtype_name(dtype), _dtype_name(param_dtype or dtype)
    cfg = load_hf_config(path, dtype=dtype, param_dtype=param_dtype, attention=attention)
    folder = _SafetensorsFolder(path)
    available = folder.names()
    mapping = _tensor_map(cfg)
    expected = {name for (tmpl, *_) in mapping.values() for name in _names(tmpl, cfg)}
    if cfg.tie_embeddings:
        available.discard("lm_head.weight")
    unexpected = sorted(n for n in available - expected if not n.endswith("rotary_emb.inv_freq"))
    if unexpected:
        raise HFCheckpointError(f"{str(path)!r} has tensors this {cfg.family} config does not "
                                f"use: {', '.join(unexpected[:5])}")
    graphdef, abstract = split_params(abstract_model(cfg))
    np_dtype = _NUMPY_DTYPES[param_dtype]

    def read(name: str, shape, to_ours: Callable) -> np.ndarray:
        if name not in available:
            raise HFCheckpointError(f"missing tensor {name!r} in {str(path)!r}")
        a = folder.get(name)
        if tuple(a.shape) != shape:
            raise HFCheckpointError(f"tensor {name!r} in {str(path)!r} has shape "
                                    f"{tuple(a.shape)}, expected {shape} from config.json")
        return to_ours(a.astype(np.float32)).astype(np_dtype)

    params = {}
    for key, (tmpl, shape, to_ours, _) in mapping.items():
        if "{j}" in tmpl:       # one tensor per layer and expert: stacked [L, E, ...]
            value = np.stack([np.stack([read(tmpl.format(i=i, j=j), shape, to_ours)
                                        for j in range(cfg.num_experts)])
                              for i in range(cfg.num_layers)])
        elif key[0] == "layers":
            value = np.stack([read(tmpl.format(i=i), shape, to_ours)
                              for i in range(cfg.num_layers)])
        else:
            value = read(tmpl, shape, to_ours)
        target = _get(abstract, key)
        assert value.shape == target.shape, (key, value.shape, target.shape)
        sharding = None
        if shardings is not None:
            sharding = _get(shardings, key)
        _set(params, key, jax.device_put(value, sharding))
    return merge_params(graphdef, params)


def to_hf(model: Transformer, path: str | Path, *, dtype=None,
          max_shard_bytes: int = 5 * 2**30) -> Path:
    """Writes `model` as a Hugging Face folder (config.json + safetensors) that transformers loads.

    Weights are saved in `dtype` (default: the model's param dtype), sharded with an index once
    they pass `max_shard_bytes`.
    """
    cfg = model.cfg
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    dtype = _dtype_name(dtype or cfg.param_dtype)
    _, params = split_params(model)
    tensors = {}
    for key, (tmpl, _, _, to_hf_fn) in _tensor_map(cfg).items():
        value = np.asarray(jax.device_get(_get(params, key))).astype(np.float32)
        if "{j}" in tmpl:
            for i in range(cfg.num_layers):
                for j in range(cfg.num_experts):
                    tensors[tmpl.format(i=i, j=j)] = to_hf_fn(value[i, j])
        elif key[0] == "layers":
            for i in range(cfg.num_layers):
                tensors[tmpl.format(i=i)] = to_hf_fn(value[i])
        else:
            tensors[tmpl] = to_hf_fn(value)
    tensors = {k: np.ascontiguousarray(v.astype(_NUMPY_DTYPES[dtype]))
               for k, v in tensors.items()}
    _write_safetensors(tensors, path, max_shard_bytes)
    (path / "config.json").write_text(json.dumps(hf_config(cfg, dtype), indent=2) + "\n")
    return path


def _names(tmpl: str, cfg: ModelConfig) -> list[str]:
    """Every tensor name a template stands for (per layer, per expert)."""
    if "{j}" in tmpl:
        return [tmpl.format(i=i, j=j) for i in range(cfg.num_layers)
                for j in range(cfg.num_experts)]
    return [tmpl.format(i=i) for i in range(cfg.num_layers)]


def _write_safetensors(tensors: dict, path: Path, max_shard_bytes: int) -> None:
    shards, current, size = [], {}, 0
    for name, a in tensors.items():
        if current and size + a.nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = a
        size += a.nbytes
    shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], path / "model.safetensors", metadata={"format": "pt"})
        return
    weight_map = {}
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, path / fname, metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
    total = sum(a.nbytes for a in tensors.values())
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")


def _dtype_name(dtype) -> str:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} is not one of {', '.join(DTYPES)}")
        return dtype
    name = np.dtype(dtype).name
    if name not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    return name


def _get(tree: dict, key: tuple):
    for k in key:
        tree = tree[k]
    return tree


def _set(tree: dict, key: tuple, value) -> None:
    for k in key[:-1]:
        tree = tree.setdefault(k, {})
    tree[key[-1]] = value
