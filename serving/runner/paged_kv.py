"""The paged KV cache on device: one pool of fixed-size pages per layer, read and written through
per-row page tables (vLLM's PagedAttention layout, as in JetStream's and tpu-inference's paged
attention).

    pool kv : [L, P, page, 2G, H]    P pages of `page` tokens; keys at even and values at odd
                                     heads (kv head g: keys 2g, values 2g+1); page 0 is the null
                                     page
    table   : int32 [B, W]           row b's logical page i lives in pool page table[b, i]

Keys and values share one pool, interleaved per head: the layout of the Pallas TPU ragged paged
attention kernel, so that it reads the pool in place, and one scatter writes both.
Position p of row b is slot p % page of pool page table[b, p // page]. Writes of padding tokens,
of rows with no page there (table entry 0) and of positions past the table's W pages all land
in the null page, which no row ever reads as its own. Attention reads only the W pages of the
table it is given, so the caller sizes W to the longest row it holds (rounded up to a bucket):
a decode step costs what the batch holds, not what the longest possible sequence could.

Attention implementations (`impl`):
- reference: gather the row's pages and attend with XLA; runs everywhere.
- loop: decode steps and prefill chunks read each row's own blocks of pages, up to the last
  block its queries see, in a loop over a work list of (row, block) pairs with an online
  softmax: a call costs the tokens its rows hold, and one program serves every table width.
- native: the same reading of each row's own pages, in a C++ kernel called through XLA's FFI
  (serving/runner/native): each key and value read once from the pool, no copy; CPU only, the CPU
  default where a C++ compiler is present (serving/runner/engine.py), `loop` otherwise.
- pallas: decode steps (one token per row) through serving/runner/paged_attention.py, a Pallas kernel
  that streams each row's pages from the pool up to its length; under a mesh it runs in
  `shard_map` over the kv-head axis. Prefill chunks (compute-bound) keep the reference path.
  Compiled by Mosaic on TPU; elsewhere it runs in Pallas's TPU interpreter (`interpret`), which
  is how it is checked against the reference on CPU, and is far too slow to serve with.
- triton: the same for GPUs, through serving/runner/paged_attention_gpu.py, a Pallas kernel lowered by
  Triton (flash decoding: each row's table split over programs); off GPU it runs as plain XLA
  (`interpret`), which is how it is checked on CPU.

Shape letters as in jaxrl/models; P pool pages, W table width (pages per row), K page size.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from jaxrl.models import layers as ops
from jaxrl.models.block_attention import work_items
from jaxrl.models.kv_cache import scatter_set
from serving.runner import native
from serving.runner.paged_attention import paged_decode_attention
from serving.runner.paged_attention_gpu import paged_decode_attention_gpu, query_dtype

NULL_PAGE = 0
_log = logging.getLogger(__name__)
IMPLEMENTATIONS = ("reference", "loop", "native", "pallas", "triton")
KERNELS = {"pallas": paged_decode_attention, "triton": paged_decode_attention_gpu}
KERNEL_PLATFORMS = {"pallas": "tpu", "triton": "gpu"}    # where each kernel compiles
# EngineConfig.kv_cache_dtype: the pool's element type (None: the engine's dtype).
KV_CACHE_DTYPES = {"auto": None, "fp8": jnp.float8_e4m3fn}
# Keys the loop implementation reads per iteration (decode steps and prefill chunks).
LOOP_TOKENS = 32
# The loop's products are elementwise for at most this many queries per kv head and call row (t x
# heads per kv head), batched dots above. Four layers' attention (4 heads, 2 kv heads, 64 wide),
# dots against elementwise: 128 rows of one query holding 512 tokens 108 -> 73 ms; holding 256,
# 2 queries a row 66 -> 45 ms, 4: 50 -> 53 ms; 64 rows of 8 queries 32 -> 58 ms.
ELEMENTWISE_QUERIES = 4


def _static(default=None):
    return dataclasses.field(default=default, metadata={"static": True})


def choose_attention(asked: str, platform: str) -> str:
    """The paged attention an engine on `platform` runs for `asked` (EngineConfig.attention).
    The Pallas kernels run where they were written for, and on CPU (as plain XLA) to check them."""
    home = KERNEL_PLATFORMS.get(asked)
    if home is not None and platform not in (home, "cpu"):
        other = [k for k, p in KERNEL_PLATFORMS.items() if p == platform] + ["reference"]
        raise ValueError(f"attention='{asked}' is a {home.upper()} kernel; on {platform} "
                         f"use " + " or ".join(f"attention='{k}'" for k in other))
    if asked == "native" and platform != "cpu":
        raise ValueError(f"attention='native' is a CPU kernel; on {platform} use "
                         f"attention='reference'")
    if asked in ("auto", "native") and platform == "cpu":
        why = native.available()
        if why is None:
            return "native"
        if asked == "native":
            raise ValueError(f"attention='native' cannot run here: {why}")
        _log.warning("paged attention: the XLA loop, not the native kernel (%s)", why)
        return "loop"
    return "reference" if asked == "auto" else asked


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedKV:
    """The pool and the page tables of the rows one call runs; satisfies the KV cache protocol
    of jaxrl.models.kv_cache."""

    kv: jax.Array       # [L, P, K, 2G, H]
    table: jax.Array    # int32 [B, W]
    impl: str = _static("reference")
    mesh: Mesh | None = _static()          # a kernel under a mesh: the pool's mesh ...
    head_axis: str | None = _static()      # ... and the axis its kv heads are sharded over
    interpret: bool = _static(False)       # a kernel off its platform: run as plain XLA

    @property
    def page_size(self) -> int:
        return self.kv.shape[2]

    def slots(self, positions_BT, valid_BT=None):
        """(pool page, offset in the page) of each position; the null page where a position has
        no page of its own."""
        w = self.table.shape[1]
        index_BT = positions_BT // self.page_size
        page_BT = jnp.take_along_axis(self.table, jnp.minimum(index_BT, w - 1), axis=1)
        own_BT = index_BT < w
        if valid_BT is not None:
            own_BT &= valid_BT
        return jnp.where(own_BT, page_BT, NULL_PAGE), positions_BT % self.page_size

    def write(self, layer, positions_BT, k_BTGH, v_BTGH, valid_BT=None) -> "PagedKV":
        page_BT, offset_BT = self.slots(positions_BT, valid_BT)
        kv_BTCH = to_pool(interleave(k_BTGH, v_BTGH), self.kv.dtype)
        return dataclasses.replace(self, kv=scatter_set(self.kv, (layer, page_BT, offset_BT),
                                                        kv_BTCH))

    def attend(self, layer, q_BTNH, positions_BT, *, window=None, scale=None, softcap=None):
        """The protocol's attend; `window`, `scale` and `softcap` as in ContiguousKV.attend.
        loop and native: every call; pallas and triton: the kernel runs decode steps of
        models without windows or soft-caps, the reference path everything else."""
        if self.impl == "loop":
            return self._attend_loop(layer, q_BTNH, positions_BT, window, scale, softcap)
        if self.impl == "native":
            return self._attend_native(layer, q_BTNH, positions_BT, window, scale, softcap)
        if (self.impl in KERNELS and q_BTNH.shape[1] == 1 and window is None
                and softcap is None):
            return self._attend_kernel(layer, q_BTNH, positions_BT, scale)
        return self._attend_reference(layer, q_BTNH, positions_BT, window, scale, softcap)

    def _attend_reference(self, layer, q_BTNH, positions_BT, window=None, scale=None,
                          softcap=None):
        """Gathers the row's W pages into a [B, W * K, 2G, H] block and attends causally over
        it. Positions past a row's length hold stale data and are masked by causality (key
        position <= query position)."""
        b, w = self.table.shape
        kv_BSCH = self.kv[layer, self.table].reshape(b, w * self.page_size, *self.kv.shape[3:])
        kv_BSCH = kv_BSCH.astype(q_BTNH.dtype)
        keys_S = jnp.arange(w * self.page_size)
        mask_BTS = keys_S[None, None, :] <= positions_BT[:, :, None]
        if window is not None:
            mask_BTS &= ops.window_mask(positions_BT, keys_S[None], window)
        return ops.attention(q_BTNH, kv_BSCH[:, :, 0::2], kv_BSCH[:, :, 1::2], mask_BTS, "xla",
                             scoring=ops.Scoring(scale, softcap))

    def _attend_loop(self, layer, q_BTNH, positions_BT, window=None, scale=None,
                     softcap=None):
        """Flash decoding over a work list: each row's blocks of LOOP_TOKENS tokens, from the
        first its queries' window reaches to the last they see, listed row after row; each
        iteration of a loop attends B of those (row, block) pairs and folds them into their
        rows' online softmax. A row reads only its own blocks, so a call costs the tokens its
        rows hold, not B times its longest row's (rows that started at different times differ
        a lot in length). The trip count is the call's own, so one program serves every table
        width, and no [B, G, H, S] copy of the keys is made (what the reference path's two
        batched dots cost on XLA:CPU). With at most ELEMENTWISE_QUERIES queries per kv head (a
        decode step), the scores and the weighted values are written as multiplies summed over
        an axis; XLA:CPU turns those into dots too, but over operands laid out for its YNNPACK
        kernels (keys as [rows, G, H, block], weights with the block major), which run faster
        than the batched dots it makes of the einsums; those win for prefill chunks."""
        b, t, n, h = q_BTNH.shape
        w, k = self.table.shape[1], self.page_size
        g, r = self.kv.shape[3] // 2, n // (self.kv.shape[3] // 2)
        per = max(1, min(LOOP_TOKENS // k, w))
        block, blocks = per * k, -(-w // per)
        last_B = jnp.minimum(jnp.max(positions_BT, axis=1) // block, blocks - 1)
        first_B = jnp.zeros_like(last_B) if window is None else jnp.minimum(
            jnp.maximum(jnp.min(positions_BT, axis=1) - window + 1, 0) // block, last_B)
        count_B = last_B - first_B + 1                   # the work list: row b's blocks
        ends_B = jnp.cumsum(count_B)
        scale = h ** -0.5 if scale is None else scale
        q_BTGRH = q_BTNH.reshape(b, t, g, r, h).astype(jnp.float32) * scale
        low = jnp.finfo(jnp.float32).min
        scores, weigh = ((_scores_by_sums, _weigh_by_sums) if t * r <= ELEMENTWISE_QUERIES
                         else (_scores_by_dots, _weigh_by_dots))

        def step(i, carry):
            m_BTGR, l_BTGR, acc_BTGRH = carry
            row_R, block_R, valid_R = work_items(i, b, first_B, count_B, ends_B)
            index_RC = block_R[:, None] * per + jnp.arange(per)
            pages_RC = jnp.take_along_axis(self.table[row_R], jnp.minimum(index_RC, w - 1), 1)
            # Keys and values gathered apart: XLA:CPU fuses each gather into the copy that lays
            # its operand out for the products; one gather of both, split after, is written out
            # whole first (a decode step of 128 rows holding 65 tokens, 4 layers: 15 -> 12 ms).
            k_RSGH, v_RSGH = (self.kv[layer, pages_RC, :, c::2].reshape(b, block, g, h)
                              .astype(jnp.float32) for c in (0, 1))
            s_RTGRS = ops.soft_cap(scores(q_BTGRH[row_R], k_RSGH), softcap)
            mask_RTGRS = _block_mask(index_RC, positions_BT[row_R], valid_R, k, w,
                                     window)[:, :, None, None]
            s_RTGRS = jnp.where(mask_RTGRS, s_RTGRS, low)
            m_RTGR = s_RTGRS.max(-1)
            p_RTGRS = jnp.where(mask_RTGRS, jnp.exp(s_RTGRS - m_RTGR[..., None]), 0.0)
            pv_RTGRH = weigh(p_RTGRS, v_RSGH)
            m_new = m_BTGR.at[row_R].max(m_RTGR)      # pairs of one row may share an iteration
            c_BTGR, c_RTGR = jnp.exp(m_BTGR - m_new), jnp.exp(m_RTGR - m_new[row_R])
            return (m_new, (l_BTGR * c_BTGR).at[row_R].add(p_RTGRS.sum(-1) * c_RTGR),
                    (acc_BTGRH * c_BTGR[..., None]).at[row_R].add(pv_RTGRH * c_RTGR[..., None]))

        shape = (b, t, g, r)
        init = (jnp.full(shape, low), jnp.zeros(shape), jnp.zeros((*shape, h)))
        _, l_BTGR, acc_BTGRH = jax.lax.fori_loop(0, -(-ends_B[-1] // b), step, init)
        l_BTGR = jnp.where(l_BTGR > 0, l_BTGR, 1.0)    # a padding query that sees no key
        return (acc_BTGRH / l_BTGR[..., None]).reshape(b, t, n, h).astype(q_BTNH.dtype)

    def _attend_native(self, layer, q_BTNH, positions_BT, window=None, scale=None,
                       softcap=None):
        """Every query through the C++ kernel (serving/runner/native), per kv-head shard under a mesh."""
        def kernel(q_BTNH, positions_BT, kv, table_BW, layer):
            return native.paged_attention(q_BTNH, positions_BT, kv, table_BW, layer,
                                          window=window, scale=scale, softcap=softcap)

        return self._per_head_shard(kernel, (2, None, 3, None, None), 2)(
            q_BTNH, positions_BT, self.kv, self.table, jnp.asarray(layer, jnp.int32))

    def _per_head_shard(self, kernel, head_dims: tuple, out_head_dim: int):
        """`kernel` as is, or under the pool's mesh in `shard_map` over its kv-head axis: each
        argument split along its heads' dimension (`head_dims`, None: replicated), the result
        along `out_head_dim`. A kernel call sees whole heads and knows nothing of the mesh."""
        if self.mesh is None or self.head_axis is None:
            return kernel

        def spec(dim):
            return PartitionSpec() if dim is None else PartitionSpec(*[None] * dim, self.head_axis)

        return jax.shard_map(kernel, mesh=self.mesh, check_vma=False,
                             in_specs=tuple(map(spec, head_dims)), out_specs=spec(out_head_dim))

    def _attend_kernel(self, layer, q_B1NH, positions_B1, scale=None):
        """One query per row through the impl's Pallas kernel: row b attends to its first
        positions_B1[b] + 1 tokens, read page by page from the pool."""
        lengths_B = positions_B1[:, 0] + 1

        def kernel(q_BNH, kv, layer, lengths_B, table_BW):
            return KERNELS[self.impl](q_BNH, kv, layer, lengths_B, table_BW,
                                      interpret=self.interpret, scale=scale)

        out = self._per_head_shard(kernel, (1, 3, None, None, None), 1)(
            q_B1NH[:, 0].astype(query_dtype(self.kv.dtype, q_B1NH.dtype)), self.kv,
            jnp.asarray(layer, jnp.int32),
            lengths_B.astype(jnp.int32), self.table.astype(jnp.int32))
        return out.astype(q_B1NH.dtype)[:, None]


def _scores_by_dots(q_RTGRH, k_RSGH):
    """Scores [R, T, G, Rq, S] of the loop's pairs as a batched dot."""
    return jnp.einsum("btgrh,bsgh->btgrs", q_RTGRH, k_RSGH)


