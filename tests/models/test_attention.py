"""Attention paths: the XLA reference against jax.nn.dot_product_attention and a numpy loop.
(The TPU splash kernel's ahead-of-time compile is in tests/sharding/test_tpu_aot.py.)"""

import math

import jax
import numpy as np
import pytest

from jaxrl.models.layers import attention, causal_mask


def _qkv(b=2, t=6, n=4, g=2, h=8, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((b, t, n, h), np.float32),
            rng.standard_normal((b, t, g, h), np.float32),
            rng.standard_normal((b, t, g, h), np.float32))


def _numpy_attention(q, k, v, segments):
    b, t, n, h = q.shape
    g = k.shape[2]
    out = np.zeros_like(q)
    for bi in range(b):
        for i in range(t):
            keys = [j for j in range(i + 1) if segments[bi, j] == segments[bi, i]]
            for head in range(n):
                kv = head // (n // g)
                s = np.array([q[bi, i, head] @ k[bi, j, kv] for j in keys]) / math.sqrt(h)
                p = np.exp(s - s.max())
                p /= p.sum()
                out[bi, i, head] = sum(pj * v[bi, j, kv] for pj, j in zip(p, keys))
    return out


def test_xla_attention_matches_reference_with_segments():
    q, k, v = _qkv()
    segments = np.array([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 1, 1]], np.int32)
    got = attention(q, k, v, causal_mask(segments), "xla", segments)
    np.testing.assert_allclose(got, _numpy_attention(q, k, v, segments), atol=1e-5)


def test_xla_attention_matches_jax_nn():
    q, k, v = _qkv(seed=1)
    got = attention(q, k, v, causal_mask(None, q.shape[1]), "xla")
    ref = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    np.testing.assert_allclose(got, ref, atol=1e-5)


def test_unknown_implementation():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="attention='flash' is not one of"):
        attention(q, k, v, causal_mask(None, q.shape[1]), "flash")
