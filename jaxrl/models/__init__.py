"""Transformer models (Llama 3, Qwen2/2.5, Qwen3, Qwen3-MoE, Gemma 2, Gemma 3 text), Hugging Face
weights in and out, tokenizers."""

from jaxrl.models.config import ModelConfig, RopeScaling
from jaxrl.models.hf import from_hf, load_hf_config, to_hf
from jaxrl.models.transformer import (Transformer, abstract_model, merge_params, param_axes,
                                      split_params)

__all__ = ["ModelConfig", "RopeScaling", "Transformer", "abstract_model", "from_hf",
           "load_hf_config", "merge_params", "param_axes", "split_params", "to_hf"]
