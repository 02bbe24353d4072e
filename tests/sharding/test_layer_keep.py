"""What a stage program keeps of a layer for its backward (sharding/layer_keep.py): the vjp's
residuals under `none` and `minimal`, without the weights; the backward from them equal to the
layer's own vjp."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.models import ModelConfig, Transformer
from jaxrl.models.transformer import split_params
from sharding.layer_keep import InputKeep, ResidualKeep, keep_for, kept_bytes
from sharding.offload import single_layer
from sharding.stage_programs import layer_remat

CFG = ModelConfig(vocab_size=32, embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, mlp_dim=64, max_seq_len=16)
B, T = 2, 16


def _layer(remat):
    fn = single_layer(layer_remat(remat))
    return lambda w, x, aux: fn(CFG, w, x, *aux)


@pytest.fixture(scope="module")
def one_layer():
    _, params = split_params(Transformer(CFG, rngs=nnx.Rngs(0)))
    w = jax.tree.map(lambda a: a[0], params["layers"])
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(B, T, CFG.embed_dim)), jnp.float32)
    aux = (jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)), None)
    g = jnp.asarray(rng.normal(size=x.shape), jnp.float32)
    return w, x, aux, g


def _spec(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


@pytest.mark.parametrize("remat", ["none", "minimal", "full", "offload"])
def test_the_backward_from_what_is_kept_is_the_layers_own(one_layer, remat):
    w, x, aux, g = one_layer
    layer = _layer(remat)
    keep = keep_for(remat, layer, _spec(w), _spec(x), _spec(aux), None, None)
    assert isinstance(keep, InputKeep if remat in ("full", "offload") else ResidualKeep)
    y, kept = jax.jit(keep.forward)(w, x, aux)
    dw, dx = jax.jit(keep.backward)(w, kept, aux, g)
    want_y, pull = jax.vjp(_layer("none"), w, x, aux)
    want_dw, want_dx, _ = pull(g)
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dx, want_dx, rtol=1e-4, atol=1e-6)
    for got, want in zip(jax.tree.leaves(dw), jax.tree.leaves(want_dw)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def test_residuals_keep_activations_not_weights(one_layer):
    """`none` keeps more than the input (the activations the backward reads), `minimal` less
    than `none`, and neither keeps a weight (those are made again from the parameters)."""
    w, x, aux, _ = one_layer
    keeps = {r: keep_for(r, _layer(r), _spec(w), _spec(x), _spec(aux), None, None)
             for r in ("none", "minimal", "full")}
    assert kept_bytes(keeps["full"]) == x.size * 4
    assert kept_bytes(keeps["none"]) > kept_bytes(keeps["minimal"]) > kept_bytes(keeps["full"])
    weights = {a.shape for a in jax.tree.leaves(w)}
    for r in ("none", "minimal"):
        assert not weights & {s.shape for s in keeps[r].shapes()}, r
        assert all(B in s.shape or s.shape[:1] == (B * T,) for s in keeps[r].shapes()), r
