"""The engine's decode-attention implementations over the KV pages (serving/runner/paged_kv.py): the
Pallas kernel (serving/runner/paged_attention.py), run on CPU in Pallas's TPU interpreter, the loop
over pages and the native CPU kernel (serving/runner/native), each against attention computed in
numpy float64 from the pool; then the engine decoding through each (pallas, triton, loop,
native, reference), on one device and tensor-parallel, against the references of test_paged.py. That
the Pallas kernel compiles for TPU is in tests/sharding/test_tpu_aot.py."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from serving.core.orchestrator import Orchestrator
from serving.runner import paged_kv
from serving.runner.engine import Engine
from serving.runner.paged_attention import paged_decode_attention
from sharding.mesh import MeshConfig, make_mesh
from tests.serving.common import CFG, ENGINE, run_staggered
from tests.serving.test_paged import _check_against_references, _requests

pytestmark = pytest.mark.multi_device


def _reference(q_BNH, kv_LPKCH, layer, lengths_B, table_BW, window=None, scale=None,
               softcap=None):
    """Row b's query heads against the first lengths_B[b] tokens of its pages (its last
    `window` of them), float64."""
    q, kv = np.asarray(q_BNH, np.float64), np.asarray(kv_LPKCH, np.float64)[layer]
    b, n, h = q.shape
    g = kv.shape[2] // 2
    out = np.zeros((b, n, h))
    for row in range(b):
        tokens = kv[np.asarray(table_BW[row])].reshape(-1, 2 * g, h)[:lengths_B[row]]
        tokens = tokens[-window:] if window else tokens
        for head in range(n):
            kv_head = head // (n // g)
            keys, values = tokens[:, 2 * kv_head], tokens[:, 2 * kv_head + 1]
            s = keys @ q[row, head] * (h ** -0.5 if scale is None else scale)
            s = softcap * np.tanh(s / softcap) if softcap else s
            p = np.exp(s - s.max())
            out[row, head] = p @ values / p.sum()
    return out


def held_pages_case(kv_heads, q_heads, head_dim, page, dtype, seed=0, width=5, layers=3,
                    pages=40):
    """(q, kv, lengths, table), q and kv rounded to `dtype` once: rows of one token, a partial
    page, exactly full pages, the whole table; pages no row holds are NaN."""
    rng = np.random.default_rng(seed)
    lengths = np.asarray([1, page + 3, 2 * page, width * page, page - 1, 3 * page + 1])
    rows = len(lengths)
    table = rng.permutation(np.arange(1, pages))[:rows * width].reshape(rows, width)
    kv = rng.standard_normal((layers, pages, page, 2 * kv_heads, head_dim)).astype(np.float32)
    held = {int(p) for r in range(rows) for p in table[r, :-(-lengths[r] // page)]}
    kv[:, [p for p in range(pages) if p not in held]] = np.nan
    kv = np.asarray(jnp.asarray(kv, dtype).astype(jnp.float32))
    q = np.asarray(jnp.asarray(rng.standard_normal((rows, q_heads, head_dim)), dtype)
                   .astype(jnp.float32))
    return q, kv, lengths, table


@pytest.mark.parametrize("dtype,atol", [("float32", 1e-5), ("bfloat16", 2e-2)])
@pytest.mark.parametrize("kv_heads,q_heads,head_dim,page", [(2, 4, 8, 4), (1, 3, 16, 8),
                                                            (4, 4, 32, 16)])
def test_kernel_equals_attention_over_the_held_tokens(dtype, atol, kv_heads, q_heads, head_dim,
                                                      page):
    """Lengths of one token, a partial page, exactly full pages and the whole table. Pages a
    row does not hold are NaN: a kernel that read one would return NaN."""
    q, kv, lengths, table = held_pages_case(kv_heads, q_heads, head_dim, page, dtype,
                                            seed=kv_heads * 100 + head_dim)
    got = paged_decode_attention(jnp.asarray(q, dtype), jnp.asarray(kv, dtype), 1,
                                 jnp.asarray(lengths, jnp.int32), jnp.asarray(table, jnp.int32),
                                 interpret=pltpu.InterpretParams())
    assert got.dtype == jnp.dtype(dtype) and got.shape == q.shape
    np.testing.assert_allclose(np.asarray(got, np.float32),
                               _reference(q, kv, 1, lengths, table), atol=atol, rtol=atol)


@pytest.mark.parametrize("dtype,atol", [("float32", 1e-5), ("bfloat16", 2e-2)])
@pytest.mark.parametrize("window,scale,softcap", [(None, None, None), (5, None, None),
                                                  (3, 0.3, 2.0)])
@pytest.mark.parametrize("products", ["elementwise", "dots"])
def test_loop_equals_attention_over_the_held_tokens(monkeypatch, dtype, atol, window, scale,
                                                    softcap, products):
    """Blocks of two pages: rows of one token, partial and full pages, one row reaching into
    the third block. Each row's pages past the block it ends in are NaN: a loop that read one
    (as one running every row to the longest row's block did) would return NaN. Both forms of
    the loop's products (a decode step takes the elementwise one; dots forced here)."""
    monkeypatch.setattr(paged_kv, "LOOP_TOKENS", 8)
    monkeypatch.setattr(paged_kv, "ELEMENTWISE_QUERIES", 64 if products == "elementwise" else 0)
    layers, pages, width, page, kv_heads, q_heads, head_dim = 2, 64, 8, 4, 2, 4, 8
    rng = np.random.default_rng(7)
    lengths = np.asarray([1, page + 3, 2 * page, 5 * page - 2, page - 1, 3 * page + 1])
    rows = len(lengths)
    table = rng.permutation(np.arange(1, pages))[:rows * width].reshape(rows, width)
    kv = rng.standard_normal((layers, pages, page, 2 * kv_heads, head_dim)).astype(np.float32)
    for row, length in enumerate(lengths):    # a row's blocks end at its last token's
        kv[:, table[row, -(-length // 8) * 2:]] = np.nan
    kv = np.asarray(jnp.asarray(kv, dtype).astype(jnp.float32))
    q = np.asarray(jnp.asarray(rng.standard_normal((rows, q_heads, head_dim)), dtype)
                   .astype(jnp.float32))
    cache = paged_kv.PagedKV(jnp.asarray(kv, dtype), jnp.asarray(table, jnp.int32), "loop")
    got = jax.jit(lambda c, q, p: c.attend(1, q, p, window=window, scale=scale,
                                           softcap=softcap))(
        cache, jnp.asarray(q, dtype)[:, None], jnp.asarray(lengths - 1, jnp.int32)[:, None])
    assert got.dtype == jnp.dtype(dtype) and got.shape == (rows, 1, q_heads, head_dim)
    np.testing.assert_allclose(np.asarray(got[:, 0], np.float32),
                               _reference(q, kv, 1, lengths, table, window, scale, softcap),
                               atol=atol, rtol=atol)


@pytest.mark.parametrize("q_dtype,kv_dtype,atol", [("float32", "float32", 1e-5),
                                                   ("bfloat16", "bfloat16", 2e-2),
                                                   ("float32", "bfloat16", 1e-5)])
@pytest.mark.parametrize("window,scale,softcap", [(None, None, None), (5, None, None),
                                                  (3, 0.3, 2.0)])
@pytest.mark.parametrize("head_dim,t", [(8, 3), (32, 10), (64, 3)])
def test_native_equals_attention_over_the_held_tokens(q_dtype, kv_dtype, atol, window, scale,
                                                      softcap, head_dim, t):
    """`t` queries a row (a prefill chunk's or a verify step's; a decode step is the last of
    them) at consecutive positions, rows of `t` tokens up to the whole table, keys past its
    64-token block. Pages past each row's last token are NaN: a kernel that read one would
    return NaN. Head widths 32 and 64 take the kernel's unrolled paths, 8 its general one; 10
    queries of 2 heads a kv head are more than the kernel takes together (8), so a row's
    queries go in two passes over its keys."""
    layers, pages, width, page, kv_heads, q_heads = 2, 160, 24, 4, 2, 4
    rng = np.random.default_rng(head_dim)
    lengths = np.maximum([t, page + 3, 2 * page, 70, width * page, 3 * page + 1], t)
    rows = len(lengths)
    table = rng.permutation(np.arange(1, pages))[:rows * width].reshape(rows, width)
    kv = rng.standard_normal((layers, pages, page, 2 * kv_heads, head_dim)).astype(np.float32)
    for row, length in enumerate(lengths):
        kv[:, table[row, -(-length // page):]] = np.nan
    kv = np.asarray(jnp.asarray(kv, kv_dtype).astype(jnp.float32))
    q = np.asarray(jnp.asarray(rng.standard_normal((rows, t, q_heads, head_dim)), q_dtype)
                   .astype(jnp.float32))
    positions = lengths[:, None] - t + np.arange(t)
    cache = paged_kv.PagedKV(jnp.asarray(kv, kv_dtype), jnp.asarray(table, jnp.int32), "native")
    got = jax.jit(lambda c, q, p: c.attend(1, q, p, window=window, scale=scale,
                                           softcap=softcap))(
        cache, jnp.asarray(q, q_dtype), jnp.asarray(positions, jnp.int32))
    assert got.dtype == jnp.dtype(q_dtype) and got.shape == q.shape
    for i in range(t):
        np.testing.assert_allclose(
            np.asarray(got[:, i], np.float32),
            _reference(q[:, i], kv, 1, positions[:, i] + 1, table, window, scale, softcap),
            atol=atol, rtol=atol)


def test_native_attention_is_refused_where_it_cannot_run(monkeypatch):
    """Asked for by name without a C++ compiler: an error that says why; `auto` falls back to
    the XLA loop."""
    from serving.runner import native
    from serving.runner.paged_kv import choose_attention

    native.available.cache_clear()
    monkeypatch.setattr(native, "_compiler", lambda: None)
    monkeypatch.setattr(native, "_library_path", lambda compiler: 1 / 0)
    try:
        with pytest.raises(ValueError, match=r"attention='native' cannot run here: no C\+\+ "
                                             r"compiler found"):
            choose_attention("native", "cpu")
        assert choose_attention("auto", "cpu") == "loop"
    finally:
        monkeypatch.undo()
        native.available.cache_clear()
    with pytest.raises(ValueError, match="attention='native' is a CPU kernel; on gpu"):
        choose_attention("native", "gpu")
    assert choose_attention("auto", "cpu") == "native"


def test_heads_that_do_not_divide_are_refused():
    with pytest.raises(ValueError, match="5 query heads do not divide over 2 kv heads"):
        paged_decode_attention(jnp.zeros((1, 5, 8)), jnp.zeros((1, 4, 4, 4, 8)), 0,
                               jnp.ones((1,), jnp.int32), jnp.ones((1, 1), jnp.int32))


# The kernel in interpret mode costs about 20 s of CPU per engine run, so it runs once, sharded
# (shard_map over the kv heads); its unsharded call is checked against the references above.
@pytest.mark.parametrize("attention,tensor", [("pallas", 2), ("triton", 2), ("triton", 1),
                                              ("loop", 1), ("loop", 2),
                                              ("native", 2), ("reference", 1),
                                              ("reference", 2)])
def test_engine_decoding_through_each_attention_equals_the_references(params, model, attention,
                                                                      tensor):
    """Continuous batching, staggered arrivals, groups, pages reused; tensor=2 runs the kernels
    (pallas: the TPU one, triton: the GPU one, as plain XLA) and the native kernel in
    shard_map over the kv heads, and the loop and reference paths on
    head-sharded pages. Tokens equal, log-probs within 1e-5. (On one device every other
    serving test decodes through the native kernel, the CPU default.)"""
    mesh = make_mesh(MeshConfig(fsdp=1, tensor=tensor), jax.devices()[4:4 + tensor])
    engine = Engine(CFG, dataclasses.replace(ENGINE, attention=attention), mesh=mesh)
    assert engine.cfg.attention == attention
    requests = _requests(seed=3, lengths=(5, 21, 9, 37, 3, 14))
    with Orchestrator(engine, params) as o:
        results = run_staggered(o, requests)
        assert o.scheduler.pool.free == o.scheduler.pool.capacity
    _check_against_references(engine, {0: params}, requests, results, model)


@pytest.mark.parametrize("impl", ["reference", "loop", "native", "pallas", "triton"])
def test_every_attention_reads_an_fp8_pool(impl):
    """kv_cache_dtype=fp8: a float8 e4m3 pool (no scale) read by each implementation (the
    kernels in interpret mode) equals float64 attention over the pool's e4m3 values; writes
    clip to e4m3's range instead of making NaN."""
    layers, pages, page, kv_heads, q_heads, head_dim, width = 2, 64, 8, 2, 4, 16, 5
    rng = np.random.default_rng(8)
    lengths = np.asarray([1, 9, 16, 40, 7, 25])
    table = rng.permutation(np.arange(1, pages))[:len(lengths) * width].reshape(-1, width)
    kv = paged_kv.to_pool(jnp.asarray(3 * rng.standard_normal(
        (layers, pages, page, 2 * kv_heads, head_dim)), jnp.float32), jnp.float8_e4m3fn)
    q = rng.standard_normal((len(lengths), q_heads, head_dim)).astype(np.float32)
    cache = paged_kv.PagedKV(kv, jnp.asarray(table, jnp.int32), impl, interpret=True)
    got = jax.jit(lambda c, q, p: c.attend(1, q, p))(
        cache, jnp.asarray(q)[:, None], jnp.asarray(lengths - 1, jnp.int32)[:, None])
    want = _reference(q, np.asarray(kv.astype(jnp.float32)), 1, lengths, table)
    np.testing.assert_allclose(np.asarray(got[:, 0]), want, atol=1e-5, rtol=1e-5)
    big = paged_kv.to_pool(jnp.asarray([1e4, -1e4, 0.1]), jnp.float8_e4m3fn)
    assert np.asarray(big.astype(jnp.float32)).tolist() == [448.0, -448.0, 0.1015625]
