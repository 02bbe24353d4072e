"""Zero-bubble's backward split (sharding/split_backward.py): B and W together give the
layer's gradients; W forms only the weight gradients (no forward, no input-gradient chain),
so B + W costs what the fused backward does; the stash is each weight product's operands."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.models import ModelConfig, Transformer
from jaxrl.models.transformer import run_layers, split_params
from sharding.offload import single_layer
from sharding.split_backward import make_split, split_backward

pytestmark = pytest.mark.multi_device

CFG = ModelConfig(vocab_size=32, embed_dim=32, num_layers=1, num_heads=4, num_kv_heads=2,
                  head_dim=8, mlp_dim=64, max_seq_len=16)
B, T = 2, 8
VARIANTS = {"plain": {}, "qwen": {"qkv_bias": True, "qk_norm": True},
            "bf16": {"dtype": "bfloat16"}}


def layer_inputs(cfg, packed=False, seed=0):
    _, params = split_params(Transformer(cfg, rngs=nnx.Rngs(seed)))
    w = jax.tree.map(lambda a: a[0], params["layers"])
    k1, k2 = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(k1, (B, T, cfg.embed_dim)).astype(cfg.compute_dtype)
    g = jax.random.normal(k2, x.shape).astype(x.dtype)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    seg = jnp.asarray(np.repeat([[1, 1, 1, 2, 2, 2, 2, 0]], B, 0), jnp.int32) if packed else None
    return w, x, (pos, seg), g


def layer_of(cfg, remat="none"):
    one = single_layer(remat)
    return lambda w, x, aux: one(cfg, w, x, *aux)


def split_and_fused(cfg, remat="none", packed=False, how="stash"):
    w, x, aux, g = layer_inputs(cfg, packed)
    layer = layer_of(cfg, remat)
    split = make_split(how, layer, w, x, aux)

    @jax.jit
    def by_split(w, x, aux, g):
        dx, stash = split.input_grad(w, x, aux, g)
        return split.weight_grads(w, x, aux, stash), dx

    @jax.jit
    def fused(w, x, aux, g):
        return jax.vjp(lambda w_, x_: layer(w_, x_, aux), w, x)[1](g)

    return by_split(w, x, aux, g), fused(w, x, aux, g)


@pytest.mark.parametrize("variant", VARIANTS)
def test_b_and_w_give_the_fused_backwards_gradients(variant):
    cfg = dataclasses.replace(CFG, **VARIANTS[variant])
    (dw, dx), (want_dw, want_dx) = split_and_fused(cfg, packed=variant == "qwen")
    rtol = 1e-6 if variant != "bf16" else 0.0
    for name in want_dw:
        np.testing.assert_allclose(np.asarray(dw[name], np.float32),
                                   np.asarray(want_dw[name], np.float32), rtol=rtol,
                                   atol=1e-7, err_msg=name)
    np.testing.assert_allclose(np.asarray(dx, np.float32), np.asarray(want_dx, np.float32),
                               rtol=rtol, atol=1e-7)


@pytest.mark.parametrize("remat,how", [("minimal", "stash"), ("offload", "stash"),
                                       ("none", "recompute")])
def test_a_remat_policy_inside_the_layer_is_seen_through(remat, how):
    (dw, dx), (want_dw, want_dx) = split_and_fused(CFG, remat, how=how)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
                 (dw, dx), (want_dw, want_dx))


def flops(fn, *args) -> float:
    return jax.jit(fn).lower(*args).compile().cost_analysis()["flops"]


def test_w_forms_only_the_weight_products_and_b_plus_w_costs_the_fused_backward():
    w, x, aux, g = layer_inputs(CFG)
    layer = layer_of(CFG)
    split = split_backward(layer, w, x, aux)
    _, stash = split.input_grad(w, x, aux, g)
    b = flops(lambda w, x, g: split.input_grad(w, x, aux, g), w, x, g)
    w_cost = flops(lambda w, x, s: split.weight_grads(w, x, aux, s), w, x, stash)
    fused = flops(lambda w, x, g: jax.vjp(lambda w_, x_: layer(w_, x_, aux), w, x)[1](g),
                  w, x, g)
    forward = flops(lambda w, x: layer(w, x, aux), w, x)
    # Each weight matrix's gradient is one product over the B x T tokens: 2 x tokens x size.
    matrices = sum(a.size for a in w.values() if a.ndim > 1)
    products = 2 * B * T * matrices
    assert products <= w_cost <= 1.02 * products
    assert abs(b + w_cost - fused) <= 0.02 * fused
    assert b >= forward + products * 0.99        # B recomputes the forward, then dx's products
    # Before the split, W recomputed the forward and the chain back to each product.
    old_w = flops(lambda w, x, g: jax.vjp(lambda w_: layer(w_, x, aux), w)[1](g), w, x, g)
    assert old_w > w_cost + forward * 0.99


def test_the_stash_is_each_weight_products_operands():
    w, x, aux, _ = layer_inputs(CFG)
    split = split_backward(layer_of(CFG), w, x, aux)
    d, f = CFG.embed_dim, CFG.mlp_dim
    q, kv = CFG.num_heads * CFG.head_dim, CFG.num_kv_heads * CFG.head_dim
    per_token = (d + q + d + f               # inputs: q/k/v's, o's, gate/up's, down's
                 + q + 2 * kv + d + 2 * f + d  # output cotangents: q, k, v, o, gate, up, down
                 + 2 * d)                     # each norm scale's product (input x cotangent)
    assert split.stash_bytes() == B * T * per_token * 4
    assert len(split.stash) == 13


def test_the_recomputing_split_stashes_one_activation():
    w, x, aux, _ = layer_inputs(CFG)
    assert make_split("recompute", layer_of(CFG), w, x, aux).stash_bytes() == x.nbytes
    with pytest.raises(ValueError, match="split_backward='keep' is not one of stash, recompute"):
        make_split("keep", layer_of(CFG), w, x, aux)


def test_a_loop_over_layers_is_refused():
    _, params = split_params(Transformer(dataclasses.replace(CFG, num_layers=2),
                                         rngs=nnx.Rngs(0)))
    _, x, (pos, _), _ = layer_inputs(CFG)

    def stack(w, x, aux):
        return run_layers(CFG, w, x, *aux)

    with pytest.raises(ValueError, match="function of one layer"):
        split_backward(stack, params["layers"], x, (pos,))
