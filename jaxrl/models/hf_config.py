"""Hugging Face `config.json` in and out: which families it may name, and how each one's keys map to
`ModelConfig` (load_hf_config) and back (hf_config). The tensors are jaxrl/models/hf.py's."""

from __future__ import annotations

import json
from pathlib import Path

from jaxrl.errors import UserError
from jaxrl.models.config import ModelConfig, RopeScaling

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "gemma2": "Gemma2ForCausalLM",
                 "gemma3": "Gemma3ForCausalLM"}
# Our family -> Hugging Face's model_type, where they differ (Gemma 3's text-only model).
MODEL_TYPES = {"gemma3": "gemma3_text"}
FAMILIES = {MODEL_TYPES.get(f, f): f for f in ARCHITECTURES}
_LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}

class HFCheckpointError(UserError):
    """A Hugging Face folder this project cannot read; the message names what is wrong."""


def load_hf_config(path: str | Path, **overrides) -> ModelConfig:
    """ModelConfig from `path/config.json`; `overrides` set runtime fields (dtype, attention)."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise HFCheckpointError(f"{str(path)!r} is not a Hugging Face checkpoint folder: "
                                f"no config.json in it")
    raw = json.loads(file.read_text())
    family = _family(raw, file)
    gemma = family.startswith("gemma")
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


def _family(raw: dict, file: Path) -> str:
    """The model family of a config.json, refused by name where it or one of its settings is
    not supported."""
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
    return family


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
                norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
                # Hugging Face adds the loss only with output_router_logits.
                router_aux_loss_coef=float(raw.get("router_aux_loss_coef", 0.0))
                if raw.get("output_router_logits") else 0.0)


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


def hf_config(cfg: ModelConfig, dtype: str) -> dict:
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
                   decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False,
                   output_router_logits=cfg.router_aux_loss_coef > 0,
                   router_aux_loss_coef=cfg.router_aux_loss_coef or 0.001)
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
