"""The paged KV cache on device: one pool of fixed-size pages per layer, read and written through
per-row page tables (vLLM's PagedAttention layout, as in JetStream's and tpu-inference's paged
attention).

    pool k, v : [L, P, page, G, H]     P pages of `page` tokens; page 0 is the null page
    table     : int32 [B, W]           row b's logical page i lives in pool page table[b, i]

Position p of row b is slot p % page of pool page table[b, p // page]. Writes of padding tokens,
of rows with no page there (table entry 0) and of positions past the table's W pages all land
in the null page, which no row ever reads as its own. `attend` gathers only the W pages of the
table it is given, so the caller sizes W to the longest row it holds (rounded up to a bucket):
a decode step costs what the batch holds, not what the longest possible sequence could.

Shape letters as in jaxrl/models; P pool pages, W table width (pages per row), K page size.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxrl.models import layers as ops

NULL_PAGE = 0
IMPLEMENTATIONS = ("reference",)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedKV:
    """The pool and the page tables of the rows one call runs; satisfies the KV cache protocol
    of jaxrl.models.kv_cache."""

    k: jax.Array        # [L, P, K, G, H]
    v: jax.Array
    table: jax.Array    # int32 [B, W]

    @property
    def page_size(self) -> int:
        return self.k.shape[2]

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
        k = self.k.at[layer, page_BT, offset_BT].set(k_BTGH.astype(self.k.dtype))
        v = self.v.at[layer, page_BT, offset_BT].set(v_BTGH.astype(self.v.dtype))
        return PagedKV(k, v, self.table)

    def attend(self, layer, q_BTNH, positions_BT):
        """Reference paged attention in plain JAX: gather the row's W pages into a
        [B, W * K, G, H] block and attend causally over it. Positions past a row's length hold
        stale data and are masked by causality (key position <= query position)."""
        b, w = self.table.shape
        k_BSGH = self.k[layer, self.table].reshape(b, w * self.page_size, *self.k.shape[3:])
        v_BSGH = self.v[layer, self.table].reshape(b, w * self.page_size, *self.v.shape[3:])
        mask_BTS = jnp.arange(w * self.page_size)[None, None, :] <= positions_BT[:, :, None]
        return ops.attention(q_BTNH, k_BSGH.astype(q_BTNH.dtype), v_BSGH.astype(q_BTNH.dtype),
                             mask_BTS, "xla")


def table_width(tokens: int, page_size: int, max_pages: int, per_doubling: int = 1) -> int:
    """Pages per row for a call whose longest row needs `tokens` positions, rounded up to one of
    `per_doubling` evenly spaced widths per power of two (one compiled program per width; 4 per
    doubling reads at most 25% more pages than needed, 1 up to 100%), at most `max_pages`."""
    need = max(math.ceil(tokens / page_size), 1)
    octave = 1 << (need - 1).bit_length() - 1 if need > 1 else 1   # largest power of 2 < need
    step = max(octave // per_doubling, 1)
    return min(-(-need // step) * step, max_pages)
