"""Splash attention's block tables at any length: the blocks grow with the sequence so the
tables fit the TPU core's scalar memory, and the tables made on a small grid equal the ones
the kernel's own mask processing makes element by element."""

import jax
import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

from jaxrl.models import splash


@pytest.mark.parametrize("length,shards,block", [
    (2048, 1, 512), (131072, 1, 512), (262144, 1, 1024), (1048576, 1, 4096),
    (384, 1, 128), (131072, 8, 512), (512, 4, 128), (256, 4, 64)])
def test_blocks_grow_with_the_sequence_so_the_grid_stays_small(length, shards, block):
    assert splash.block_size(length, shards) == block
    part = length // shards
    assert part % block == 0
    assert length // block <= splash.MAX_GRID or block == splash.PREFERRED_BLOCK


def test_a_part_that_is_not_whole_blocks_is_refused_by_name():
    with pytest.raises(ValueError, match=r"a row's part=200 is not a multiple of splash "
                                         r"attention's 128-token block \(nearest: 128 or 256\)"):
        splash.block_size(400, 2)


@pytest.mark.parametrize("context", [1, 2, 4])
def test_tables_from_the_small_grid_equal_the_kernels_own(context):
    """4,096 tokens (8 x 8 blocks of 512): every table of the forward, dq and dkv passes, and
    every setting but the mask function, against make_splash_mqa on the full-size mask."""
    length = 4096
    fast = splash.kernel(length, 4, context)
    block = splash.block_size(length, 2 * context if context > 1 else 1)
    mask = (sm.CausalMask((length, length)) if context == 1
            else splash._zigzag_causal_mask(length, context))
    slow = sk.make_splash_mqa(
        sm.MultiHeadMask([mask] * 4), head_shards=1, q_seq_shards=context,
        block_sizes=sk.BlockSizes(**dict.fromkeys(splash._BLOCK_FIELDS, block)))
    fast_leaves, slow_leaves = jax.tree.leaves(fast), jax.tree.leaves(slow)
    assert len(fast_leaves) == len(slow_leaves) >= 5
    for a, b in zip(fast_leaves, slow_leaves):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    assert {k: v for k, v in fast.kwargs.items() if k != "mask_function"} == {
        k: v for k, v in slow.kwargs.items() if k != "mask_function"}
    q, kv = np.arange(length)[:, None], np.arange(length)[None, :]
    np.testing.assert_array_equal(fast.kwargs["mask_function"](q, kv), mask[:, :])


def test_the_zigzag_mask_is_causal_by_original_index():
    """Context 2, 8 tokens: stored chunks 0, 3, 1, 2 of 2 tokens each."""
    mask = splash._zigzag_causal_mask(8, 2)
    original = np.array([0, 1, 6, 7, 2, 3, 4, 5])
    np.testing.assert_array_equal(mask[:, :], original[:, None] >= original[None, :])
