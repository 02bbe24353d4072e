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
outputs, not their scores. Ring attention (`model.context_attention=ring`, `_ring_local`) runs
the same blocks with the pairs passed round the axis instead of gathered, and a backward of its
own. With splash (jaxrl/models/splash.py) the kernel does the skipping itself.

Shape letters as in layers.py; b rows on this device, s tokens a chunk, C the context size.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

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
    return np.concatenate([_pair_index(i, s, context, np) for i in range(context)])


def attention(q_BTNH, k_BTGH, v_BTGH, segment_ids_BT, *, scale: float,
              softcap: float | None = None, impl: str = "xla", method: str = "all-gather"):
    """Causal grouped-query attention (within segments when `segment_ids_BT` is given) of rows
    stored in the load-balanced order and split over the `context` axis of the mesh in
    context: [B, T, N, H] in q's dtype, equal to `layers.attention` on the rows in their
    original order. Rows split over the batch axes and heads over `tensor` as the splash path
    splits them. `impl`: xla (the blocks below) or splash (the Pallas kernel, its block tables
    split by query shard: jaxrl/models/splash.py). `method` (xla): all-gather (every device's
    keys and values gathered) or ring (passed round, `_ring_local`)."""
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
    if method == "ring":
        local = functools.partial(_ring_local, length=t, context=c, scale=scale,
                                  softcap=softcap)
    elif method == "all-gather":
        local = functools.partial(_local_attention, length=t, context=c, scale=scale,
                                  softcap=softcap)
    else:
        raise ValueError(f"context attention method={method!r} is not 'all-gather' or 'ring'")
    spec = P(rows, AXIS, heads)
    return jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec, P(rows, AXIS)),
                         out_specs=spec, check_vma=False)(q_BTNH, k_BTGH, v_BTGH, seg_BT)


class Queries(NamedTuple):
    """A block's queries [b, q, G, R, H] with their segment ids [b, q] and token indices [q]."""

    x: jax.Array
    seg: jax.Array
    index: jax.Array

    def tail(self, s: int) -> "Queries":
        """The second chunk of a pair (rows s onwards)."""
        return Queries(self.x[:, s:], self.seg[:, s:], self.index[s:])


class Keys(NamedTuple):
    """A block's keys and values [b, k, G, H] with their segment ids [b, k] and token indices
    [k]."""

    k: jax.Array
    v: jax.Array
    seg: jax.Array
    index: jax.Array

    def head(self, s: int) -> "Keys":
        """The first chunk of a pair (keys 0 .. s-1)."""
        return Keys(self.k[:, :s], self.v[:, :s], self.seg[:, :s], self.index[:s])


def _pair_index(j, s: int, context: int, xp=jnp):
    """Original indices [2s] of the tokens device j holds (chunks j and 2C-1-j; j may be
    traced), int32."""
    return xp.concatenate([j * s + xp.arange(s, dtype=xp.int32),
                           (2 * context - 1 - j) * s + xp.arange(s, dtype=xp.int32)])


def _case(i, j):
    """Which part of device j's chunk pair device i's queries see: 0 (j < i: both query chunks,
    key chunk j only; chunk 2C-1-j lies after both), 1 (j = i: all, the diagonal), 2 (j > i:
    query chunk 2C-1-i only, both key chunks)."""
    return jnp.sign(j - i) + 1


def _pair_forward(block, queries: Queries, pair: Keys, case, s: int):
    """(output, log-sum-exp) of the queries against one device's chunk pair, for all 2s query
    rows (-inf and zeros where a case leaves rows out)."""

    def earlier():
        return block(queries, pair.head(s))

    def diagonal():
        return block(queries, pair)

    def later():
        out, lse = block(queries.tail(s), pair)
        return (jnp.concatenate([jnp.zeros_like(out), out], axis=1),
                jnp.concatenate([jnp.full_like(lse, -jnp.inf), lse], axis=1))

    return jax.lax.switch(case, (earlier, diagonal, later))


