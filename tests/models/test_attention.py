"""Attention paths: the XLA reference against jax.nn.dot_product_attention and a numpy loop.
(The TPU splash kernel's ahead-of-time compile is in tests/sharding/test_tpu_aot.py.)"""

import math

import jax
import numpy as np
import pytest

from jaxrl.models.layers import (Scoring, attention, causal_blocks, causal_mask, segment_layout,
                                window_mask)


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


@pytest.mark.multi_device
def test_splash_in_shard_map_equals_xla_values_and_gradients():
    """The splash kernel (Pallas interpret mode on CPU) inside shard_map over a fsdp=4 x
    tensor=2 mesh of CPU devices, on packed rows (two segments each) with 4 query heads on 2
    key/value heads: outputs and gradients against the XLA path."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxrl.models import layers as ops
    from sharding import mesh as shd

    mesh = shd.make_mesh(shd.MeshConfig(fsdp=4, tensor=2), jax.devices()[:8])
    rng = np.random.default_rng(0)
    b, t, n, g, h = 4, 128, 4, 2, 16
    q = jnp.asarray(rng.normal(size=(b, t, n, h)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(b, t, g, h)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(b, t, g, h)), jnp.float32)
    cut = rng.integers(20, 100, b)
    seg = jnp.asarray(np.where(np.arange(t)[None] < cut[:, None], 1, 2), jnp.int32)
    w = jnp.asarray(rng.normal(size=(b, t, n, h)), jnp.float32)
    on_mesh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
    q, k, v, seg, w = (jax.device_put(x, on_mesh) for x in (q, k, v, seg, w))

    def loss(impl, q, k, v):
        mask = ops.causal_mask(seg)
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            out = ops.attention(q, k, v, mask, impl, segment_ids_BT=seg)
        return jnp.sum(out * w), out

    results = {}
    for impl in ("xla", "splash"):
        fn = jax.jit(jax.value_and_grad(lambda *a: loss(impl, *a), argnums=(0, 1, 2),
                                        has_aux=True))
        (_, out), grads = fn(q, k, v)
        results[impl] = (out, grads)
    np.testing.assert_allclose(results["splash"][0], results["xla"][0], atol=2e-5, rtol=1e-4)
    for got, want in zip(results["splash"][1], results["xla"][1]):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-3)


def test_segment_layout_gives_each_packed_segments_length_and_start():
    rng = np.random.default_rng(4)
    rows = []
    for _ in range(6):
        lengths = rng.integers(1, 9, rng.integers(1, 6))
        row = np.repeat(np.arange(1, len(lengths) + 1), lengths)[:32]
        rows.append(np.pad(row, (0, 32 - len(row))))          # padding: id 0, at the end
    segments = np.stack(rows).astype(np.int32)
    got_lengths, got_offsets = map(np.asarray, segment_layout(segments, 8))
    for row, lengths, offsets in zip(segments, got_lengths, got_offsets):
        ids = [s for s in np.unique(row) if s]
        want = [int(np.sum(row == s)) for s in ids]
        assert lengths.tolist() == want + [-1] * (8 - len(ids))
        assert offsets.tolist() == [int(np.argmax(row == s)) for s in ids] + [-1] * (9 - len(ids))


def test_cudnn_path_lowers_to_the_fused_kernel_without_a_t_by_t_mask(monkeypatch):
    """Lowered for CUDA on this GPU-less machine (cuDNN's version and compute-capability probes
    stood in for an H100's): forward and backward are cuDNN's flash attention with the padding-
    causal mask over per-segment lengths and offsets, and no [T, T] array appears anywhere in
    the program (no mask, no bias). Its numbers are checked on a GPU (tests/gpu)."""
    import re

    import jax.numpy as jnp
    from jax import export
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    monkeypatch.setattr(cudnn, "check_cudnn_version", lambda: 91000)
    monkeypatch.setattr(cudnn, "check_compute_capability", lambda capability: True)
    monkeypatch.setattr(cudnn, "is_cuda_compute_capability_equal", lambda capability: False)
    b, t, n, g, h = 2, 384, 4, 2, 64

    def loss(q, k, v, segments):
        out = attention(q, k, v, causal_mask(segments), "cudnn", segments, max_segments=8)
        return jnp.sum(out.astype(jnp.float32))

    spec = jax.ShapeDtypeStruct
    args = (spec((b, t, n, h), jnp.bfloat16), spec((b, t, g, h), jnp.bfloat16),
            spec((b, t, g, h), jnp.bfloat16), spec((b, t), jnp.int32))
    targets = ("__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward")
    exported = export.export(
        jax.jit(jax.grad(loss, argnums=(0, 1, 2))), platforms=("cuda",),
        disabled_checks=[export.DisabledSafetyCheck.custom_call(c) for c in targets])(*args)
    module = exported.mlir_module()
    assert set(re.findall(r"custom_call @(__cudnn\S+)\(", module)) == set(targets)
    assert "PADDING_CAUSAL" in module.replace("\\22", "")
    shapes = set(re.findall(r"tensor<([0-9x]+)x(?:[a-z]+\d*)>", module))
    assert not [s for s in shapes if f"{t}x{t}" in s], sorted(shapes)
    assert f"tensor<{b}x{8 + 1}xi32>" in module                  # the segments' offsets


@pytest.mark.parametrize("t", [256, 529])     # two even blocks; four uneven ones
def test_causal_blocks_give_the_full_masks_values_and_gradients(t):
    """The forward over whole sequences skips the keys after each block of queries: values and
    gradients equal the dense path's (checked above against numpy and jax.nn), with packed
    segments, a sliding window and soft-capping in the mask and scores."""
    q, k, v = _qkv(b=2, t=t, seed=t)
    segments = np.where(np.arange(t) < t // 3, 1, np.where(np.arange(t) < t - 7, 2, 0))
    segments = np.stack([segments, np.ones(t, int)]).astype(np.int32)
    positions = np.arange(t)[None].repeat(2, 0)
    mask = causal_mask(segments) & window_mask(positions, positions, 100)
    cotangent = np.random.default_rng(1).standard_normal(q.shape).astype(np.float32)

    def run(causal):
        out, grad = jax.vjp(lambda q, k, v: attention(q, k, v, mask, "xla",
                                                      scoring=Scoring(softcap=20.0,
                                                                      causal=causal)), q, k, v)
        return out, grad(cotangent)

    (got, got_grads), (want, want_grads) = run(True), run(False)
    np.testing.assert_allclose(got, want, atol=2e-6)
    for g, w in zip(got_grads, want_grads):
        np.testing.assert_allclose(g, w, atol=2e-5 * np.abs(w).max())


def test_causal_blocks_skip_the_scores_above_the_block_diagonal():
    assert causal_blocks(255) == (0,)
    assert causal_blocks(256) == (0, 128)
    assert causal_blocks(529) == (0, 133, 266, 399)
    assert causal_blocks(8192) == (0, 2048, 4096, 6144)
    q, k, v = _qkv(b=1, t=1024)
    mask = causal_mask(None, 1024)

    def flops(causal):
        def loss(q, k, v):
            return attention(q, k, v, mask, scoring=Scoring(causal=causal)).sum()

        cost = jax.jit(jax.grad(loss, (0, 1, 2))).lower(q, k, v).compile().cost_analysis()
        return (cost[0] if isinstance(cost, list) else cost)["flops"]

    # 4 blocks compute 5/8 of the scores: forward and backward together at most 0.7 of them.
    assert flops(True) <= 0.7 * flops(False)