def _weigh_by_dots(p_RTGRS, v_RSGH):
    """Weighted values [R, T, G, Rq, H] as a batched dot."""
    return jnp.einsum("btgrs,bsgh->btgrh", p_RTGRS, v_RSGH)


def _scores_by_sums(q_RTGRH, k_RSGH):
    """The same scores as multiplies summed over H, the keys transposed to [R, G, H, S]
    (XLA:CPU makes a dot of it over that layout; nothing of size [R, S, H] is kept)."""
    k_RGHS = jnp.moveaxis(k_RSGH, 1, -1)
    return (q_RTGRH[..., None] * k_RGHS[:, None, :, None]).sum(-2)


def _weigh_by_sums(p_RTGRS, v_RSGH):
    """The same weighted values as multiplies summed over S."""
    return (jnp.moveaxis(p_RTGRS, -1, 1)[..., None] * v_RSGH[:, :, None, :, None, :]).sum(1)


def to_pool(x, dtype):
    """`x` in the pool's dtype; into an 8-bit float, clipped to its finite range first (e4m3
    has no infinity: a value past +-448 would become NaN)."""
    if jnp.dtype(dtype).itemsize == 1 and jnp.issubdtype(dtype, jnp.floating):
        top = float(jnp.finfo(dtype).max)
        x = jnp.clip(x.astype(jnp.float32), -top, top)
    return x.astype(dtype)