def _local_attention(q_b2sNH, k_b2sGH, v_b2sGH, seg_b2s, *, length: int, context: int,
                     scale: float, softcap: float | None):
    """One device's queries (its two chunks) against every device's keys, gathered, block by
    block."""
    c, s = context, length // (2 * context)
    i = jax.lax.axis_index(AXIS)
    b, _, n, h = q_b2sNH.shape
    g = k_b2sGH.shape[2]
    q_b2sGRH = q_b2sNH.reshape(b, 2 * s, g, n // g, h)
    gather = functools.partial(jax.lax.all_gather, axis_name=AXIS, axis=1, tiled=True)
    k_bTGH, v_bTGH, seg_bT = gather(k_b2sGH), gather(v_b2sGH), gather(seg_b2s)
    queries = Queries(q_b2sGRH, seg_b2s, _pair_index(i, s, c))
    block = jax.checkpoint(functools.partial(_block, scale=scale, softcap=softcap))
    outs, lses = [], []
    for j in range(c):          # device j's chunk pair: keys j*2s .. (j+1)*2s - 1
        at = slice(j * 2 * s, (j + 1) * 2 * s)
        pair = Keys(k_bTGH[:, at], v_bTGH[:, at], seg_bT[:, at], _pair_index(j, s, c))
        out, lse = _pair_forward(block, queries, pair, _case(i, j), s)
        outs.append(out)
        lses.append(lse)
    lse_C = jnp.stack(lses)                          # [C, b, 2s, G, R]
    weights_C = jnp.exp(lse_C - jax.nn.logsumexp(lse_C, axis=0))
    out = jnp.sum(weights_C[..., None] * jnp.stack(outs), axis=0)
    return out.reshape(b, 2 * s, n, h).astype(q_b2sNH.dtype)


def _mask(queries: Queries, keys: Keys):
    """[b, 1, 1, q, k]: which keys each query sees (causal, within its segment)."""
    mask_bqk = ((queries.index[:, None] >= keys.index[None, :])[None]
                & (queries.seg[:, :, None] == keys.seg[:, None, :]))
    return mask_bqk[:, None, None]


def _block(queries: Queries, keys: Keys, *, scale: float, softcap: float | None):
    """Attention of queries to one block of keys: (output [b, q, G, R, H] float32, normalised
    within the block; its log-sum-exp [b, q, G, R], -inf where the block holds no key the
    query may see)."""
    scores = jnp.einsum("bqgrh,bkgh->bgrqk", queries.x, keys.k,
                        preferred_element_type=jnp.float32) * scale
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    mask = _mask(queries, keys)
    scores = jnp.where(mask, scores, _LOW)
    m = jnp.max(scores, axis=-1, keepdims=True)
    p = jnp.where(mask, jnp.exp(scores - m), 0.0)
    l = jnp.sum(p, axis=-1)
    seen = l > 0
    out = jnp.einsum("bgrqk,bkgh->bqgrh", p / jnp.where(seen, l, 1.0)[..., None],
                     keys.v.astype(jnp.float32))
    lse = jnp.where(seen, m[..., 0] + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)
    return out, jnp.moveaxis(lse, 3, 1)


def _ring_local(q_b2sNH, k_b2sGH, v_b2sGH, seg_b2s, length, context, scale, softcap):
    """`_local_attention` by ring attention (Liu et al., "Ring Attention with Blockwise
    Transformers"; the zig-zag balance of its load-balanced variants): instead of gathering
    every device's keys and values, each device's pair moves one device on per step, C steps,
    so a device holds two pairs at a time. The backward (a custom VJP, flash attention's from
    the saved log-sum-exp) sends each pair round again with its gradients, which arrive home
    after the C-th step: what is kept from forward to backward is the device's own q, k, v,
    output and log-sum-exp, not the C pairs autodiff would keep."""
    return _ring_forward(q_b2sNH, k_b2sGH, v_b2sGH, seg_b2s, length, context, scale,
                         softcap)[0]


_ring_local = jax.custom_vjp(_ring_local, nondiff_argnums=(4, 5, 6, 7))


def _next_device(tree, context: int):
    return jax.lax.ppermute(tree, AXIS, [(d, (d + 1) % context) for d in range(context)])


def _ring_forward(q_b2sNH, k_b2sGH, v_b2sGH, seg_b2s, length, context, scale, softcap):
    c, s = context, length // (2 * context)
    i = jax.lax.axis_index(AXIS)
    b, _, n, h = q_b2sNH.shape
    g = k_b2sGH.shape[2]
    q_b2sGRH = q_b2sNH.reshape(b, 2 * s, g, n // g, h)
    block = functools.partial(_block, scale=scale, softcap=softcap)
    queries = Queries(q_b2sGRH, seg_b2s, _pair_index(i, s, c))
    k_j, v_j, seg_j = k_b2sGH, v_b2sGH, seg_b2s
    for r in range(c):                  # step r: device i holds device (i - r)'s pair
        j = (i - r) % c
        out_r, lse_r = _pair_forward(block, queries, Keys(k_j, v_j, seg_j, _pair_index(j, s, c)),
                                     _case(i, j), s)
        if r == 0:                      # the diagonal: every query sees at least itself
            out, lse = out_r, lse_r
        else:
            new = jnp.logaddexp(lse, lse_r)
            out = (out * jnp.exp(lse - new)[..., None]
                   + out_r * jnp.exp(lse_r - new)[..., None])
            lse = new
        if r < c - 1:
            k_j, v_j, seg_j = _next_device((k_j, v_j, seg_j), c)
    result = out.reshape(b, 2 * s, n, h).astype(q_b2sNH.dtype)
    return result, (q_b2sNH, k_b2sGH, v_b2sGH, seg_b2s, out, lse)


def _ring_backward(length, context, scale, softcap, residuals, dout_b2sNH):
    q_b2sNH, k_b2sGH, v_b2sGH, seg_b2s, out, lse = residuals
    c, s = context, length // (2 * context)
    i = jax.lax.axis_index(AXIS)
    b, _, n, h = q_b2sNH.shape
    g = k_b2sGH.shape[2]
    q_b2sGRH = q_b2sNH.reshape(b, 2 * s, g, n // g, h)
    dout = dout_b2sNH.reshape(b, 2 * s, g, n // g, h).astype(jnp.float32)
    delta = jnp.sum(dout * out, axis=-1)
    grads = functools.partial(_block_grads, scale=scale, softcap=softcap)
    queries = Queries(q_b2sGRH, seg_b2s, _pair_index(i, s, c))
    dq = jnp.zeros(q_b2sGRH.shape, jnp.float32)
    k_j, v_j, seg_j = k_b2sGH, v_b2sGH, seg_b2s
    dk_j = dv_j = jnp.zeros(k_b2sGH.shape, jnp.float32)
    for r in range(c):
        pair = Keys(k_j, v_j, seg_j, _pair_index((i - r) % c, s, c))

        def earlier():
            dq_, dk, dv = grads(queries, pair.head(s), lse, dout, delta)
            pad = ((0, 0), (0, s), (0, 0), (0, 0))
            return dq_, jnp.pad(dk, pad), jnp.pad(dv, pad)

        def diagonal():
            return grads(queries, pair, lse, dout, delta)

        def later():
            dq_, dk, dv = grads(queries.tail(s), pair, lse[:, s:], dout[:, s:], delta[:, s:])
            return jnp.concatenate([jnp.zeros_like(dq_), dq_], axis=1), dk, dv

        dq_r, dk_r, dv_r = jax.lax.switch(_case(i, (i - r) % c), (earlier, diagonal, later))
        dq, dk_j, dv_j = dq + dq_r, dk_j + dk_r, dv_j + dv_r
        if r < c - 1:
            k_j, v_j, seg_j, dk_j, dv_j = _next_device((k_j, v_j, seg_j, dk_j, dv_j), c)
    dk, dv = _next_device((dk_j, dv_j), c)          # each pair's gradients, home
    return (dq.reshape(q_b2sNH.shape).astype(q_b2sNH.dtype), dk.astype(k_b2sGH.dtype),
            dv.astype(v_b2sGH.dtype), None)


_ring_local.defvjp(_ring_forward, _ring_backward)


def _block_grads(queries: Queries, keys: Keys, lse_bqGR, dout_bqGRH, delta_bqGR, *,
                 scale: float, softcap: float | None):
    """Gradients (q, k, v; float32) of one block's share of the attention, from the
    attention's final log-sum-exp and output (`delta` = sum(dout * out))."""
    q_bqGRH, k_bkGH = queries.x, keys.k
    raw = jnp.einsum("bqgrh,bkgh->bgrqk", q_bqGRH, k_bkGH,
                     preferred_element_type=jnp.float32) * scale
    capped = None if softcap is None else jnp.tanh(raw / softcap)
    scores = raw if softcap is None else softcap * capped
    mask = _mask(queries, keys)
    p = jnp.where(mask, jnp.exp(scores - jnp.moveaxis(lse_bqGR, 1, 3)[..., None]), 0.0)
    dv = jnp.einsum("bgrqk,bqgrh->bkgh", p, dout_bqGRH)
    dp = jnp.einsum("bqgrh,bkgh->bgrqk", dout_bqGRH, keys.v.astype(jnp.float32))
    ds = p * (dp - jnp.moveaxis(delta_bqGR, 1, 3)[..., None])
    if softcap is not None:
        ds = ds * (1.0 - capped * capped)
    ds = ds * scale
    dq = jnp.einsum("bgrqk,bkgh->bqgrh", ds, k_bkGH.astype(jnp.float32))
    dk = jnp.einsum("bgrqk,bqgrh->bkgh", ds, q_bqGRH.astype(jnp.float32))
    return dq, dk, dv
