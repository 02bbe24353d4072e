"""The Pallas GPU decode kernel (serving/runner/paged_attention_gpu.py) on CPU: in interpret mode
against attention in numpy float64 and against JAX's own Pallas GPU paged-attention op (an
independent, maintained kernel over another layout); lowered to Triton IR for CUDA, with the pool
read by the kernel alone (no copy or gather of it in the program); the engine's refusals. The
engine decoding through it is in test_paged_attention.py (tensor-parallel), on a GPU in
tests/gpu/test_gpu.py."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged

from serving.runner.paged_attention_gpu import Tuning, paged_decode_attention_gpu, plan
from serving.runner.paged_kv import choose_attention
from tests.serving.test_paged_attention import _reference, held_pages_case


def _kernel(q, kv, layer, lengths, table, dtype, **kw):
    return paged_decode_attention_gpu(jnp.asarray(q, dtype), jnp.asarray(kv, dtype), layer,
                                      jnp.asarray(lengths, jnp.int32),
                                      jnp.asarray(table, jnp.int32), interpret=True, **kw)


@pytest.mark.parametrize("dtype,atol", [("float32", 1e-5), ("bfloat16", 3e-2)])
@pytest.mark.parametrize("kv_heads,q_heads,head_dim,page", [(2, 4, 16, 4), (1, 3, 16, 8),
                                                            (4, 4, 32, 16), (2, 14, 64, 16),
                                                            (1, 40, 16, 32)])
@pytest.mark.parametrize("splits,block_keys", [(None, 64), (1, 16), (3, 32)])
def test_kernel_equals_attention_over_the_held_tokens(dtype, atol, kv_heads, q_heads,
                                                      head_dim, page, splits, block_keys):
    """Query heads per kv head from 1 to 40 (padded to Triton's 16 rows, or past them); one
    split or several, blocks of one page or several."""
    q, kv, lengths, table = held_pages_case(kv_heads, q_heads, head_dim, page, dtype,
                                            seed=head_dim)
    got = _kernel(q, kv, 2, lengths, table, dtype,
                  tuning=Tuning(splits=splits, block_keys=block_keys))
    assert got.dtype == jnp.dtype(dtype) and got.shape == q.shape
    np.testing.assert_allclose(np.asarray(got, np.float32),
                               _reference(q, kv, 2, lengths, table), atol=atol, rtol=atol)


def test_kernel_equals_jax_pallas_gpu_paged_attention():
    """The same attention through JAX's op, its pages laid out as it takes them ([G, P, K, H]
    keys and values of one layer; its own padding and splits), unheld pages zeroed for it. JAX's
    op does not scale q.k: scale 1 here."""
    q, kv, lengths, table = held_pages_case(2, 8, 32, 8, "float32", seed=5, width=8, pages=64)
    layer = kv[1].copy()
    layer[np.isnan(layer)] = 0.0
    k_pages = np.moveaxis(layer[:, :, 0::2], 2, 0)      # [G, P, K, H]
    v_pages = np.moveaxis(layer[:, :, 1::2], 2, 0)
    want = jax_paged.paged_attention(jnp.asarray(q), jnp.asarray(k_pages), jnp.asarray(v_pages),
                                     jnp.asarray(table, jnp.int32),
                                     jnp.asarray(lengths, jnp.int32), k_splits=2,
                                     pages_per_compute_block=2, interpret=True)
    got = _kernel(q, kv, 1, lengths, table, "float32", scale=1.0)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows,kv_heads,width,page,want", [
    (64, 2, 64, 16, (4, 32, 2)),     # 128 programs: two splits of the table
    (256, 2, 64, 16, (4, 64, 1)),    # the batch alone fills the GPU: one split
    (1, 1, 3, 4, (4, 4, 1)),         # a short table: one block, padded
    (4, 2, 100, 32, (2, 4, 25))])    # many splits for few programs
def test_plan(rows, kv_heads, width, page, want):
    per_block, per_split, splits = plan(rows, kv_heads, width, page)
    assert (per_block, per_split, splits) == want
    assert per_block * page >= 16 and splits * per_split >= width > (splits - 1) * per_split


@pytest.mark.parametrize("shape", ["0.5b", "1.5b"])
def test_kernel_lowers_to_triton_for_cuda_reading_the_pool_in_place(shape):
    """Qwen2.5's decode shapes (64 rows, 1,024 held tokens, bf16), lowered for CUDA on this
    CPU host: one Triton call over (rows, kv heads, splits), and no tensor in the program as
    big as one kv head's keys gathered for the batch, the pool aside (no slice, gather or copy
    of it: the kernel reads it in place)."""
    layers, q_heads, kv_heads, head_dim = {"0.5b": (24, 14, 2, 64),
                                           "1.5b": (28, 12, 2, 128)}[shape]
    rows, width, pages, page = 64, 72, 64 * 72 + 1, 16
    args = (jax.ShapeDtypeStruct((rows, q_heads, head_dim), jnp.bfloat16),
            jax.ShapeDtypeStruct((layers, pages, page, 2 * kv_heads, head_dim), jnp.bfloat16),
            jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((rows,), jnp.int32),
            jax.ShapeDtypeStruct((rows, width), jnp.int32))
    triton = "__gpu$xla.gpu.triton"
    exported = export.export(
        jax.jit(paged_decode_attention_gpu), platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call(triton)])(*args)
    text = exported.mlir_module()
    assert re.findall(r"custom_call @([^(]+)\(", text) == [triton]
    splits = plan(rows, kv_heads, width, page)[2]
    assert re.search(rf"grid_x = {rows} : i32, grid_y = {kv_heads} : i32, grid_z = {splits}",
                     text)
    pool = tuple(args[1].shape)
    gathered = rows * width * page * head_dim       # one kv head's keys, gathered per row
    shapes = {tuple(map(int, dims.split("x")[:-1]))
              for dims in re.findall(r"tensor<((?:\d+x)+)\w+>", text)}
    assert pool in shapes
    assert all(np.prod(shape) < gathered for shape in shapes - {pool}), shapes


def test_engine_refuses_a_kernel_off_its_platform():
    with pytest.raises(ValueError, match="attention='triton' is a GPU kernel; on tpu use "
                                         "attention='pallas'"):
        choose_attention("triton", "tpu")
    with pytest.raises(ValueError, match="attention='pallas' is a TPU kernel; on gpu use "
                                         "attention='triton'"):
        choose_attention("pallas", "gpu")
    assert choose_attention("triton", "gpu") == "triton"
    assert choose_attention("triton", "cpu") == "triton"


def test_shapes_triton_cannot_block_are_refused():
    with pytest.raises(ValueError, match="head_dim 24 and page size 16 must be powers of two"):
        paged_decode_attention_gpu(jnp.zeros((1, 4, 24)), jnp.zeros((1, 4, 16, 4, 24)), 0,
                                   jnp.ones((1,), jnp.int32), jnp.ones((1, 1), jnp.int32))
    with pytest.raises(ValueError, match="5 query heads do not divide over 2 kv heads"):
        paged_decode_attention_gpu(jnp.zeros((1, 5, 16)), jnp.zeros((1, 4, 4, 4, 16)), 0,
                                   jnp.ones((1,), jnp.int32), jnp.ones((1, 1), jnp.int32))