def interleave(k_BTGH, v_BTGH):
    """Keys and values as one [B, T, 2G, H] block: head g's keys at 2g, its values at 2g+1."""
    kv = jnp.stack([k_BTGH, v_BTGH], axis=-2)
    return kv.reshape(*k_BTGH.shape[:-2], 2 * k_BTGH.shape[-2], k_BTGH.shape[-1])


def table_width(tokens: int, page_size: int, max_pages: int, per_doubling: int = 1) -> int:
    """Pages per row for a call whose longest row needs `tokens` positions, rounded up to one of
    `per_doubling` evenly spaced widths per power of two (one compiled program per width; 4 per
    doubling reads at most 25% more pages than needed, 1 up to 100%), at most `max_pages`."""
    need = max(math.ceil(tokens / page_size), 1)
    octave = 1 << (need - 1).bit_length() - 1 if need > 1 else 1   # largest power of 2 < need
    step = max(octave // per_doubling, 1)
    return min(-(-need // step) * step, max_pages)


def _block_mask(index_RC, positions_RT, valid_R, page: int, width: int, window):
    """[R, T, C * page]: which keys of each work item's block (table entries `index_RC`) its
    row's queries see: at or before their position, within the table, within the window, and
    none for a padding item."""
    r, c = index_RC.shape
    keys_RS = (index_RC[:, :, None] * page + jnp.arange(page)).reshape(r, c * page)
    mask_RTS = ((keys_RS[:, None] <= positions_RT[..., None])
                & (index_RC < width).repeat(page, axis=1)[:, None] & valid_R[:, None, None])
    if window is not None:
        mask_RTS &= ops.window_mask(positions_RT, keys_RS, window)
    return mask_RTS
