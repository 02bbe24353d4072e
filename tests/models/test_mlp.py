"""The gated MLP (jaxrl/models/layers.py) has its own backward, ordered for XLA:CPU's layouts:
its values and gradients must be autodiff's of the plain formula, for both activations, under
remat, in bfloat16, and with the hidden size wider and narrower than the model's."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.models import layers


def _plain(act):
    return lambda x, g, u, d: (act(x @ g) * (x @ u)) @ d


def _inputs(d, f, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    shapes = [(3, 5, d), (d, f), (d, f), (f, d)]
    return [jnp.asarray(rng.normal(size=s) / np.sqrt(s[-2] if len(s) == 2 else 1), dtype)
            for s in shapes]


@pytest.mark.parametrize("name,act", [("swiglu", jax.nn.silu),
                                      ("geglu", lambda x: jax.nn.gelu(x, approximate=True))])
@pytest.mark.parametrize("d,f", [(8, 24), (24, 8)])
def test_gated_mlp_matches_autodiff(name, act, d, f):
    mlp, plain = functools.partial(getattr(layers, name), ordered=True), _plain(act)
    args = _inputs(d, f)
    cot = jnp.asarray(np.random.default_rng(1).normal(size=(3, 5, d)), jnp.float32)
    out, vjp = jax.vjp(mlp, *args)
    ref_out, ref_vjp = jax.vjp(plain, *args)
    np.testing.assert_allclose(out, ref_out, rtol=1e-6, atol=1e-6)
    for got, want in zip(vjp(cot), ref_vjp(cot)):
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_gated_mlp_under_remat_and_in_bfloat16():
    args = _inputs(16, 40)
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))  # noqa: E731
    want = jax.grad(loss(_plain(jax.nn.silu)), argnums=(0, 1, 2, 3))(*args)
    got = jax.grad(loss(jax.checkpoint(functools.partial(layers.swiglu, ordered=True))), argnums=(0, 1, 2, 3))(*args)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    # In bfloat16 both orders round differently: each is within a few bf16 steps of float32.
    bf16 = [a.astype(jnp.bfloat16) for a in args]
    got = jax.grad(loss(functools.partial(layers.swiglu, ordered=True)),
                   argnums=(0, 1, 2, 3))(*bf16)
    plain = jax.grad(loss(_plain(jax.nn.silu)), argnums=(0, 1, 2, 3))(*bf16)
    for g, p, w in zip(got, plain, want):
        assert g.dtype == jnp.bfloat16
        err = np.abs(np.asarray(g, np.float32) - w).max()
        assert err <= 2 * np.abs(np.asarray(p, np.float32) - w).max() + 1e-3, err


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_mlp_in_pieces_of_the_sequence_equals_the_whole(family):
    """model.mlp_chunks (HelixPipe's chunked MLP): the same loss and gradients as the MLP over
    the whole sequence, and no [B, T, mlp_dim] array anywhere in the step, only [B, T/c, F]."""
    from flax import nnx

    from jaxrl.models import ModelConfig, Transformer
    from jaxrl.models.transformer import split_params
    from jaxrl.train.step import loss_and_grads

    base = ModelConfig(family=family, vocab_size=32, embed_dim=16, num_layers=2, num_heads=2,
                       num_kv_heads=1, head_dim=8, mlp_dim=40, max_seq_len=16)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 32, (1, 3, 16)).astype(np.int32)
    batch = {"input_ids": ids, "targets": np.roll(ids, -1, -1),
             "loss_mask": np.ones(ids.shape, np.float32)}
    results = []
    for chunks in (1, 4):
        cfg = dataclasses.replace(base, mlp_chunks=chunks)
        graphdef, params = split_params(Transformer(cfg, rngs=nnx.Rngs(0)))
        step = lambda p: loss_and_grads(graphdef, p, batch)[:2]  # noqa: E731
        results.append(jax.jit(step)(params))
        text = str(jax.make_jaxpr(step)(params))
        assert ("3,16,40]" in text) == (chunks == 1)
        assert ("3,4,40]" in text) == (chunks == 4)
    (loss, grads), (loss_c, grads_c) = results
    np.testing.assert_allclose(loss_c, loss, rtol=1e-6)
    for got, want in zip(jax.tree.leaves(grads_c), jax.tree.leaves(grads)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
