"""Context parallelism: causal attention over rows whose tokens are split across the `context`
mesh axis.

Layout (load-balanced, "zig-zag", as in Megatron's and MaxText's context parallelism): a row of
T tokens is cut into 2c chunks of s = T / 2c; device i of the c on the axis holds chunks i and
2c-1-i, so every device holds as much of the causal triangle as any other. The train step puts
a batch in this order once (sharding/context.py, `stored_index`); every token-wise layer is
indifferent to order, and attention masks by each token's original index, not where it sits.

Attention all-gathers K and V over the axis (a layer's K/V are G/N of its queries: 1/4 for
Llama 3's GQA) and each device attends its 2s queries to them in c blocks, one per device's
chunk pair, skipping what the causal mask empties: with its own pair, both chunks (the
diagonal); with a pair from a device j < i, only chunk j (chunk 2c-1-j lies after both of its
queries' chunks); from j > i, only its later chunk 2c-1-i attends, to both. Each device scores
(2c + 2) s^2 pairs instead of 4c s^2. The blocks' outputs are combined by their log-sum-exps
(flash attention's merge), and each block is rematerialised, so the backward keeps the blocks'
outputs, not their scores.

Shape letters as in layers.py; b rows on this device, s tokens a chunk, C the context size.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxrl.models import splash

AXIS = "context"
_LOW = float(jnp.finfo(jnp.float32).min)


def context_size(mesh=None) -> int:
    """Size of the `context` axis of `mesh` (default: the abstract mesh in context), 1 without."""
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    if mesh.empty or AXIS not in mesh.axis_names:
        return 1
    return mesh.shape[AXIS]


def check_length(length: int, context: int, key: str = "the sequence length") -> None:
    """ValueError unless rows of `length` split into 2 * context equal chunks."""
    if context > 1 and length % (2 * context):
        raise ValueError(f"{key}={length} must be a multiple of 2 x mesh.context = "
                         f"{2 * context} (each device holds two equal chunks of every row)")


def stored_index(length: int, context: int) -> np.ndarray:
    """int32 [T]: the original index of each position of a row in the load-balanced order
    (device i's part, chunks i and 2C-1-i, is positions i*2s .. (i+1)*2s - 1)."""
    check_length(length, context)
    s = length // (2 * context)
    return np.concatenate([np.arange(c * s, (c + 1) * s)
                           for c in stored_chunks(context)]).astype(np.int32)


def stored_chunks(context: int) -> tuple[int, ...]:
    """The original chunk of each stored chunk of a row (2 x context chunks)."""
    return tuple(c for i in range(context) for c in (i, 2 * context - 1 - i))


def attention(q_BTNH, k_BTGH, v_BTGH, segment_ids_BT, *, scale: float,
              softcap: float | None = None, impl: str = "xla"):
    """Causal grouped-query attention (within segments when `segment_ids_BT` is given) of rows
    stored in the load-balanced order and split over the `context` axis of the mesh in
    context: [B, T, N, H] in q's dtype, equal to `layers.attention` on the rows in their
    original order. Rows split over the batch axes and heads over `tensor` as the splash path
    splits them. `impl`: xla (the blocks below) or splash (the Pallas kernel, its block tables
    split by query shard: jaxrl/models/splash.py)."""
    mesh = jax.sharding.get_abstract_mesh()
    b, t, n, h = q_BTNH.shape
    g = k_BTGH.shape[2]
    c = context_size(mesh)
    check_length(t, c)
    if impl == "splash":
        return splash.context_attention(q_BTNH, k_BTGH, v_BTGH, segment_ids_BT, scale, AXIS)
    if impl != "xla":
        raise ValueError(f"context parallelism runs model.attention=xla or splash, not {impl!r}")
    rows, heads = splash.mesh_axes(mesh, g)
    seg_BT = (jnp.ones((b, t), jnp.int32) if segment_ids_BT is None
              else segment_ids_BT.astype(jnp.int32))
    local = functools.partial(_local_attention, length=t, context=c, scale=scale,
                              softcap=softcap)
    spec = P(rows, AXIS, heads)
    return jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec, P(rows, AXIS)),
                         out_specs=spec, check_vma=False)(q_BTNH, k_BTGH, v_BTGH, seg_BT)


