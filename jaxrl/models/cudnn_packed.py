"""cuDNN's fused attention over packed rows, which jax's public API does not offer.

`jax.nn.dot_product_attention(implementation="cudnn")` takes one sequence length per row
(`query_seq_lengths`, `key_value_seq_lengths`); cuDNN itself also takes several segments packed
in one row (its ragged layout: per-segment lengths and offsets), which only jax's private
`jax._src.cudnn.fused_attention_stablehlo` exposes. This module is the one place jaxrl imports
from `jax._src`; tests/gpu/test_gpu.py compares it with the public API on rows of one segment,
where both apply."""

from __future__ import annotations


def packed_attention(q_BTNH, k_BSGH, v_BSGH, lengths_BM, offsets_BM1, scale: float):
    """Causal attention within each segment of each row: `lengths_BM` the segments' lengths
    and `offsets_BM1` their first positions (-1 past a row's last segment; layers.py's
    `segment_layout`). K/V keep their G heads (GQA)."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    return cudnn.dot_product_attention(
        q_BTNH, k_BSGH, v_BSGH, q_seqlen=lengths_BM, kv_seqlen=lengths_BM,
        q_offsets=offsets_BM1, kv_offsets=offsets_BM1, scale=scale,
        mask_type=cudnn.MaskType.PADDING_CAUSAL)
