"""Causal attention within the segments of packed rows, over a work list of block pairs.

A packed row of T tokens holds several samples (segments) one after another; a query attends
only to the keys of its own segment up to itself. The dense path (layers._attention_xla) scores
every query against every key before the mask throws most of them away: on a long-tail RL
batch (rows of 1,664 tokens holding samples of ~100), most of its attention work is masked.
Here the row is cut into blocks of BLOCK tokens, and only the (query block, key block) pairs
that share a segment are scored: for query block i of row b, the key blocks from the one its
first query's segment starts in up to i. Those pairs, for all rows, form one work list; a loop
runs through it PAIRS at a time, folding each pair into its query block's online softmax
(flash attention). The backward pass runs through the same list (FlashAttention-2's, from the
saved log-sum-exp), so nothing of size [T, T] is kept. A row of short segments costs about
what its segments hold; a row that is one long sample, its causal triangle.

Segments must be as the packers lay them out (`segment_ids` 1, 2, ... contiguous and in order
from position 0, padding 0 only at the end), which is also what the cuDNN path assumes.
Padding queries attend to nothing and get zeros."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

BLOCK = 64      # tokens per block, queries and keys
# Shorter rows stay on the dense path: at 32 rows of one 529-token sample each, blocks took 1.4x
# as long (many small products against its few large ones); at 1,664 tokens 0.55x (a sample a
# row) down to 0.3x (rows of short samples).
MIN_LENGTH = 1024
PAIRS = 8       # block pairs per iteration of the loop (4-32 measured; 8 the best at both ends)

_LOW = float(jnp.finfo(jnp.float32).min)


def usable(length: int) -> bool:
    """Whether rows of `length` tokens are long enough for blocks to pay (MIN_LENGTH)."""
    return length >= MIN_LENGTH


def block_attention(q_BTNH, k_BTGH, v_BTGH, segment_ids_BT, scale: float):
    """Grouped-query attention of each token to the tokens of its own segment up to itself:
    [B, T, N, H], as `layers.attention` with `causal_mask(segment_ids_BT)`, in q's dtype
    (padding queries: zeros)."""
    t = q_BTNH.shape[1]
    q_BTNH, k_BTGH, v_BTGH, segment_ids_BT = map(
        _widen, (q_BTNH, k_BTGH, v_BTGH, segment_ids_BT.astype(jnp.int32)))
    return _attention(q_BTNH, k_BTGH, v_BTGH, segment_ids_BT, scale)[:, :t]


def _widen(x):
    """[B, T, ...] padded to whole blocks along T."""
    pad = -x.shape[1] % BLOCK
    return jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)) if pad else x


def _work_list(segment_ids_BT):
    """(first key block [B*nb], pairs of each query block [B*nb], their cumulative ends)."""
    b, t = segment_ids_BT.shape
    nb = t // BLOCK
    pos_T = jnp.arange(t)
    changed_BT = jnp.concatenate([jnp.ones((b, 1), bool),
                                  segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]], axis=1)
    start_BT = jax.lax.cummax(jnp.where(changed_BT, pos_T, 0), axis=1)  # its segment's start
    first_Bn = start_BT[:, ::BLOCK] // BLOCK
    real_Bn = segment_ids_BT[:, ::BLOCK] > 0        # padding only at the end: a block whose
    count_Bn = jnp.where(real_Bn, jnp.arange(nb) - first_Bn + 1, 0)   # first token is padding
    first_C, count_C = first_Bn.reshape(-1), count_Bn.reshape(-1)     # is padding throughout
    return first_C, count_C, jnp.cumsum(count_C)


def work_items(i, size: int, first_C, count_C, ends_C):
    """Items i*size .. i*size+size-1 of a work list in which cell c holds the blocks first_C[c]
    .. first_C[c] + count_C[c] - 1, cell after cell (ends_C: the cumulative sum of count_C):
    (cell, block, valid). Items past the list's end are the last cell's, on a block in its
    range (or its first), and not valid."""
    item_R = i * size + jnp.arange(size)
    valid_R = item_R < ends_C[-1]
    cell_R = jnp.minimum(jnp.searchsorted(ends_C, item_R, side="right"), ends_C.shape[0] - 1)
    first_R, count_R = first_C[cell_R], count_C[cell_R]
    block_R = first_R + item_R - (ends_C[cell_R] - count_R)
    return cell_R, jnp.clip(block_R, first_R, first_R + jnp.maximum(count_R, 1) - 1), valid_R


def _pairs(i, first_C, count_C, ends_C, nb: int):
    """Pairs i*PAIRS .. +PAIRS of the list: (query cell b*nb+qi, key cell b*nb+kj, valid)."""
    cell_R, kj_R, valid_R = work_items(i, PAIRS, first_C, count_C, ends_C)
    return cell_R, cell_R - cell_R % nb + kj_R, valid_R


def _trips(ends_C):
    return -(-ends_C[-1] // PAIRS)


def _blocks(x, nb: int):
    """[B, T, ...] -> [B * nb, BLOCK, ...]."""
    return x.reshape(x.shape[0] * nb, BLOCK, *x.shape[2:])


def _scores(q_RCGZH, k_RCGH, seg_q_RC, seg_k_RC, qi_R, kj_R, valid_R):
    """Scores [R, C, G, Z, C] of pairs (float32, q already scaled) and their mask."""
    s = jnp.einsum("rcgzh,rdgh->rcgzd", q_RCGZH, k_RCGH)
    pos_q = qi_R[:, None] * BLOCK + jnp.arange(BLOCK)
    pos_k = kj_R[:, None] * BLOCK + jnp.arange(BLOCK)
    mask = ((seg_q_RC[:, :, None] == seg_k_RC[:, None, :]) & (seg_q_RC[:, :, None] > 0)
            & (pos_k[:, None, :] <= pos_q[:, :, None]) & valid_R[:, None, None])
    return s, mask[:, :, None, None, :]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q_BTNH, k_BTGH, v_BTGH, seg_BT, scale):
    return _forward(q_BTNH, k_BTGH, v_BTGH, seg_BT, scale)[0]


def _forward(q_BTNH, k_BTGH, v_BTGH, seg_BT, scale):
    b, t, n, h = q_BTNH.shape
    g, nb = k_BTGH.shape[2], t // BLOCK
    z = n // g
    q_CCGZH = _blocks(q_BTNH.reshape(b, t, g, z, h).astype(jnp.float32) * scale, nb)
    k_CCGH = _blocks(k_BTGH.astype(jnp.float32), nb)
    v_CCGH = _blocks(v_BTGH.astype(jnp.float32), nb)
    seg_CC = _blocks(seg_BT, nb)
    first_C, count_C, ends_C = _work_list(seg_BT)
    cells = b * nb

    def step(i, carry):
        m, l, acc = carry           # one cell more than the blocks: the one no pair owns
        qc_R, kc_R, valid_R = _pairs(i, first_C, count_C, ends_C, nb)
        s, mask = _scores(q_CCGZH[qc_R], k_CCGH[kc_R], seg_CC[qc_R], seg_CC[kc_R],
                          qc_R % nb, kc_R % nb, valid_R)
        s = jnp.where(mask, s, _LOW)
        m_R = s.max(-1)
        p = jnp.where(mask, jnp.exp(s - m_R[..., None]), 0.0)
        pv = jnp.einsum("rcgzd,rdgh->rcgzh", p, v_CCGH[kc_R])
        # The list is in query-block order, so the iteration's pairs of one query block are
        # neighbours: fold them into groups, then update only the groups' blocks (rescaling
        # every block's accumulator each iteration would cost more than the pairs).
        group_R = jnp.cumsum(jnp.concatenate([jnp.ones(1, bool), qc_R[1:] != qc_R[:-1]])) - 1
        cell_G = jnp.full(PAIRS, cells).at[group_R].set(qc_R)
        m_old = m[cell_G]
        m_new = jnp.maximum(m_old, jnp.full_like(m_old, _LOW).at[group_R].max(m_R))
        c_G, c_R = jnp.exp(m_old - m_new), jnp.exp(m_R - m_new[group_R])
        l_G = (l[cell_G] * c_G).at[group_R].add(p.sum(-1) * c_R)
        acc_G = (acc[cell_G] * c_G[..., None]).at[group_R].add(pv * c_R[..., None])
        return m.at[cell_G].set(m_new), l.at[cell_G].set(l_G), acc.at[cell_G].set(acc_G)

    shape = (cells + 1, BLOCK, g, z)
    m, l, acc = jax.lax.fori_loop(0, _trips(ends_C), step, (
        jnp.full(shape, _LOW), jnp.zeros(shape), jnp.zeros((*shape, h))))
    m, l, acc = m[:cells], l[:cells], acc[:cells]
    seen = l > 0                                     # padding queries see no key
    out = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0)
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), 0.0)
    out_BTNH = out.reshape(b, t, n, h).astype(q_BTNH.dtype)
    return out_BTNH, (q_BTNH, k_BTGH, v_BTGH, seg_BT, out_BTNH, lse)


def _backward(scale, residuals, dout_BTNH):
    q_BTNH, k_BTGH, v_BTGH, seg_BT, out_BTNH, lse = residuals
    b, t, n, h = q_BTNH.shape
    g, nb = k_BTGH.shape[2], t // BLOCK
    z = n // g
    f32 = lambda x: x.astype(jnp.float32)
    q_CCGZH = _blocks(f32(q_BTNH).reshape(b, t, g, z, h) * scale, nb)
    k_CCGH, v_CCGH = _blocks(f32(k_BTGH), nb), _blocks(f32(v_BTGH), nb)
    do_CCGZH = _blocks(f32(dout_BTNH).reshape(b, t, g, z, h), nb)
    delta = (do_CCGZH * _blocks(f32(out_BTNH).reshape(b, t, g, z, h), nb)).sum(-1)
    seg_CC = _blocks(seg_BT, nb)
    first_C, count_C, ends_C = _work_list(seg_BT)

    def step(i, carry):
        dq, dk, dv = carry
        qc_R, kc_R, valid_R = _pairs(i, first_C, count_C, ends_C, nb)
        k_R, v_R, do_R = k_CCGH[kc_R], v_CCGH[kc_R], do_CCGZH[qc_R]
        s, mask = _scores(q_CCGZH[qc_R], k_R, seg_CC[qc_R], seg_CC[kc_R], qc_R % nb,
                          kc_R % nb, valid_R)
        p = jnp.where(mask, jnp.exp(s - lse[qc_R][..., None]), 0.0)
        dp = jnp.einsum("rcgzh,rdgh->rcgzd", do_R, v_R)
        ds = p * (dp - delta[qc_R][..., None])
        return (dq.at[qc_R].add(jnp.einsum("rcgzd,rdgh->rcgzh", ds, k_R)),
                dk.at[kc_R].add(jnp.einsum("rcgzd,rcgzh->rdgh", ds, q_CCGZH[qc_R])),
                dv.at[kc_R].add(jnp.einsum("rcgzd,rcgzh->rdgh", p, do_R)))

    dq, dk, dv = jax.lax.fori_loop(0, _trips(ends_C), step, (
        jnp.zeros_like(q_CCGZH), jnp.zeros_like(k_CCGH), jnp.zeros_like(v_CCGH)))
    return ((dq * scale).reshape(b, t, n, h).astype(q_BTNH.dtype),
            dk.reshape(b, t, g, h).astype(k_BTGH.dtype),
            dv.reshape(b, t, g, h).astype(v_BTGH.dtype), None)


_attention.defvjp(_forward, _backward)
