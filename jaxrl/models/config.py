"""Architecture of a decoder-only transformer: Llama 3, Qwen2/Qwen2.5 and Qwen3 are all this shape."""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax.numpy as jnp

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Long-context RoPE frequency scaling, as in Hugging Face's `rope_scaling`."""

    type: Literal["linear", "llama3"] = "llama3"    # linear: positions divided by factor
    factor: float = 8.0           # how much longer the context becomes
    # llama3 only: wavelengths longer than original/low_freq_factor are divided by `factor`,
    # shorter than original/high_freq_factor are kept, and the band between is interpolated.
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """One transformer. Defaults are the built-in demo model (a few hundred thousand parameters)."""

    family: Literal["llama", "qwen2", "qwen3"] = "llama"  # HF model_type written by to_hf
    vocab_size: int = 32          # embedding rows and logits (at least the tokenizer's size)
    embed_dim: int = 128          # HF hidden_size
    num_layers: int = 4           # transformer blocks
    num_heads: int = 4            # query heads
    num_kv_heads: int = 2         # key/value heads (GQA); must divide num_heads
    head_dim: int = 32            # explicit, as Qwen3 (not always embed_dim / num_heads)
    mlp_dim: int = 384            # HF intermediate_size (SwiGLU)
    max_seq_len: int = 2048       # HF max_position_embeddings
    rope_theta: float = 10000.0   # RoPE base
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-6        # RMSNorm epsilon
    qkv_bias: bool = False        # Qwen2/2.5: bias on q, k and v projections
    qk_norm: bool = False         # Qwen3: RMSNorm over head_dim on q and k before RoPE
    tie_embeddings: bool = False  # lm_head shares the embedding matrix
    bos_token_id: int | None = None  # written to config.json by to_hf; read from it by from_hf
    eos_token_id: int | None = None  # likewise; generation stops at it
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"        # compute
    param_dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # master weights
    # xla: reference einsum path, runs everywhere; cudnn: cuDNN's fused flash attention on
    # NVIDIA GPUs (bfloat16/float16; packed rows as per-segment lengths and offsets); splash:
    # the Pallas splash-attention kernel on TPU.
    attention: Literal["xla", "cudnn", "splash"] = "xla"
    # cudnn: the most packed segments a row may hold (its ragged layout is sized by it, and its
    # softmax statistics grow with it); rl.max_segments must not exceed it.
    max_segments: int = 16
    # How the train step runs the layer stack: one lax.scan over the stacked layers (compile
    # time does not grow with depth: MaxText's scan_layers), unrolled (XLA schedules and lays
    # out each layer on its own), or auto: unrolled when the trainer's devices are CPUs, where
    # the scan's per-layer slicing and transposed weight-gradient layouts cost ~8% of an RL
    # step (docs/benchmarks.md, "Against TRL and Tunix"), scanned on accelerators (and ahead-of-time TPU
    # compiles). Everything else (evaluation, serving) scans unless this says unroll.
    scan_layers: Literal["auto", "scan", "unroll"] = "auto"

    def __post_init__(self):
        for name in ("vocab_size", "embed_dim", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "mlp_dim", "max_seq_len", "max_segments"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name}={getattr(self, name)} must be >= 1")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model.num_kv_heads={self.num_kv_heads} must divide "
                             f"model.num_heads={self.num_heads}")
        if self.head_dim % 2:
            raise ValueError(f"model.head_dim={self.head_dim} must be even for RoPE")

    def for_platform(self, platform: str) -> "ModelConfig":
        """This config with scan_layers=auto decided for a trainer on `platform` ("cpu",
        "gpu", "tpu")."""
        if self.scan_layers != "auto":
            return self
        return dataclasses.replace(self, scan_layers="unroll" if platform == "cpu" else "scan")

    @property
    def compute_dtype(self):
        return DTYPES[self.dtype]

    @property
    def weight_dtype(self):
        return DTYPES[self.param_dtype]

    def num_params(self) -> int:
        d, h = self.embed_dim, self.head_dim
        attn = d * h * (2 * self.num_heads + 2 * self.num_kv_heads)
        if self.qkv_bias:
            attn += h * (self.num_heads + 2 * self.num_kv_heads)
        if self.qk_norm:
            attn += 2 * h
        layer = attn + 3 * d * self.mlp_dim + 2 * d
        head = 0 if self.tie_embeddings else d * self.vocab_size
        return self.vocab_size * d + self.num_layers * layer + d + head
