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

from jaxrl.errors import UserError
from jaxrl.models.config import DTYPES, ModelConfig, RopeScaling
from jaxrl.models.transformer import Transformer, abstract_model, merge_params, split_params

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "gemma2": "Gemma2ForCausalLM",
                 "gemma3": "Gemma3ForCausalLM"}
# Our family -> Hugging Face's model_type, where they differ (Gemma 3's text-only model).
MODEL_TYPES = {"gemma3": "gemma3_text"}
FAMILIES = {MODEL_TYPES.get(f, f): f for f in ARCHITECTURES}
_LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}
_NUMPY_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


class HFCheckpointError(UserError):
    """A Hugging Face folder this project cannot read; the message names what is wrong."""


def load_hf_config(path: str | Path, **overrides) -> ModelConfig:
    """ModelConfig from `path/config.json`; `overrides` set runtime fields (dtype, attention)."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise HFCheckpointError(f"{str(path)!r} is not a Hugging Face checkpoint folder: "
                                f"no config.json in it")
    raw = json.loads(file.read_text())
    model_type = raw.get("model_type")
    if model_type == "gemma3" and "text_config" in raw:
        raise HFCheckpointError(f"{file}: model_type='gemma3' is Gemma 3's image-text model; "
                                f"only its text-only form (model_type='gemma3_text', "
                                f"Gemma3ForCausalLM) is supported")
    if model_type not in FAMILIES:
        raise HFCheckpointError(f"unsupported architecture model_type={model_type!r} in "
                                f"{file}; supported: {', '.join(FAMILIES)}")
    family = FAMILIES[model_type]
    gemma = family.startswith("gemma")
    act = "gelu_pytorch_tanh" if gemma else "silu"
    allowed = {"hidden_act": act, "hidden_activation": act, "mlp_bias": False,
               "use_bidirectional_attention": False}
    if not gemma:
        allowed["use_sliding_window"] = False
    if family != "qwen2":       # Qwen2's bias is on q, k and v; elsewhere it would be on o too
        allowed["attention_bias"] = False
    for key, value in allowed.items():
        if raw.get(key) is not None and raw[key] != value:
            raise HFCheckpointError(f"{file}: {key}={raw[key]!r} is not supported for "
                                    f"{model_type} (only {value!r})")
    heads = raw["num_attention_heads"]
    eos = raw.get("eos_token_id")
    rope = raw.get("rope_parameters") or {}
    local_rope = {}
    if "full_attention" in rope:       # per layer type (Gemma 3, transformers 5)
        rope, local_rope = rope["full_attention"], rope.get("sliding_attention") or {}
    elif family == "gemma3":           # the older keys (configs on the Hub)
        local_rope = {"rope_theta": raw.get("rope_local_base_freq", 10000.0)}
    if local_rope.get("rope_type", "default") != "default":
        raise HFCheckpointError(f"{file}: RoPE scaling on the sliding-window layers "
                                f"({local_rope['rope_type']!r}) is not supported")
    fields = dict(
        family=family,
        vocab_size=raw["vocab_size"],
        embed_dim=raw["hidden_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        mlp_dim=raw["intermediate_size"],
        max_seq_len=raw.get("max_position_embeddings", 2048),
        rope_theta=float(raw.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        rope_scaling=_rope_scaling(raw.get("rope_scaling") or rope, file),
        norm_eps=raw.get("rms_norm_eps", 1e-6),
        qkv_bias=family == "qwen2",
        qk_norm=family in ("qwen3", "qwen3_moe", "gemma3"),
        tie_embeddings=bool(raw.get("tie_word_embeddings", gemma)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_id=eos[0] if isinstance(eos, list) else eos,
    )
    if gemma:
        fields.update(_gemma_fields(raw, family, local_rope, file))
    if family == "qwen3_moe":
        fields.update(_moe_fields(raw, file))
    fields.update(overrides)
    try:
        return ModelConfig(**fields)
    except ValueError as e:
        raise HFCheckpointError(f"{file}: {e}") from None


def _moe_fields(raw: dict, file: Path) -> dict:
    """Qwen3-MoE's experts. Every layer must be sparse: the layer stack is one scan of alike
    layers (Qwen3-30B-A3B and -235B-A22B are)."""
    if raw.get("mlp_only_layers") or raw.get("decoder_sparse_step", 1) != 1:
        raise HFCheckpointError(
            f"{file}: mlp_only_layers={raw.get('mlp_only_layers')} / decoder_sparse_step="
            f"{raw.get('decoder_sparse_step')}: only models whose every layer is a "
            f"mixture of experts are supported (mlp_only_layers=[], decoder_sparse_step=1)")
    return dict(num_experts=raw.get("num_experts") or raw["num_local_experts"],
                experts_per_token=raw["num_experts_per_tok"],
                moe_mlp_dim=raw["moe_intermediate_size"],
                norm_topk_prob=bool(raw.get("norm_topk_prob", False)))


def _gemma_fields(raw: dict, family: str, local_rope: dict, file: Path) -> dict:
    """Gemma 2 / 3's numbers: attention scale, soft-caps, sliding windows, the local RoPE."""
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        unknown = sorted(set(layer_types) - set(_LAYER_TYPES))
        if unknown:
            raise HFCheckpointError(f"{file}: layer_types holds {unknown}; supported: "
                                    f"{', '.join(_LAYER_TYPES)}")
        layer_types = tuple(_LAYER_TYPES[t] for t in layer_types)
    elif family == "gemma3" and raw.get("sliding_window_pattern"):
        every = int(raw["sliding_window_pattern"])
        layer_types = tuple("sliding" if (i + 1) % every else "full"
                            for i in range(raw["num_hidden_layers"]))
    fields = dict(
        query_pre_attn_scalar=raw.get("query_pre_attn_scalar"),
        final_softcap=raw.get("final_logit_softcapping"),
        sliding_window=raw.get("sliding_window"),
        layer_types=layer_types if raw.get("sliding_window") else None,
    )
    if family == "gemma2":      # Gemma 3's attention ignores attn_logit_softcapping, as HF's
        fields["attn_softcap"] = raw.get("attn_logit_softcapping")
    else:
        fields["rope_local_theta"] = float(local_rope.get("rope_theta", 10000.0))
    return fields


