"""The GPU suite (marker `gpu`; `make test` deselects it). On an NVIDIA host:

    JAX_PLATFORMS=cuda,cpu .venv/bin/python -m pytest tests/gpu -m gpu

(JAX_PLATFORMS must be given: tests/conftest.py defaults it to cpu.) Each test checks the GPU
against a CPU float32 reference or against another GPU path: the model's logits; cuDNN attention
against XLA attention on packed rows (values and gradients), and jaxrl's wrapper of cuDNN's
packed layout against jax's public API; the engine's greedy tokens in
bf16 against float32; every remat policy's gradients against `none`; `offload` lowering the
peak device memory (`memory_stats`); an in-flight weight update during generation; the Pallas
GPU paged-attention kernel (Triton) against the gather reference, alone and in the engine; a
tcp weight pull staged onto the GPU through a few host buffers.

`tests/gpu/campaign.sh` runs it and then the GPU campaign; docs/benchmarks.md has its last
results."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.models import ModelConfig, Transformer, merge_params, split_params

pytestmark = pytest.mark.gpu

CFG = ModelConfig(vocab_size=512, embed_dim=256, num_layers=4, num_heads=8, num_kv_heads=2,
                  head_dim=32, mlp_dim=768, max_seq_len=512)


def gpu():
    devices = [d for d in jax.devices() if d.platform == "gpu"]
    if not devices:
        pytest.fail("the gpu suite needs a GPU: run it with JAX_PLATFORMS=cuda,cpu on an "
                    "NVIDIA host")
    return devices[0]


def cpu():
    return jax.devices("cpu")[0]


def model_on(device, cfg=CFG, seed=0):
    graphdef, params = split_params(Transformer(cfg, rngs=nnx.Rngs(seed)))
    return graphdef, jax.device_put(params, device)


def packed_batch(b=4, t=256, segments=3, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, CFG.vocab_size, (b, t)).astype(np.int32)
    cuts = np.sort(rng.integers(16, t - 16, (b, segments - 1)), axis=1)
    seg = 1 + (np.arange(t)[None, :, None] >= cuts[:, None, :]).sum(-1)
    pos = np.zeros_like(ids)
    for i in range(b):
        for s in np.unique(seg[i]):
            where = np.flatnonzero(seg[i] == s)
            pos[i, where] = np.arange(len(where))
    return ids, seg.astype(np.int32), pos.astype(np.int32)


def test_logits_on_gpu_equal_the_cpu_float32_reference():
    ids, seg, pos = packed_batch()
    want = None
    for device in (cpu(), gpu()):
        graphdef, params = model_on(device)
        with jax.default_device(device):
            logits = jax.jit(lambda p, i, s, q: merge_params(graphdef, p)(
                i, positions_BT=q, segment_ids_BT=s))(params, ids, seg, pos)
        got = np.asarray(logits, np.float32)
        if want is None:
            want = got
    np.testing.assert_allclose(got, want, atol=2e-3, rtol=2e-3)   # TF32 matmuls on GPU


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])    # cuDNN's flash attention
def test_cudnn_attention_equals_xla_on_packed_rows(dtype):
    from jaxrl.models import layers as ops

    rng = np.random.default_rng(1)
    b, t, n, g, h = 2, 256, 8, 2, 64
    q, w = (jnp.asarray(rng.normal(size=(b, t, n, h)), dtype) for _ in range(2))
    k, v = (jnp.asarray(rng.normal(size=(b, t, g, h)), dtype) for _ in range(2))
    _, seg, _ = packed_batch(b, t, seed=2)
    seg = jnp.asarray(seg)
    q, k, v, w, seg = jax.device_put((q, k, v, w, seg), gpu())

    def loss(impl, q, k, v):
        out = ops.attention(q, k, v, ops.causal_mask(seg), impl, segment_ids_BT=seg)
        return jnp.sum(out.astype(jnp.float32) * w.astype(jnp.float32)), out

    results = {impl: jax.jit(jax.value_and_grad(lambda *a, impl=impl: loss(impl, *a),
                                                argnums=(0, 1, 2), has_aux=True))(q, k, v)
               for impl in ("xla", "cudnn")}
    tol = 2e-2 if dtype == "bfloat16" else 4e-3
    (_, out), grads = results["cudnn"]
    (_, ref), ref_grads = results["xla"]
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               atol=tol, rtol=tol)
    for got, want in zip(grads, ref_grads):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   atol=10 * tol, rtol=10 * tol)


def test_the_packed_cudnn_wrapper_equals_the_public_api_on_rows_of_one_segment():
    """jaxrl/models/cudnn_packed.py (jax's private ragged layout) against the public
    `jax.nn.dot_product_attention(implementation="cudnn")` with one sequence length per row,
    where both apply: each row one segment, shorter than the row."""
    from jaxrl.models.cudnn_packed import packed_attention
    from jaxrl.models.layers import segment_layout

    rng = np.random.default_rng(3)
    b, t, n, g, h = 2, 128, 8, 2, 64
    q = jnp.asarray(rng.normal(size=(b, t, n, h)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.normal(size=(b, t, g, h)), jnp.bfloat16) for _ in range(2))
    lengths = np.asarray([t, 77], np.int32)
    seg = jnp.asarray((np.arange(t)[None, :] < lengths[:, None]).astype(np.int32))
    q, k, v, seg, lens = jax.device_put((q, k, v, seg, jnp.asarray(lengths)), gpu())
    scale = h ** -0.5
    lengths_BM, offsets_BM1 = segment_layout(seg, 4)
    got = jax.jit(packed_attention, static_argnums=5)(q, k, v, lengths_BM, offsets_BM1, scale)
    want = jax.jit(lambda q, k, v, n: jax.nn.dot_product_attention(
        q, k, v, scale=scale, is_causal=True, query_seq_lengths=n, key_value_seq_lengths=n,
        implementation="cudnn"))(q, k, v, lens)
    for row, length in enumerate(lengths):      # positions past a row's segment are padding
        np.testing.assert_allclose(np.asarray(got[row, :length], np.float32),
                                   np.asarray(want[row, :length], np.float32),
                                   atol=2e-2, rtol=2e-2)


def _greedy_tokens(params, configs: dict, max_tokens: int) -> dict:
    """Greedy tokens of 8 random 12-token prompts through an engine of each EngineConfig."""
    from serving.core.orchestrator import Orchestrator
    from serving.runner.engine import Engine
    from serving.runner.sampling import SamplingParams

    prompts = [np.random.default_rng(i).integers(3, CFG.vocab_size, 12).tolist()
               for i in range(8)]
    tokens = {}
    for name, engine_cfg in configs.items():
        with Orchestrator(Engine(CFG, engine_cfg), params, eos_id=None) as o:
            tokens[name] = [o.submit(p, SamplingParams(max_tokens=max_tokens, temperature=0.0))
                            .result()[0].tokens for p in prompts]
    return tokens


def test_engine_greedy_tokens_in_bfloat16_follow_float32():
    from serving.runner.engine import EngineConfig

    graphdef, params = model_on(gpu())
    tokens = _greedy_tokens(params, {dtype: EngineConfig(
        max_concurrent_decodes=8, max_len=64, max_prefill_length=16, prefill_chunk=16,
        dtype=dtype) for dtype in ("float32", "bfloat16")}, 16)
    # A random model's logits are nearly flat, so bf16 may flip a near tie and then diverge:
    # the first token agrees for at least 7 prompts of 8 (on CPU, as a check of this test: 8).
    agree = sum(a[0] == b[0] for a, b in zip(tokens["float32"], tokens["bfloat16"]))
    assert agree >= 7, tokens


@pytest.mark.parametrize("q_heads,head_dim", [(14, 64), (12, 128)])     # Qwen2.5 0.5B, 1.5B
def test_triton_paged_attention_equals_the_gather_reference(q_heads, head_dim):
    """The Pallas GPU kernel, compiled by Triton, against the pool gathered and attended with
    XLA in float32 on the CPU: rows of one token to the whole table, bf16 pool."""
    from serving.runner.paged_attention_gpu import paged_decode_attention_gpu
    from serving.runner.paged_kv import PagedKV

    rng = np.random.default_rng(head_dim)
    page, width, pages, kv_heads = 16, 16, 200, 2
    lengths = np.asarray([1, 17, 32, 255, width * page, 100, 15, 129], np.int32)
    table = rng.permutation(np.arange(1, pages))[:len(lengths) * width].reshape(-1, width)
    kv = jnp.asarray(rng.standard_normal((3, pages, page, 2 * kv_heads, head_dim)),
                     jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((len(lengths), q_heads, head_dim)), jnp.bfloat16)
    got = paged_decode_attention_gpu(jax.device_put(q, gpu()), jax.device_put(kv, gpu()), 1,
                                     jnp.asarray(lengths), jnp.asarray(table, jnp.int32))
    cache = PagedKV(jax.device_put(kv, cpu()).astype(jnp.float32),
                    jnp.asarray(table, jnp.int32), "reference")
    want = cache.attend(1, jax.device_put(q, cpu()).astype(jnp.float32)[:, None],
                        jnp.asarray(lengths - 1)[:, None])[:, 0]
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=3e-2,
                               rtol=3e-2)


def test_engine_decoding_through_the_triton_kernel_follows_the_reference():
    """Greedy tokens of an engine decoding through the Triton kernel against one decoding
    through the gather reference, both in float32 on the GPU (head_dim 32)."""
    from serving.runner.engine import EngineConfig

    graphdef, params = model_on(gpu())
    tokens = _greedy_tokens(params, {attention: EngineConfig(
        max_concurrent_decodes=8, max_len=128, max_prefill_length=16, prefill_chunk=16,
        page_size=16, attention=attention) for attention in ("reference", "triton")}, 64)
    # Near ties may flip (TF32 dots): the first 8 tokens agree for at least 7 prompts of 8.
    agree = sum(a[:8] == b[:8] for a, b in zip(tokens["reference"], tokens["triton"]))
    assert agree >= 7, tokens


def _grads(remat, device):
    from jaxrl.train.step import Layout, loss_and_grads

    graphdef, params = model_on(device)
    ids, seg, pos = packed_batch()
    batch = {"input_ids": ids[None], "targets": np.roll(ids, -1, -1)[None],
             "loss_mask": np.ones((1,) + ids.shape, np.float32), "segment_ids": seg[None],
             "positions": pos[None]}
    fn = jax.jit(lambda p, b: loss_and_grads(graphdef, p, b, layout=Layout(remat=remat))[:2])
    return fn(params, jax.device_put(batch, device)), fn, params, batch


@pytest.mark.parametrize("remat", ["full", "minimal", "offload"])
def test_every_remat_policy_gives_the_gradients_of_none_on_gpu(remat):
    (loss, grads), *_ = _grads(remat, gpu())
    (ref_loss, ref_grads), *_ = _grads("none", gpu())
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-4)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        scale = float(jnp.max(jnp.abs(r))) + 1e-12
        assert float(jnp.max(jnp.abs(g - r))) / scale <= 1e-3


def test_offload_lowers_the_peak_device_memory():
    peaks = {}
    for remat in ("none", "offload"):
        _, fn, params, batch = _grads(remat, gpu())
        compiled = fn.lower(params, jax.device_put(batch, gpu())).compile()
        peaks[remat] = compiled.memory_analysis().temp_size_in_bytes
    assert peaks["offload"] < peaks["none"], peaks
    stats = gpu().memory_stats()
    assert stats and stats.get("peak_bytes_in_use", 0) > 0


def test_in_flight_update_during_generation_on_gpu():
    from serving.core.orchestrator import Orchestrator
    from serving.runner.engine import Engine, EngineConfig
    from serving.runner.sampling import SamplingParams

    graphdef, params = model_on(gpu())
    other = jax.tree.map(lambda x: x * 1.5, params)
    engine = Engine(CFG, EngineConfig(max_concurrent_decodes=4, max_len=256,
                                      max_prefill_length=16, prefill_chunk=16))
    with Orchestrator(engine, params, eos_id=None) as o:
        stream = o.submit([5, 6, 7], SamplingParams(max_tokens=200, temperature=0.0))
        for _ in range(6000):                     # at most a minute: some tokens under v0
            if o.metrics()["generated_tokens"] >= 5:
                break
            time.sleep(0.01)
        result = o.update_params(other, 1, timeout=60)
        [sample] = stream.result()
    assert result.version == 1 and sample.versions[0] == 0 and sample.versions[-1] == 1
    assert sample.versions == sorted(sample.versions)


def test_a_tcp_pull_onto_the_gpu_is_staged_and_serves_what_it_pulled():
    """A server on one GPU pulls tcp weights through a few host buffers into their places on the
    device (serving/weights/staging.py): the pull's host memory stays far below the model's bytes,
    the tensors arrive equal to what was offered, and a server serving them generates what an
    engine holding them generates."""
    import tracemalloc

    from serving.core.orchestrator import Orchestrator
    from serving.fleet.client import RemoteGeneration
    from serving.frontends.server import Server
    from serving.runner.engine import Engine, EngineConfig
    from serving.runner.sampling import SamplingParams
    from serving.weights import staging
    from serving.weights.bulk import BulkServer
    from serving.weights.bulk_pull import pull

    _, params = model_on(gpu())
    flat = {"/".join(str(k.key) for k in path): np.asarray(x)
            for path, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    specs = [(n, a.shape, a.dtype.name) for n, a in flat.items()]
    bulk = BulkServer.get()
    uuid, _ = bulk.offer(list(flat.values()), 120)
    old = staging.CHUNK
    staging.CHUNK = 64 << 10                    # many pieces for this small model
    try:
        pull(bulk.address, uuid, specs, 120, onto=gpu())      # compiles the block writes
        tracemalloc.start()
        got, _ = pull(bulk.address, uuid, specs, 120, onto=gpu())
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    finally:
        staging.CHUNK = old
    for name, a in flat.items():
        assert got[name].devices() == {gpu()} and np.array_equal(np.asarray(got[name]), a)
    assert peak < sum(a.nbytes for a in flat.values()) / 4, peak

    other = jax.tree.map(lambda x: x * 1.5 + 0.01, params)
    engine_cfg = EngineConfig(max_concurrent_decodes=4, max_len=256, max_prefill_length=16,
                              prefill_chunk=16)
    server = Server(Orchestrator(Engine(CFG, engine_cfg), params, version=0,
                                 eos_id=None).start(), port=0, update_token="t").start()
    remote = RemoteGeneration(server.address, token="t", transfer="tcp")
    sampling = SamplingParams(max_tokens=8, temperature=0.0)
    try:
        assert remote.update_params(other, 1, timeout=120).version == 1
        with Orchestrator(Engine(CFG, engine_cfg), other, version=1, eos_id=None) as want:
            expected = want.submit([5, 6, 7], sampling).result()[0].tokens
        [sample] = remote.submit([5, 6, 7], sampling).result()
        assert sample.tokens == expected and set(sample.versions) == {1}
    finally:
        remote.close()
        server.stop(0)
