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
from jaxrl.models.moe_parallel import expert_mesh, parallel_experts


def route(cfg: ModelConfig, router_DE, x_SD, replay_SK=None):
    """(expert ids int32 [S, K], their weights float32 [S, K], the router's own top-k ids
    [S, K], its probabilities [S, E]) of each token: the top-k of the softmax over the
    router's logits (computed in the compute dtype, the softmax in float32, as Hugging Face's
    Qwen3-MoE), renormalised to sum to 1 when model.norm_topk_prob. `replay_SK`: experts
    chosen elsewhere (the engine that sampled the token; -1 where unknown) used instead of the
    router's own, weighted by the router's probabilities of them, so the router still learns
    (routing replay, as verl and prime-rl do)."""
    logits_SE = (x_SD @ router_DE).astype(jnp.float32)
    probs_SE = jax.nn.softmax(logits_SE, axis=-1)
    weights_SK, own_SK = jax.lax.top_k(probs_SE, cfg.experts_per_token)
    own_SK = own_SK.astype(jnp.int32)
    experts_SK = own_SK
    if replay_SK is not None:
        known_S1 = jnp.all(replay_SK >= 0, axis=-1, keepdims=True)
        experts_SK = jnp.where(known_S1, replay_SK, own_SK)
        weights_SK = jnp.take_along_axis(probs_SE, experts_SK, axis=-1)
    if cfg.norm_topk_prob:
        weights_SK = weights_SK / jnp.sum(weights_SK, axis=-1, keepdims=True)
    return experts_SK, weights_SK, own_SK, probs_SE


def moe_mlp(cfg: ModelConfig, w: dict, x_BTD):
    """The MoE block of one layer: `w` holds router [D, E], experts_gate and experts_up
    [E, D, F], experts_down [E, F, D]."""
    return moe_mlp_routed(cfg, w, x_BTD)[0]


def moe_mlp_routed(cfg: ModelConfig, w: dict, x_BTD, replay_BTK=None):
    """`moe_mlp` with its routing: (output [B, T, D], the router's own top-k experts
    [B, T, K], its probabilities [B, T, E]). `replay_BTK`: the experts to use instead (see
    `route`)."""
    b, t, d = x_BTD.shape
    x_SD = x_BTD.reshape(b * t, d)
    k, e = cfg.experts_per_token, cfg.num_experts
    replay_SK = None if replay_BTK is None else replay_BTK.reshape(b * t, k)
    mesh = expert_mesh()
    if mesh is not None:       # expert parallelism (moe_parallel.py)
        out_SD, own_SK, probs_SE = parallel_experts(
            lambda router, x, replay: route(cfg, router, x, replay), w, x_SD, replay_SK, mesh)
        return out_SD.reshape(b, t, d), own_SK.reshape(b, t, k), probs_SE.reshape(b, t, e)
    experts_SK, weights_SK, own_SK, probs_SE = route(cfg, w["router"], x_SD, replay_SK)
    # Every (token, choice) pair as one row, the rows sorted by expert: group g is expert g's.
    order_R = jnp.argsort(experts_SK.reshape(-1), stable=True)
    token_R = order_R // k
    sizes_E = jnp.bincount(experts_SK.reshape(-1), length=e).astype(jnp.int32)
    x_RD = x_SD[token_R]
    gate_RF = jax.lax.ragged_dot(x_RD, w["experts_gate"], sizes_E)
    up_RF = jax.lax.ragged_dot(x_RD, w["experts_up"], sizes_E)
    out_RD = jax.lax.ragged_dot(jax.nn.silu(gate_RF) * up_RF, w["experts_down"], sizes_E)
    out_RD = out_RD * weights_SK.reshape(-1)[order_R][:, None].astype(out_RD.dtype)
    out_BTD = jnp.zeros_like(x_SD).at[token_R].add(out_RD).reshape(b, t, d)
    return out_BTD, own_SK.reshape(b, t, k), probs_SE.reshape(b, t, e)


def router_load(own_BTK, probs_BTE, valid_BT):
    """One layer's share of the load-balancing loss: over the valid tokens, how many of their
    top-k choices went to each expert [E], the sum of their router probabilities [E], and how
    many tokens there were."""
    e = probs_BTE.shape[-1]
    valid_BT1 = valid_BT[..., None].astype(jnp.float32)
    counts_E = jnp.sum(jax.nn.one_hot(own_BTK, e).sum(-2) * valid_BT1, axis=(0, 1))
    return {"expert_choices": counts_E, "expert_probs": jnp.sum(probs_BTE * valid_BT1, (0, 1)),
            "tokens": jnp.sum(valid_BT1)}


def load_balancing_loss(load_L: dict):
    """Switch Transformer's auxiliary loss over every layer's tokens pooled, as Hugging Face's
    `load_balancing_loss_func` computes it from the router logits of all layers: E times the
    sum over experts of (the share of top-k choices that went to the expert) x (its mean
    router probability), both over all (layer, token) rows: K (experts per token) when every
    expert gets the same share, up to E when one gets everything."""
    n = jnp.maximum(jnp.sum(load_L["tokens"]), 1.0)
    choices_E = jnp.sum(load_L["expert_choices"], axis=0) / n
    probs_E = jnp.sum(load_L["expert_probs"], axis=0) / n
    return choices_E.shape[-1] * jnp.sum(choices_E * probs_E)


def routing_mismatch(own_BTK, engine_BTK):
    """Whether each token's set of top-k experts differs from the one recorded by the engine
    ([B, T] bool; False where the engine's is unknown, -1)."""
    known_BT = jnp.all(engine_BTK >= 0, axis=-1)
    same_BT = jnp.all(jnp.sort(own_BTK, axis=-1) == jnp.sort(engine_BTK, axis=-1), axis=-1)
    return known_BT & ~same_BT
