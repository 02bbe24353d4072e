"""A Pallas decode-attention kernel that reads the paged KV pool in place
(serving/runner/paged_kv.py's layout, [L, P, K, 2G, H]): one query per row, each row's pages
streamed through the page table up to its length, online softmax in VMEM.

Grid (row, page): row b's step j DMAs pool page table[b, j] of the layer into VMEM; pages at
or past the row's length repeat the last page's block index (Pallas skips a copy whose block
index did not change) and do no work, so a step moves the pages the batch holds, not the
table's width. The whole pool and the layer index go in (the layer is a scalar-prefetch
operand): slicing one layer out of the pool before the call would copy it whole every step.

Written for the TPU (Mosaic) and checked on CPU against the XLA reference in Pallas interpret
mode (tests/serving/test_paged_attention.py); compiled for TPU slices ahead of time in
tests/sharding/test_tpu_aot.py. Shape letters as in jaxrl/models; K page size, W table width.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

NEG_INF = -1e30     # finite: a row's first page always holds a key, so no row is all masked


def _kernel(layer_ref, lengths_ref, table_ref, q_ref, kv_ref, o_ref, m_ref, l_ref, acc_ref, *,
            groups: int, page: int, scale: float):
    del layer_ref, table_ref                # used by the index maps only
    b, j = pl.program_id(0), pl.program_id(1)
    rep = q_ref.shape[0] // groups          # query heads per kv head
    length = lengths_ref[b]

    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, NEG_INF, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(j * page < length)
    def _page():
        for g in range(groups):
            rows = pl.ds(g * rep, rep)
            q = q_ref[rows, :].astype(jnp.float32)
            k = kv_ref[:, 2 * g, :].astype(jnp.float32)
            v = kv_ref[:, 2 * g + 1, :].astype(jnp.float32)
            s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                    preferred_element_type=jnp.float32) * scale
            position = j * page + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
            s = jnp.where(position < length, s, NEG_INF)
            m_prev, l_prev = m_ref[rows, :], l_ref[rows, :]
            m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
            p = jnp.exp(s - m_new)
            alpha = jnp.exp(m_prev - m_new)
            l_ref[rows, :] = alpha * l_prev + p.sum(axis=1, keepdims=True)
            acc_ref[rows, :] = alpha * acc_ref[rows, :] + jax.lax.dot_general(
                p, v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
            m_ref[rows, :] = m_new

    @pl.when(j == pl.num_programs(1) - 1)
    def _out():
        o_ref[...] = (acc_ref[...] / l_ref[...]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret", "scale"))
def paged_decode_attention(q_BNH, kv_LPKCH, layer, lengths_B, table_BW, *, interpret=False,
                           scale: float | None = None):
    """Attention of one query per row over the row's first lengths_B[b] cached tokens.

    q_BNH: the rows' queries (N query heads, G = C / 2 kv heads, N a multiple of G);
    kv_LPKCH: the whole pool (keys at even, values at odd heads of C = 2G); layer: int32 scalar;
    lengths_B: int32, each >= 1 and <= W * K; table_BW: int32 pool pages of each row.
    Returns [B, N, H] in q's dtype. `scale` multiplies q.k (default 1/sqrt(H)). `interpret`: False
    compiles with Mosaic (TPU); True runs the kernel as plain XLA on any backend (fast enough for an
    engine on CPU); a `pltpu.InterpretParams()` runs it in Pallas's TPU interpreter, which also
    simulates the DMAs into VMEM and reads of memory never written (slow: for tests)."""
    b, n, h = q_BNH.shape
    _, _, page, c, _ = kv_LPKCH.shape
    w = table_BW.shape[1]
    if c % 2 or n % (c // 2):
        raise ValueError(f"paged_decode_attention: {n} query heads do not divide over "
                         f"{c // 2} kv heads (pool heads dim {c} = keys and values)")

    def kv_block(b, j, layer_ref, lengths_ref, table_ref):
        last = jnp.maximum(pl.cdiv(lengths_ref[b], page) - 1, 0)
        return layer_ref[0], table_ref[b, jnp.minimum(j, last)], 0, 0, 0

    def row_block(b, j, *_):
        return b, 0, 0

    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(b, w),
        in_specs=[pl.BlockSpec((None, n, h), row_block),
                  pl.BlockSpec((None, None, page, c, h), kv_block)],
        out_specs=pl.BlockSpec((None, n, h), row_block),
        scratch_shapes=[pltpu.VMEM((n, 1), jnp.float32), pltpu.VMEM((n, 1), jnp.float32),
                        pltpu.VMEM((n, h), jnp.float32)])
    kernel = functools.partial(_kernel, groups=c // 2, page=page, scale=scale or 1 / math.sqrt(h))
    return pl.pallas_call(
        kernel, grid_spec=spec, out_shape=jax.ShapeDtypeStruct((b, n, h), q_BNH.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), lengths_B.astype(jnp.int32),
      table_BW.astype(jnp.int32), q_BNH, kv_LPKCH)