def _local_attention(q_b2sNH, k_b2sGH, v_b2sGH, seg_b2s, *, length: int, context: int,
                     scale: float, softcap: float | None):
    """One device's queries (its two chunks) against every device's keys, block by block."""
    c, s = context, length // (2 * context)
    i = jax.lax.axis_index(AXIS)
    b, _, n, h = q_b2sNH.shape
    g = k_b2sGH.shape[2]
    q_b2sGRH = q_b2sNH.reshape(b, 2 * s, g, n // g, h)
    gather = functools.partial(jax.lax.all_gather, axis_name=AXIS, axis=1, tiled=True)
    k_bTGH, v_bTGH, seg_bT = gather(k_b2sGH), gather(v_b2sGH), gather(seg_b2s)
    index_T = jnp.asarray(stored_index(length, c))
    q_index_2s = jnp.concatenate([i * s + jnp.arange(s), (2 * c - 1 - i) * s + jnp.arange(s)])
    block = jax.checkpoint(functools.partial(_block, scale=scale, softcap=softcap))

    outs, lses = [], []
    for j in range(c):          # device j's chunk pair: keys j*2s .. (j+1)*2s - 1
        pair = slice(j * 2 * s, (j + 1) * 2 * s)
        k_b2sGH_j, v_j, seg_j, idx_j = (k_bTGH[:, pair], v_bTGH[:, pair], seg_bT[:, pair],
                                        index_T[pair])

        def diagonal():
            return block(q_b2sGRH, k_b2sGH_j, v_j, seg_b2s, seg_j, q_index_2s, idx_j)

        def earlier():           # j < i: both query chunks, key chunk j only
            return block(q_b2sGRH, k_b2sGH_j[:, :s], v_j[:, :s], seg_b2s, seg_j[:, :s],
                         q_index_2s, idx_j[:s])

        def later():             # j > i: query chunk 2C-1-i only, both key chunks
            out, lse = block(q_b2sGRH[:, s:], k_b2sGH_j, v_j, seg_b2s[:, s:], seg_j,
                             q_index_2s[s:], idx_j)
            return (jnp.concatenate([jnp.zeros_like(out), out], axis=1),
                    jnp.concatenate([jnp.full_like(lse, -jnp.inf), lse], axis=1))

        out, lse = jax.lax.switch(jnp.sign(j - i) + 1, (earlier, diagonal, later))
        outs.append(out)
        lses.append(lse)
    lse_C = jnp.stack(lses)                          # [C, b, 2s, G, R]
    weights_C = jnp.exp(lse_C - jax.nn.logsumexp(lse_C, axis=0))
    out = jnp.sum(weights_C[..., None] * jnp.stack(outs), axis=0)
    return out.reshape(b, 2 * s, n, h).astype(q_b2sNH.dtype)


def _block(q_bqGRH, k_bkGH, v_bkGH, seg_q_bq, seg_k_bk, index_q, index_k, *, scale: float,
           softcap: float | None):
    """Attention of queries to one block of keys: (output [b, q, G, R, H] float32, normalised
    within the block; its log-sum-exp [b, q, G, R], -inf where the block holds no key the
    query may see)."""
    scores = jnp.einsum("bqgrh,bkgh->bgrqk", q_bqGRH, k_bkGH,
                        preferred_element_type=jnp.float32) * scale
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    mask_bqk = ((index_q[:, None] >= index_k[None, :])[None]
                & (seg_q_bq[:, :, None] == seg_k_bk[:, None, :]))
    mask = mask_bqk[:, None, None]
    scores = jnp.where(mask, scores, _LOW)
    m = jnp.max(scores, axis=-1, keepdims=True)
    p = jnp.where(mask, jnp.exp(scores - m), 0.0)
    l = jnp.sum(p, axis=-1)
    seen = l > 0
    out = jnp.einsum("bgrqk,bkgh->bqgrh", p / jnp.where(seen, l, 1.0)[..., None],
                     v_bkGH.astype(jnp.float32))
    lse = jnp.where(seen, m[..., 0] + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)
    return out, jnp.moveaxis(lse, 3, 1)
