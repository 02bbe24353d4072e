"""Mixture-of-experts MLP (Qwen3-MoE): a softmax router picks each token's top-k experts, and each
expert is a SwiGLU MLP run only on the tokens routed to it.

The experts run as grouped matmuls (`jax.lax.ragged_dot`): the k copies of every token are
sorted by expert, so each expert's tokens are one contiguous group of rows, and one ragged
matmul per projection multiplies every group by its expert's weights. The cost is that of the
tokens' k experts, never of all E experts (a dense [tokens, E, F] einsum would be E/k times
more). The outputs are weighted by the router's probabilities and summed back per token.

Shape letters as in transformer.py; E experts, K experts per token, S tokens (B x T), F the
experts' hidden size.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.models.config import ModelConfig


def route(cfg: ModelConfig, router_DE, x_SD):
    """(expert ids int32 [S, K], their weights float32 [S, K]) of each token: the top-k of the
    softmax over the router's logits (computed in the compute dtype, the softmax in float32,
    as Hugging Face's Qwen3-MoE), renormalised to sum to 1 when model.norm_topk_prob."""
    logits_SE = (x_SD @ router_DE).astype(jnp.float32)
    probs_SE = jax.nn.softmax(logits_SE, axis=-1)
    weights_SK, experts_SK = jax.lax.top_k(probs_SE, cfg.experts_per_token)
    if cfg.norm_topk_prob:
        weights_SK = weights_SK / jnp.sum(weights_SK, axis=-1, keepdims=True)
    return experts_SK.astype(jnp.int32), weights_SK


def moe_mlp(cfg: ModelConfig, w: dict, x_BTD):
    """The MoE block of one layer: `w` holds router [D, E], experts_gate and experts_up
    [E, D, F], experts_down [E, F, D]."""
    b, t, d = x_BTD.shape
    x_SD = x_BTD.reshape(b * t, d)
    experts_SK, weights_SK = route(cfg, w["router"], x_SD)
    k, e = cfg.experts_per_token, cfg.num_experts
    # Every (token, choice) pair as one row, the rows sorted by expert: group g is expert g's.
    order_R = jnp.argsort(experts_SK.reshape(-1), stable=True)
    token_R = order_R // k
    sizes_E = jnp.bincount(experts_SK.reshape(-1), length=e).astype(jnp.int32)
    x_RD = x_SD[token_R]
    gate_RF = jax.lax.ragged_dot(x_RD, w["experts_gate"], sizes_E)
    up_RF = jax.lax.ragged_dot(x_RD, w["experts_up"], sizes_E)
    out_RD = jax.lax.ragged_dot(jax.nn.silu(gate_RF) * up_RF, w["experts_down"], sizes_E)
    out_RD = out_RD * weights_SK.reshape(-1)[order_R][:, None].astype(out_RD.dtype)
    return jnp.zeros_like(x_SD).at[token_R].add(out_RD).reshape(b, t, d)
