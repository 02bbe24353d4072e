"""A decoder layer in its three parts: the attention's inputs (norm, q/k/v projections,
RoPE), the attention itself (no weights), and the attention's output with the MLP. The model
runs them in a row (`transformer.decoder_layer`); HelixPipe (sharding/helix.py) runs the
attention of a microbatch on another pipeline stage than its weights.

Shape letters as in jaxrl/models/transformer.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxrl.models import block_attention, context_attention
from jaxrl.models import layers as ops
from jaxrl.models.config import ModelConfig
from jaxrl.models.lora import project
from jaxrl.models.moe import moe_mlp_routed

# The per-layer parameters the attention's inputs read; the others are the attention output's
# and the MLP's.
INPUT_KEYS = ("attn_norm", "q_proj", "k_proj", "v_proj", "q_bias", "k_bias", "v_bias",
              "q_norm", "k_norm", *(f"{t}_lora_{m}" for t in ("q_proj", "k_proj", "v_proj")
                                    for m in "ab"))


def norm(cfg: ModelConfig, x, scale):
    return ops.rms_norm(x, scale, cfg.norm_eps, plus_one=cfg.gemma)


def attention_inputs(cfg: ModelConfig, w: dict, x_BTD, cos_BTH, sin_BTH):
    h_BTD = norm(cfg, x_BTD, w["attn_norm"])
    lo = cfg.lora
    q_BTNH = project(w, "q_proj", h_BTD, "btd,dnh->btnh", lo)
    k_BTGH = project(w, "k_proj", h_BTD, "btd,dgh->btgh", lo)
    v_BTGH = project(w, "v_proj", h_BTD, "btd,dgh->btgh", lo)
    if cfg.qkv_bias:
        q_BTNH, k_BTGH, v_BTGH = q_BTNH + w["q_bias"], k_BTGH + w["k_bias"], v_BTGH + w["v_bias"]
    if cfg.qk_norm:
        q_BTNH = norm(cfg, q_BTNH, w["q_norm"])
        k_BTGH = norm(cfg, k_BTGH, w["k_norm"])
    return (ops.apply_rope(q_BTNH, cos_BTH, sin_BTH), ops.apply_rope(k_BTGH, cos_BTH, sin_BTH),
            v_BTGH)


def attention_output_and_mlp(cfg: ModelConfig, w: dict, x_BTD, a_BTNH, replay_BTK=None):
    """(the layer's output, the MoE router's own (top-k experts [B, T, K], probabilities
    [B, T, E]), or None for a dense model)."""
    o_BTD = project(w, "o_proj", a_BTNH, "btnh,nhd->btd", cfg.lora)
    if cfg.gemma:
        o_BTD = norm(cfg, o_BTD, w["post_attn_norm"])
    x_BTD = x_BTD + o_BTD
    h_BTD = checkpoint_name(norm(cfg, x_BTD, w["mlp_norm"]), "mlp_in")
    routing = None
    if cfg.num_experts:
        m_BTD, *routing = moe_mlp_routed(cfg, w, h_BTD, replay_BTK)
    else:
        m_BTD = _dense_mlp(cfg, w, h_BTD)
    if cfg.gemma:
        m_BTD = norm(cfg, m_BTD, w["post_mlp_norm"])
    return x_BTD + m_BTD, routing


def _dense_mlp(cfg: ModelConfig, w: dict, h_BTD):
    """The gated MLP, over `cfg.mlp_chunks` pieces of the sequence when asked: a scan whose
    body is rematerialised, so only one piece's [B, T/c, F] intermediates are live in the
    forward and in the backward. Lengths the pieces do not divide (the engine's decode and
    prefill chunks) run whole."""
    mlp = ops.geglu if cfg.gemma else ops.swiglu
    if any(k in w for k in ("gate_proj_lora_a", "up_proj_lora_a", "down_proj_lora_a")):
        run = lambda h: _adapted_mlp(cfg, w, h)  # noqa: E731
    else:
        run = lambda h: mlp(h, w["gate_proj"], w["up_proj"], w["down_proj"],  # noqa: E731
                            ordered=cfg.mlp_backward == "ordered")
    c = cfg.mlp_chunks
    B, T, D = h_BTD.shape
    if c == 1 or T % c:         # the train lengths divide (RunConfig checks); decode's T=1
        return run(h_BTD)
    h_cBtD = jnp.moveaxis(h_BTD.reshape(B, c, T // c, D), 1, 0)
    m_cBtD = jax.lax.map(jax.checkpoint(run), h_cBtD)
    return jnp.moveaxis(m_cBtD, 0, 1).reshape(B, T, D)


def _adapted_mlp(cfg: ModelConfig, w: dict, h_BTD):
    """The gated MLP with LoRA adapters on its projections (`jaxrl/models/lora.py`)."""
    act = ops.gelu_tanh if cfg.gemma else jax.nn.silu
    lo = cfg.lora
    g_BTF = project(w, "gate_proj", h_BTD, "btd,df->btf", lo)
    u_BTF = project(w, "up_proj", h_BTD, "btd,df->btf", lo)
    return project(w, "down_proj", act(g_BTF) * u_BTF, "btf,fd->btd", lo)


def attend(cfg: ModelConfig, q_BTNH, k_BTGH, v_BTGH, mask_BTS, segment_ids_BT):
    if context_attention.context_size() > 1:     # rows split over the mesh's context axis
        return context_attention.attention(q_BTNH, k_BTGH, v_BTGH, segment_ids_BT,
                                           scale=cfg.attention_scale,
                                           softcap=cfg.attn_softcap, impl=cfg.attention,
                                           method=cfg.context_attention)
    if (segment_ids_BT is not None and cfg.attention == "xla"
            and cfg.packed_attention == "blocks" and cfg.attn_softcap is None
            and not any(cfg.sliding_layers()) and block_attention.usable(q_BTNH.shape[1])):
        return block_attention.block_attention(q_BTNH, k_BTGH, v_BTGH, segment_ids_BT,
                                               cfg.attention_scale)
    return ops.attention(q_BTNH, k_BTGH, v_BTGH, mask_BTS, cfg.attention, segment_ids_BT,
                         cfg.max_segments, ops.Scoring(cfg.attention_scale, cfg.attn_softcap,
                                                       causal=True))