def _rope_scaling(spec: dict, file: Path) -> RopeScaling | None:
    kind = spec.get("rope_type", spec.get("type", "default"))
    if kind in ("default", None):
        return None
    if kind == "linear":
        return RopeScaling(type="linear", factor=float(spec["factor"]))
    if kind == "llama3":
        return RopeScaling(type="llama3", factor=float(spec["factor"]),
                           low_freq_factor=float(spec["low_freq_factor"]),
                           high_freq_factor=float(spec["high_freq_factor"]),
                           original_max_position_embeddings=int(
                               spec["original_max_position_embeddings"]))
    raise HFCheckpointError(f"{file}: rope scaling type {kind!r} is not supported "
                            f"(supported: default, linear, llama3)")


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
    (path / "config.json").write_text(json.dumps(_hf_config(cfg, dtype), indent=2) + "\n")
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


def _hf_config(cfg: ModelConfig, dtype: str) -> dict:
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        rope.update(rope_type=s.type, factor=s.factor)
        if s.type == "llama3":
            rope.update(low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor,
                        original_max_position_embeddings=s.original_max_position_embeddings)
    out = {
        "architectures": [ARCHITECTURES[cfg.family]],
        "model_type": MODEL_TYPES.get(cfg.family, cfg.family),
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.embed_dim,
        "intermediate_size": cfg.mlp_dim,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "hidden_act": "silu",
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None if cfg.rope_scaling is None else
        {k: v for k, v in rope.items() if k != "rope_theta"},
        "rope_parameters": rope,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    if cfg.family == "qwen2":
        out.update(use_sliding_window=False, attention_bias=True)
    if cfg.gemma:
        out.update(_gemma_config(cfg, rope))
    if cfg.num_experts:
        out.update(num_experts=cfg.num_experts, num_local_experts=cfg.num_experts,
                   num_experts_per_tok=cfg.experts_per_token,
                   moe_intermediate_size=cfg.moe_mlp_dim, norm_topk_prob=cfg.norm_topk_prob,
                   decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False)
    return out


def _gemma_config(cfg: ModelConfig, rope: dict) -> dict:
    names = {v: k for k, v in _LAYER_TYPES.items()}
    out = {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": cfg.query_pre_attn_scalar or cfg.head_dim,
        "final_logit_softcapping": cfg.final_softcap,
        "attn_logit_softcapping": cfg.attn_softcap,
        "sliding_window": cfg.sliding_window,
        "layer_types": [names["sliding" if s else "full"] for s in cfg.sliding_layers()],
        "use_bidirectional_attention": False,
    }
    if cfg.family == "gemma3":
        local = {"rope_type": "default", "rope_theta": cfg.rope_local_theta or cfg.rope_theta}
        out.update(rope_parameters={"full_attention": rope, "sliding_attention": local},
                   rope_scaling=None, rope_local_base_freq=local["rope_theta"])
    return out


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
