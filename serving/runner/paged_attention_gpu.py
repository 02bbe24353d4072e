"""A Pallas (Triton) decode-attention kernel for GPUs that reads the paged KV pool in place
(serving/runner/paged_kv.py's layout, [L, P, K, 2G, H]): one query per row, flash decoding over each
row's pages up to its length, split along the sequence so that small batches still fill the GPU.

Grid (row, kv head, split): a program owns one row's queries of one kv head (R = N / G of them,
padded to a power of two of at least 16 for the tensor cores) and one contiguous range of the
row's table. It walks that range a block of C pages (C * K keys) at a time, up to the last page
the row holds, gathering each block's keys and values straight from the pool through the page
table (pointer arithmetic on the whole pool: no copy of a layer, no gather into a new buffer),
and keeps an online softmax in registers. Each split writes its partial output with its
running max and sum; a few XLA ops fold the splits (flash decoding).

The design follows JAX's Pallas GPU paged-attention op (jax.experimental.pallas.ops.gpu.
paged_attention), which this kernel is checked against. That op takes per-layer [G, P, K, H]
key and value pages; slicing one layer's heads out of this pool before each call would copy the
layer's whole cache every decode step, so the kernel indexes the pool as it is, with the layer
a runtime operand. Blocks past a row's length repeat the row's first page (finite data, masked
out) rather than reading pages the row does not hold.

Checked on CPU in Pallas interpret mode against float64 attention and JAX's op
(tests/serving/test_paged_attention_gpu.py), lowered to Triton IR for CUDA there too; run on a
GPU by tests/gpu/test_gpu.py. Shape letters as in jaxrl/models; K page size, W table width.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

NEG_INF = -1e30         # finite: an empty split's max must not make inf - inf in the fold
MIN_DOT = 16            # Triton's tensor-core dots need at least 16 rows and columns
BLOCK_KEYS = 64         # keys a program reads per step of its loop (whole pages, at least 16)
TARGET_PROGRAMS = 264   # about two per SM on an H100 (132) or H200 (132): what splits aim for


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _kernel(layer_ref, length_ref, table_ref, q_ref, kv_ref, o_ref, l_ref, m_ref, *,
            pages_per_block: int, pages_per_split: int):
    g, split = pl.program_id(1), pl.program_id(2)
    rows, head_dim = q_ref.shape
    page = kv_ref.shape[2]
    block = pages_per_block * page
    layer, length = layer_ref[0], length_ref[0]
    held = pl.cdiv(length, page)                        # pages the row holds
    first = split * pages_per_split
    last = jnp.minimum(first + pages_per_split, held)   # this split's pages: [first, last)
    q = q_ref[...]

    def body(i, carry):
        o, m, l = carry
        index = first + i * pages_per_block + jnp.arange(pages_per_block)
        pages = jnp.where(index < held, table_ref[pl.ds(first + i * pages_per_block,
                                                         pages_per_block)], table_ref[0])
        # an 8-bit pool is widened to the queries' dtype here (no-op otherwise)
        k = kv_ref[layer, pages, :, 2 * g, :].reshape(block, head_dim).astype(q.dtype)
        v = kv_ref[layer, pages, :, 2 * g + 1, :].reshape(block, head_dim).astype(q.dtype)
        s = jnp.dot(q, k.T, preferred_element_type=jnp.float32)            # [rows, block]
        position = (first + i * pages_per_block) * page + jnp.arange(block)
        s = jnp.where((position < length)[None, :], s, NEG_INF)
        m_new = jnp.maximum(m, s.max(axis=1))
        p = jnp.exp(s - m_new[:, None])
        alpha = jnp.exp(m - m_new)
        o = alpha[:, None] * o + jnp.dot(p.astype(v.dtype), v,
                                         preferred_element_type=jnp.float32)
        return o, m_new, alpha * l + p.sum(axis=1)

    init = (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows,), NEG_INF, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    o, m, l = jax.lax.fori_loop(0, pl.cdiv(jnp.maximum(last - first, 0), pages_per_block),
                                body, init)
    o_ref[...] = o.astype(o_ref.dtype)
    l_ref[...] = l
    m_ref[...] = m


@dataclasses.dataclass(frozen=True)
class Tuning:
    """How the kernel is cut up and compiled: `splits` parts of each row's table run in
    parallel (None: from `plan`), `block_keys` keys per step of a program's loop, and Triton's
    warps per program and software-pipelining stages."""

    splits: int | None = None
    block_keys: int = BLOCK_KEYS
    num_warps: int = 4
    num_stages: int = 2


def plan(rows: int, kv_heads: int, width: int, page: int, splits: int | None = None,
         block_keys: int = BLOCK_KEYS):
    """(pages per block, pages per split, splits) for a call: blocks of about `block_keys` keys
    (whole pages, at least MIN_DOT keys, no more pages than the table has), and enough splits of
    the table for about TARGET_PROGRAMS programs (one when the batch alone fills the GPU)."""
    per_block = max(min(_pow2(max(block_keys // page, 1)), _pow2(width)), -(-MIN_DOT // page))
    blocks = -(-width // per_block)
    if splits is None:
        splits = max(1, min(blocks, TARGET_PROGRAMS // max(rows * kv_heads, 1)))
    per_split = -(-blocks // splits) * per_block
    return per_block, per_split, -(-width // per_split)


def query_dtype(pool_dtype, q_dtype):
    """The dtype a paged-attention kernel's queries go in: the pool's, or the queries' own over
    an 8-bit pool (the kernels widen its keys and values)."""
    return q_dtype if jnp.dtype(pool_dtype).itemsize == 1 else pool_dtype


@functools.partial(jax.jit, static_argnames=("interpret", "scale", "tuning"))
def paged_decode_attention_gpu(q_BNH, kv_LPKCH, layer, lengths_B, table_BW, *,
                               interpret: bool = False, scale: float | None = None,
                               tuning: Tuning = Tuning()):
    """Attention of one query per row over the row's first lengths_B[b] cached tokens; the
    arguments and result as serving/runner/paged_attention.paged_decode_attention's (lengths >= 1).
    `tuning`: how the work is cut up (Tuning); `interpret`: run the kernel as plain XLA on any
    backend (for checks on CPU; any head_dim and page size there, where Triton needs powers of
    two)."""
    b, n, h = q_BNH.shape
    _, _, page, c, _ = kv_LPKCH.shape
    g = c // 2
    if c % 2 or n % g:
        raise ValueError(f"paged_decode_attention_gpu: {n} query heads do not divide over "
                         f"{g} kv heads (pool heads dim {c} = keys and values)")
    if not interpret and (h != _pow2(h) or page != _pow2(page) or h < MIN_DOT):
        raise ValueError(f"paged_decode_attention_gpu: head_dim {h} and page size {page} must "
                         f"be powers of two (Triton blocks), head_dim at least {MIN_DOT}")
    per_block, per_split, splits = plan(b, g, table_BW.shape[1], page, tuning.splits,
                                        tuning.block_keys)
    r = n // g
    rows = max(MIN_DOT, _pow2(r))
    scale = 1 / math.sqrt(h) if scale is None else scale
    compute = query_dtype(kv_LPKCH.dtype, q_BNH.dtype)
    q_BGRH = (q_BNH.reshape(b, g, r, h).astype(jnp.float32) * scale).astype(compute)
    q_BGRH = jnp.pad(q_BGRH, ((0, 0), (0, 0), (0, rows - r), (0, 0)))
    table = jnp.pad(table_BW.astype(jnp.int32),
                    ((0, 0), (0, splits * per_split - table_BW.shape[1])))
    kernel = functools.partial(_kernel, pages_per_block=per_block, pages_per_split=per_split)
    part = (splits, b, g, rows)
    o, l, m = pl.pallas_call(
        kernel, grid=(b, g, splits),
        in_specs=[pl.BlockSpec((1,), lambda *_: (0,)),
                  pl.BlockSpec((1,), lambda i, j, s: (i,)),
                  pl.BlockSpec((None, table.shape[1]), lambda i, j, s: (i, 0)),
                  pl.BlockSpec((None, None, rows, h), lambda i, j, s: (i, j, 0, 0)),
                  pl.BlockSpec(kv_LPKCH.shape, lambda *_: (0, 0, 0, 0, 0))],
        out_specs=[pl.BlockSpec((None, None, None, rows, h), lambda i, j, s: (s, i, j, 0, 0)),
                   pl.BlockSpec((None, None, None, rows), lambda i, j, s: (s, i, j, 0)),
                   pl.BlockSpec((None, None, None, rows), lambda i, j, s: (s, i, j, 0))],
        out_shape=[jax.ShapeDtypeStruct((*part, h), jnp.float32),
                   jax.ShapeDtypeStruct(part, jnp.float32),
                   jax.ShapeDtypeStruct(part, jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=tuning.num_warps,
                                             num_stages=tuning.num_stages),
        interpret=interpret, name="jaxrl_paged_decode_attention",
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), lengths_B.astype(jnp.int32), table,
      q_BGRH, kv_LPKCH)
    # Fold the splits: each one's output rescaled by exp(its max - the overall max).
    weight = jnp.exp(m - m.max(axis=0))
    out = (o * weight[..., None]).sum(0) / (l * weight).sum(0)[..., None]
    return out[:, :, :r].reshape(b, n, h).astype(q_BNH.dtype)
