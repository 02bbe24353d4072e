"""Pallas splash attention (TPU) at any sequence length, and on rows split over the `context`
mesh axis.

The kernel walks a grid of (query block, key block) pairs and reads, per pair, whether the
mask empties, fills or cuts it and which key block to fetch next. Those tables live in the
core's scalar memory (SMEM, 1 MiB on v5e/v5p): at 128k tokens in blocks of 128 they are 1,024 x
1,024 entries and no longer fit. Here the blocks grow with the sequence so that the grid stays
at most `MAX_GRID` blocks a side. The tables are built by the kernel's own mask processing, which
evaluates every element of the T x T mask in numpy (33 s at 128k, 118 s at 256k): for the masks
used here (causal, in either token order) a block's kind depends only on which chunks its
queries and keys come from, so they are built on the same grid with two tokens a block, and only
the query positions the kernel compares element-wise are the real ones.

Shape letters as in layers.py; R = N/G query heads per key/value head.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

# Sequences must be whole blocks of this (head_dim is a block's whole last dimension, so any
# size compiles; 128 fills a TPU register's lanes).
SPLASH_BLOCK = 128
PREFERRED_BLOCK = 512     # MaxText's default block: fewer grid steps, large enough products
MAX_GRID = 256            # blocks a side: the tables take ~200 KB of SMEM at most
_BLOCK_FIELDS = ("block_q", "block_kv", "block_kv_compute", "block_q_dkv", "block_kv_dkv",
                 "block_kv_dkv_compute", "block_q_dq", "block_kv_dq")
_BATCH_AXES = ("data", "fsdp", "expert")


def block_size(length: int, shards: int = 1) -> int:
    """The kernel's block for rows of `length` tokens (a block must not straddle two of the
    `shards` equal parts of a row): PREFERRED_BLOCK or the largest power-of-two multiple of
    SPLASH_BLOCK below it that divides a part, doubled while the grid has more than MAX_GRID
    blocks a side. A part below one SPLASH_BLOCK (interpret mode, tests) is one block."""
    part = length // shards
    if part < SPLASH_BLOCK:
        return part
    if part % SPLASH_BLOCK:
        raise ValueError(splash_problems({"a row's part": part})[0])
    block = PREFERRED_BLOCK
    while part % block:
        block //= 2
    while length // block > MAX_GRID and part % (2 * block) == 0:
        block *= 2
    return block


def splash_problems(seq_lens: dict[str, int], context: int = 1) -> list[str]:
    """What keeps the splash kernel from these shapes, one message each with the nearest valid
    values (empty: they fit). `seq_lens` names each sequence length by its config key; with
    context parallelism each of the row's 2 x `context` chunks must be whole blocks."""
    unit = SPLASH_BLOCK * (2 * context if context > 1 else 1)
    what = (f"{unit} tokens (splash attention's {SPLASH_BLOCK}-token block in each of the "
            f"2 x mesh.context = {2 * context} chunks of a row)" if context > 1
            else f"splash attention's {SPLASH_BLOCK}-token block")
    out = []
    for key, length in seq_lens.items():
        if length % unit:
            below = max(length // unit * unit, unit)
            above = -(-length // unit) * unit
            out.append(f"{key}={length} is not a multiple of {what} (nearest: "
                       + (f"{below} or {above})" if below != above else f"{above})"))
    return out


def _zigzag_causal_mask(length: int, context: int):
    """The causal mask of a row stored in context parallelism's load-balanced order (chunk p
    of its 2C stored chunks is original chunk p/2 for even p, 2C-1-p/2 for odd), by original
    index. Lazy as the kernel's own masks are: a function of index arrays (numpy while the
    tables are built, traced in the kernel, where it must be arithmetic: no captured table)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    s = length // (2 * context)

    def original(p):
        xp = np if isinstance(p, np.ndarray) else jnp
        slot = p // s
        chunk = xp.where(slot % 2 == 1, 2 * context - 1 - slot // 2, slot // 2)
        return chunk * s + p % s

    class ZigzagCausalMask(sm._ComputableMask):
        def __eq__(self, other):
            return type(self) is type(other) and self.shape == other.shape

        def __hash__(self):
            return hash(("zigzag", length, context))

    return ZigzagCausalMask((length, length),
                            mask_function=lambda q_ids, kv_ids: original(q_ids) >= original(kv_ids))


@functools.cache
def kernel(length: int, heads: int, context: int = 1, interpret: bool = False):
    """The splash MQA kernel for rows of `length` tokens, causal; with `context` > 1, for rows
    stored in context parallelism's order (`_zigzag_causal_mask`), its query blocks split into
    `context` shards (each device's queries are its two chunks). `heads`: query heads per
    key/value head. Its tables are concrete arrays, made once, whether or not it is first
    asked for inside a trace."""
    with jax.ensure_compile_time_eval():
        return _make_kernel(length, heads, context, interpret)


def _make_kernel(length: int, heads: int, context: int, interpret: bool):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    block = block_size(length, 2 * context if context > 1 else 1)

    def causal(n):
        mask = sm.CausalMask((n, n)) if context == 1 else _zigzag_causal_mask(n, context)
        return sm.MultiHeadMask([mask] * heads)

    def make(n, b):
        return sk.make_splash_mqa(causal(n), head_shards=1, q_seq_shards=context,
                                  interpret=interpret,
                                  block_sizes=sk.BlockSizes(**dict.fromkeys(_BLOCK_FIELDS, b)))

    if block <= 2:
        return make(length, block)
    small = make(2 * (length // block), 2)          # the same grid, two tokens a block
    positions = np.arange(length, dtype=np.int32)     # numpy: no mesh of the tracing context
    infos = [None if info is None else info._replace(q_sequence=positions)
             for info in (small.fwd_mask_info, small.dq_mask_info, small.dkv_mask_info)]
    kwargs = {**small.kwargs, "block_sizes": sk.BlockSizes(**dict.fromkeys(_BLOCK_FIELDS, block)),
              "mask_function": causal(length).masks[0].mask_function}
    return sk.SplashAttentionKernel(*infos, **kwargs)


def mesh_axes(mesh, kv_heads: int, batch: int | None = None):
    """(the batch axes rows split over or None, the axis heads split over or None): how the
    attention kernels' shard_maps split rows and key/value heads on `mesh`. Rows stay whole
    when their count, `batch`, does not split over those axes (a pipeline's one-row
    microbatch beside fsdp: every device of the stage holds the row)."""
    present = lambda a: not mesh.empty and a in mesh.axis_names and mesh.shape[a] > 1  # noqa: E731
    rows = tuple(a for a in _BATCH_AXES if present(a)) or None
    if rows and batch is not None and batch % math.prod(mesh.shape[a] for a in rows):
        rows = None
    heads = ("tensor" if present("tensor") and kv_heads % mesh.shape["tensor"] == 0 else None)
    return rows, heads


def _per_head(kern, q_BGRTH, k_BGSH, v_BGSH, seg_q_BT, seg_k_BS, packed: bool):
    """The MQA kernel over rows and key/value heads (vmap)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    def one(q_RTH, k_SH, v_SH, seg_q_T, seg_k_S):
        segs = sk.SegmentIds(q=seg_q_T, kv=seg_k_S) if packed else None
        return kern(q_RTH, k_SH, v_SH, segment_ids=segs)

    heads = jax.vmap(one, in_axes=(0, 0, 0, None, None))
    return jax.vmap(heads)(q_BGRTH, k_BGSH, v_BGSH, seg_q_BT, seg_k_BS)


def _to_kernel(q_BTNH, k_BTGH, v_BTGH, scale):
    b, t, n, h = q_BTNH.shape
    g = k_BTGH.shape[2]
    q_BGRTH = (q_BTNH * scale).reshape(b, t, g, n // g, h).transpose(0, 2, 3, 1, 4)
    return q_BGRTH, jnp.swapaxes(k_BTGH, 1, 2), jnp.swapaxes(v_BTGH, 1, 2)


def _from_kernel(out_BGRTH):
    b, g, r, t, h = out_BGRTH.shape
    return out_BGRTH.transpose(0, 3, 1, 2, 4).reshape(b, t, g * r, h)


def attention(q_BTNH, k_BTGH, v_BTGH, segment_ids_BT, scale: float):
    """Causal splash attention, within segments when `segment_ids_BT` is given (None: rows are
    not packed, and the kernel reads no segment ids), GQA without copying K/V (one MQA kernel
    per key/value head serves its R query heads).

    Under a mesh (the train step sets it, `jax.sharding.use_abstract_mesh`) the kernel runs in
    `shard_map`, since Mosaic kernels cannot be partitioned automatically: rows over the batch
    axes, key/value heads and their query heads over `tensor`. On anything but TPU it runs in
    Pallas interpret mode (slow; for checking it against the XLA path)."""
    mesh = jax.sharding.get_abstract_mesh()
    platform = mesh.abstract_device.platform if not mesh.empty else jax.default_backend()
    b, t, n, _ = q_BTNH.shape
    g = k_BTGH.shape[2]
    kern = kernel(t, n // g, interpret=platform != "tpu")
    packed = segment_ids_BT is not None
    seg_BT = (segment_ids_BT if packed else jnp.ones((b, t), jnp.int32)).astype(jnp.int32)

    def local(q_BGRTH, k_BGSH, v_BGSH, seg_BT):
        return _per_head(kern, q_BGRTH, k_BGSH, v_BGSH, seg_BT, seg_BT, packed)

    rows, heads = mesh_axes(mesh, g, b)
    if not mesh.empty:
        spec = P(rows, heads)
        local = jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec, P(rows)),
                              out_specs=spec, check_vma=False)
    return _from_kernel(local(*_to_kernel(q_BTNH, k_BTGH, v_BTGH, scale), seg_BT))


def context_attention(q_BTNH, k_BTGH, v_BTGH, segment_ids_BT, scale: float, axis: str):
    """`attention` on rows stored in context parallelism's order and split over mesh axis
    `axis` (jaxrl/models/context_attention.py): each device's queries against every device's
    keys and values, gathered; the kernel's block tables split by query shard."""
    mesh = jax.sharding.get_abstract_mesh()
    b, t, n, _ = q_BTNH.shape
    g = k_BTGH.shape[2]
    kern = kernel(t, n // g, mesh.shape[axis],
                  interpret=mesh.abstract_device.platform != "tpu")
    packed = segment_ids_BT is not None
    seg_BT = (segment_ids_BT if packed else jnp.ones((b, t), jnp.int32)).astype(jnp.int32)
    rows, heads = mesh_axes(mesh, g)
    gather = functools.partial(jax.lax.all_gather, axis_name=axis, axis=2, tiled=True)

    def local(kern, q_BGRTH, k_BGSH, v_BGSH, seg_BT):
        seg_BS = jax.lax.all_gather(seg_BT, axis, axis=1, tiled=True)
        return _per_head(kern, q_BGRTH, gather(k_BGSH), gather(v_BGSH), seg_BT, seg_BS,
                         packed)

    q_spec, kv_spec = P(rows, heads, None, axis), P(rows, heads, axis)
    kernel_spec = kern.manual_sharding_spec(jax.sharding.NamedSharding(mesh, P(None, axis)))
    local = jax.shard_map(local, mesh=mesh,
                          in_specs=(kernel_spec, q_spec, kv_spec, kv_spec, P(rows, axis)),
                          out_specs=q_spec, check_vma=False)
    return _from_kernel(local(kern, *_to_kernel(q_BTNH, k_BTGH, v_BTGH, scale), seg_BT))
