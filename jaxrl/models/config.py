"""Architecture of a decoder-only transformer: Llama 3, Qwen2/Qwen2.5, Qwen3, Gemma 2 and Gemma 3
(text) are all this shape, and Qwen3-MoE is Qwen3's with a mixture-of-experts MLP (models/moe.py).

The family decides the shape of a block: Llama and Qwen are pre-norm with SwiGLU and RMSNorm
`w * x`; Gemma scales the embedding by sqrt(embed_dim), normalises with `(1 + w) * x` computed in
float32, puts a norm before and after both attention and the MLP (sandwich norms) and uses GeGLU
(tanh GELU). The numbers (soft-caps, sliding windows, RoPE bases) are fields of their own.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax.numpy as jnp

from jaxrl.models.lora import LoraConfig

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

    # The block's shape (module docstring); to_hf writes it as Hugging Face's model_type.
    family: Literal["llama", "qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3"] = "llama"
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
    # Attention scores are q.k / sqrt(query_pre_attn_scalar) (Gemma's; None: head_dim).
    query_pre_attn_scalar: float | None = None
    attn_softcap: float | None = None    # Gemma 2: scores = cap * tanh(scores / cap)
    final_softcap: float | None = None   # Gemma 2: logits = cap * tanh(logits / cap)
    # Sliding-window attention (Gemma 2 and 3): a sliding layer's query sees the last
    # `sliding_window` positions, its own included. `layer_types` names each layer "full" or
    # "sliding" (None: with sliding_window set, the family's pattern, every 2nd layer full for
    # Gemma 2 and every 6th for Gemma 3, every layer sliding for others; without, all full).
    sliding_window: int | None = None
    layer_types: tuple[Literal["full", "sliding"], ...] | None = None
    rope_local_theta: float | None = None   # Gemma 3: the sliding layers' RoPE base (no scaling)
    # Mixture of experts (Qwen3-MoE): every layer's MLP is `num_experts` SwiGLU experts of
    # hidden size `moe_mlp_dim`, each token routed to its top `experts_per_token` (0: dense).
    num_experts: int = 0
    experts_per_token: int = 2
    moe_mlp_dim: int = 0
    norm_topk_prob: bool = False   # renormalise the top-k router weights to sum to 1
    # The load-balancing loss (Switch Transformer's, as Hugging Face's Qwen3-MoE adds it with
    # output_router_logits) added to the training loss with this weight; 0: off.
    router_aux_loss_coef: float = 0.0
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
    # step (docs/benchmarks.md, "Against TRL and Tunix"), scanned on accelerators (and
    # ahead-of-time TPU compiles). Everything else (evaluation, serving) scans unless this
    # says unroll.
    scan_layers: Literal["auto", "scan", "unroll"] = "auto"
    # The gated MLP's backward: autodiff's, or ordered (jaxrl/models/layers.py gated_mlp: each
    # weight gradient contracted with the wider operand first, which spares XLA:CPU a transposed
    # copy of every activation gradient, ~8% of a CPU RL step); auto: ordered when the trainer's
    # devices are CPUs, autodiff elsewhere (remat and offload policies act on its residuals).
    mlp_backward: Literal["auto", "autodiff", "ordered"] = "auto"
    # Attention within packed rows on the xla path: dense (every query scored against every key
    # of its row, then masked), or blocks (jaxrl/models/block_attention.py: only the pairs of
    # 64-token blocks that share a segment, flash attention over a work list, in rows of 1,024
    # tokens or more; a row of short samples costs what its samples hold); auto: blocks when
    # the trainer is one CPU device, dense elsewhere (remat and offload policies and the TPU
    # memory figures are the dense path's, and GSPMD does not partition the work list's
    # gathers: a mesh would gather every row onto each device). Models with sliding windows or
    # soft-capped attention stay dense.
    packed_attention: Literal["auto", "dense", "blocks"] = "auto"
    # Attention over rows split by a context mesh axis (mesh.context > 1, xla attention):
    # all-gather (every device's keys and values gathered to each, per layer) or ring (each
    # device's pair passed round the axis, two held at a time, its own backward:
    # jaxrl/models/context_attention.py); splash gathers.
    context_attention: Literal["all-gather", "ring"] = "all-gather"
    # The dense MLP run over this many pieces of the sequence, each recomputed in the backward
    # (HelixPipe's chunked MLP): the [B, T, mlp_dim] intermediates and their gradients are
    # live one piece at a time. 1: the whole sequence at once.
    mlp_chunks: int = 1
    # Low-rank adapters on the layers' projections (jaxrl/models/lora.py); rank 0: off.
    lora: LoraConfig = LoraConfig()
    # int8 or fp8 (float8_e4m3fn): the layers' projection matrices held in 8 bits with a
    # float32 scale per output channel (jaxrl/models/quant.py), frozen: trained only through
    # LoRA adapters.
    quantize: Literal["none", "int8", "fp8"] = "none"

    def __post_init__(self):
        for name in ("vocab_size", "embed_dim", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "mlp_dim", "max_seq_len", "max_segments", "mlp_chunks"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name}={getattr(self, name)} must be >= 1")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model.num_kv_heads={self.num_kv_heads} must divide "
                             f"model.num_heads={self.num_heads}")
        if self.head_dim % 2:
            raise ValueError(f"model.head_dim={self.head_dim} must be even for RoPE")
        if self.num_experts:
            if not 1 <= self.experts_per_token <= self.num_experts:
                raise ValueError(f"model.experts_per_token={self.experts_per_token} must be in "
                                 f"1..model.num_experts={self.num_experts}")
            if self.moe_mlp_dim < 1:
                raise ValueError(f"model.moe_mlp_dim={self.moe_mlp_dim} must be >= 1 with "
                                 f"model.num_experts={self.num_experts}")
        elif self.num_experts < 0:
            raise ValueError(f"model.num_experts={self.num_experts} must be >= 0 (0: dense)")
        if self.router_aux_loss_coef < 0 or (self.router_aux_loss_coef and not self.num_experts):
            raise ValueError(f"model.router_aux_loss_coef={self.router_aux_loss_coef} must be >= "
                             f"0, and 0 for a model without experts")
        for name in ("query_pre_attn_scalar", "attn_softcap", "final_softcap",
                     "sliding_window", "rope_local_theta"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"model.{name}={value} must be > 0 (or null: none)")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"model.layer_types has {len(self.layer_types)} entries; "
                                 f"model.num_layers={self.num_layers} needs one per layer")
            if "sliding" in self.layer_types and self.sliding_window is None:
                raise ValueError("model.layer_types names sliding layers but "
                                 "model.sliding_window is null: set the window's length")
        if self.attention != "xla" and (self.sliding_window or self.attn_softcap):
            what = "sliding-window attention" if self.sliding_window else "attention soft-capping"
            raise ValueError(f"model.attention={self.attention} does not run {what} yet; "
                             f"use model.attention=xla for this model")

    @property
    def gemma(self) -> bool:
        """Gemma's block: scaled embedding, (1 + w) norms, sandwich norms, GeGLU."""
        return self.family in ("gemma2", "gemma3")

    def sliding_layers(self) -> tuple[bool, ...]:
        """Whether each layer attends through the sliding window."""
        if self.sliding_window is None:
            return (False,) * self.num_layers
        if self.layer_types is not None:
            return tuple(t == "sliding" for t in self.layer_types)
        every = {"gemma2": 2, "gemma3": 6}.get(self.family)
        if every is None:                     # Mistral's way: every layer slides
            return (True,) * self.num_layers
        return tuple((i + 1) % every != 0 for i in range(self.num_layers))

    @property
    def attention_scale(self) -> float:
        """What q.k is multiplied by: 1 / sqrt(query_pre_attn_scalar or head_dim)."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def for_platform(self, platform: str, devices: int = 1) -> "ModelConfig":
        """This config with scan_layers, mlp_backward and packed_attention=auto decided for a
        trainer of `devices` devices on `platform` ("cpu", "gpu", "tpu")."""
        cpu = platform == "cpu"
        out = self
        if out.scan_layers == "auto":
            out = dataclasses.replace(out, scan_layers="unroll" if cpu else "scan")
        if out.mlp_backward == "auto":
            out = dataclasses.replace(out, mlp_backward="ordered" if cpu else "autodiff")
        if out.packed_attention == "auto":
            blocks = cpu and devices == 1
            out = dataclasses.replace(out, packed_attention="blocks" if blocks else "dense")
        return out

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
        mlp = (3 * d * self.mlp_dim if not self.num_experts
               else self.num_experts * (d + 3 * d * self.moe_mlp_dim))
        layer = attn + mlp + (4 if self.gemma else 2) * d
        head = 0 if self.tie_embeddings else d * self.vocab_size
        return self.vocab_size * d + self.num_layers * layer + d + head
