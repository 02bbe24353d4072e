"""Block attention over packed rows (jaxrl/models/block_attention.py) against the dense masked
path (layers.attention with causal_mask(segment_ids)): values and gradients of q, k and v, on
rows packed as the packers pack them; the work list holds only the block pairs that share a
segment; and a model's forward and gradients through each path agree."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.models import ModelConfig, Transformer, merge_params, split_params
from jaxrl.models import block_attention as ba
from jaxrl.models import layers as ops


def packed_segments(lengths_per_row: list[list[int]], t: int) -> np.ndarray:
    """Segment ids 1, 2, ... laid out in order from position 0, padding (0) after them."""
    out = np.zeros((len(lengths_per_row), t), np.int32)
    for row, lengths in enumerate(lengths_per_row):
        at = 0
        for s, n in enumerate(lengths):
            out[row, at:at + n] = s + 1
            at += n
        assert at <= t
    return out


ROWS = [[1, 63, 64, 5, 200, 17, 60],            # one token, block edges, a segment over blocks
        [300],                                   # one long sample, then padding
        [],                                      # padding only
        [64] * 5 + [40, 27]]                     # exactly one block each, then a ragged end


@pytest.mark.parametrize("t", [448, 427])        # whole blocks; a ragged length padded inside
def test_values_and_gradients_equal_the_dense_masked_path(t):
    rng = np.random.default_rng(t)
    seg = packed_segments(ROWS, t)
    b, n, g, h = len(ROWS), 4, 2, 16
    q = jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, t, g, h)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, t, g, h)), jnp.float32)
    cot = jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.float32)
    real = jnp.asarray(seg > 0)[:, :, None, None]    # padding queries: zeros here, any there
    scale = 0.3

    def dense(q, k, v):
        out = ops.attention(q, k, v, ops.causal_mask(jnp.asarray(seg)), "xla",
                            scoring=ops.Scoring(scale))
        return jnp.where(real, out, 0.0)

    def blocks(q, k, v):
        return ba.block_attention(q, k, v, jnp.asarray(seg), scale)

    want, want_vjp = jax.vjp(dense, q, k, v)
    got, got_vjp = jax.vjp(jax.jit(blocks), q, k, v)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
    assert not np.asarray(got)[~np.asarray(seg > 0)].any()
    for name, a, w in zip("qkv", got_vjp(cot), want_vjp(cot)):
        np.testing.assert_allclose(a, w, atol=5e-5, rtol=5e-5, err_msg=name)


def test_the_work_list_holds_only_pairs_that_share_a_segment():
    """Per query block: the key blocks from its first query's segment start up to itself."""
    seg = packed_segments([[64] * 4, [256], [10, 118, 128], []], 256)
    _, count, ends = ba._work_list(jnp.asarray(seg))
    assert np.asarray(count).reshape(4, 4).tolist() == [
        [1, 1, 1, 1],            # each block its own sample
        [1, 2, 3, 4],            # one sample: the causal triangle
        [1, 2, 1, 2],            # block 1 starts in the segment from position 10
        [0, 0, 0, 0]]            # padding: nothing
    assert int(ends[-1]) == 4 + 10 + 6


def test_a_model_s_loss_and_gradients_through_either_path(monkeypatch):
    monkeypatch.setattr(ba, "MIN_LENGTH", 128)      # rows this short otherwise stay dense
    cfg = ModelConfig(vocab_size=64, embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=8, mlp_dim=64, max_seq_len=512)
    seg = packed_segments([[40, 30, 50, 60, 70, 45, 80], [64] * 5 + [50]], 384)
    rng = np.random.default_rng(1)
    ids = jnp.asarray(rng.integers(0, 64, seg.shape), jnp.int32)
    positions = np.zeros_like(seg)
    for row in range(seg.shape[0]):
        for s in np.unique(seg[row][seg[row] > 0]):
            at = np.nonzero(seg[row] == s)[0]
            positions[row, at] = np.arange(len(at))
    graphdefs, params = {}, None
    for path in ("dense", "blocks"):
        graphdefs[path], params = split_params(Transformer(
            dataclasses.replace(cfg, packed_attention=path), rngs=nnx.Rngs(0)))

    def loss(params, path):
        logits = merge_params(graphdefs[path], params)(
            ids, jnp.asarray(positions), jnp.asarray(seg))
        return jnp.sum(jnp.where(jnp.asarray(seg > 0)[..., None], logits, 0.0) ** 2) * 1e-3

    (want, want_g), (got, got_g) = (jax.value_and_grad(loss)(params, p)
                                    for p in ("dense", "blocks"))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, w in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
        np.testing.assert_allclose(a, w, rtol=1e-4, atol=1e-5)


def test_auto_is_blocks_for_one_cpu_device_only():
    cfg = ModelConfig(vocab_size=64, embed_dim=32, num_layers=1, num_heads=4, num_kv_heads=2,
                      head_dim=8, mlp_dim=64)
    assert cfg.for_platform("cpu").packed_attention == "blocks"
    assert cfg.for_platform("cpu", devices=8).packed_attention == "dense"
    assert cfg.for_platform("tpu").packed_attention == "dense"
    assert cfg.for_platform("gpu").packed_attention == "dense"
