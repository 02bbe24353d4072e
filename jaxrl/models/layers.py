"""Stateless pieces of the transformer: RMSNorm, RoPE, attention, gated MLPs.

Shape letters: B batch, T query length, S key length, D embed, N query heads, G key/value heads,
H head dim, F mlp hidden, V vocab.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.models import splash
from jaxrl.models.config import ModelConfig
from jaxrl.models.cudnn_packed import packed_attention
from jaxrl.models.grads import weight_grad


def rms_norm(x, scale, eps: float, plus_one: bool = False):
    """RMSNorm. Llama and Qwen normalise in float32, cast back, then multiply by `scale`;
    Gemma (`plus_one`) multiplies by (1 + scale) in float32 and casts the product."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if plus_one:
        return (x32 * (1.0 + scale.astype(jnp.float32))).astype(x.dtype)
    return scale.astype(x.dtype) * x32.astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> np.ndarray:
    """Inverse frequencies [H/2], with Llama 3.1 or linear scaling applied when configured.
    `local`: those of the sliding-window layers (Gemma 3: their own base, never scaled)."""
    h = cfg.head_dim
    theta = cfg.rope_local_theta if local and cfg.rope_local_theta else cfg.rope_theta
    inv_freq = 1.0 / (theta ** (np.arange(0, h, 2, dtype=np.float64) / h))
    s = None if local and cfg.rope_local_theta else cfg.rope_scaling
    if s is None:
        return inv_freq.astype(np.float32)
    if s.type == "linear":
        return (inv_freq / s.factor).astype(np.float32)
    # llama3 (Meta's Llama 3.1 reference): keep high frequencies, divide low ones by `factor`,
    # interpolate smoothly in between.
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    interpolated = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
    out = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    out = np.where((wavelen <= low_wavelen) & (wavelen >= high_wavelen), interpolated, out)
    return out.astype(np.float32)


def rope_tables(cfg: ModelConfig, positions_BT, local: bool = False):
    """cos and sin [B, T, H] for the given integer positions."""
    angles = positions_BT.astype(jnp.float32)[..., None] * jnp.asarray(rope_inv_freq(cfg, local))
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x_BTNH, cos_BTH, sin_BTH):
    """Rotates halves (the Hugging Face / Llama layout, not interleaved pairs)."""
    x = x_BTNH.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    out = x * cos_BTH[:, :, None, :] + rotated * sin_BTH[:, :, None, :]
    return out.astype(x_BTNH.dtype)


def causal_mask(segment_ids_BT=None, length: int | None = None):
    """bool [B or 1, T, T]: causal, and only within a segment when segment ids are given."""
    if segment_ids_BT is None:
        return jnp.tril(jnp.ones((1, length, length), dtype=bool))
    t = segment_ids_BT.shape[1]
    same = segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :]
    return same & jnp.tril(jnp.ones((1, t, t), dtype=bool))


def window_mask(q_positions_BT, k_positions_BS, window):
    """bool [B, T, S]: the key is one of the query's last `window` positions (its own
    included; Hugging Face's sliding_window_overlay). Causality is the caller's mask."""
    return k_positions_BS[:, None, :] > q_positions_BT[:, :, None] - window


@dataclasses.dataclass(frozen=True)
class Scoring:
    """How attention forms its scores: `scale` multiplies q.k (None: 1/sqrt(head_dim));
    `softcap` (xla only, Gemma 2) bounds them to (-cap, cap) by cap * tanh(score / cap);
    `causal`: the caller promises that queries and keys are the same positions and the mask
    is false above the diagonal (the model's forward over whole sequences), so the xla path
    may skip the keys after each block of queries (`causal_blocks`)."""

    scale: float | None = None
    softcap: float | None = None
    causal: bool = False


def attention(q_BTNH, k_BSGH, v_BSGH, mask_BTS, impl: str = "xla", segment_ids_BT=None,
              max_segments: int = 16, scoring: Scoring = Scoring()):
    """Grouped-query attention. `mask_BTS` is True where a query may attend to a key (the xla
    path; the fused kernels take `segment_ids_BT`, cudnn at most `max_segments` a row)."""
    scale = q_BTNH.shape[-1] ** -0.5 if scoring.scale is None else scoring.scale
    softcap, causal = scoring.softcap, scoring.causal
    if softcap is not None and impl != "xla":
        raise ValueError(f"attention soft-capping runs on the xla path only, not {impl!r}")
    if impl == "xla" and causal:
        return _attention_xla_causal(q_BTNH, k_BSGH, v_BSGH, mask_BTS, scale, softcap)
    if impl == "xla":
        return _attention_xla(q_BTNH, k_BSGH, v_BSGH, mask_BTS, scale, softcap)
    if impl == "cudnn":
        return _attention_cudnn(q_BTNH, k_BSGH, v_BSGH, segment_ids_BT, max_segments, scale)
    if impl == "splash":
        return splash.attention(q_BTNH, k_BSGH, v_BSGH, segment_ids_BT, scale)
    raise ValueError(f"attention={impl!r} is not one of 'xla', 'cudnn', 'splash'")


# Causal attention on the xla path splits sequences of at least 2 * CAUSAL_BLOCK tokens into at
# most MAX_CAUSAL_BLOCKS blocks of queries: n blocks compute (n + 1) / 2n of the scores. More
# blocks save little more (5/8 of the scores at 4, 9/16 at 8) and cost compile time (libtpu's
# offload compile of the 1B shape at 1,024 tokens: 37 s at 4 blocks, 51 s at 8).
CAUSAL_BLOCK, MAX_CAUSAL_BLOCKS = 128, 4


def causal_blocks(length: int) -> tuple[int, ...]:
    """Where each block of queries starts (static): (0,) below 2 * CAUSAL_BLOCK tokens."""
    n = min(MAX_CAUSAL_BLOCKS, length // CAUSAL_BLOCK)
    if n < 2:
        return (0,)
    size = -(-length // n)
    return tuple(range(0, length, size))


def _attention_xla_causal(q_BTNH, k_BTGH, v_BTGH, mask_BTT, scale: float,
                          softcap: float | None):
    """Each block of queries against the keys up to its last one: the same softmax (the keys
    after it are masked, exp(-inf) = 0), with the scores above the block diagonal (3/8 of a
    long sequence's at 4 blocks) never computed, stored or differentiated."""
    starts = causal_blocks(q_BTNH.shape[1])
    ends = (*starts[1:], q_BTNH.shape[1])
    return jnp.concatenate([
        _attention_xla(q_BTNH[:, a:b], k_BTGH[:, :b], v_BTGH[:, :b], mask_BTT[:, a:b, :b],
                       scale, softcap) for a, b in zip(starts, ends)], axis=1)


def _attention_xla(q_BTNH, k_BSGH, v_BSGH, mask_BTS, scale: float, softcap: float | None):
    b, t, n, h = q_BTNH.shape
    g = k_BSGH.shape[2]
    q_BTGRH = q_BTNH.reshape(b, t, g, n // g, h)
    scores = jnp.einsum("btgrh,bsgh->bgrts", q_BTGRH, k_BSGH,
                        preferred_element_type=jnp.float32) * scale
    if softcap is not None:
        scores = soft_cap(scores, softcap)
    scores = jnp.where(mask_BTS[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_BSGH.dtype)
    out = jnp.einsum("bgrts,bsgh->bgrth", probs, v_BSGH)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)


def segment_layout(segment_ids_BT, max_segments: int):
    """Packed rows as cuDNN's ragged layout takes them: (lengths [B, M], offsets [B, M + 1]),
    segment s of a row being ids s + 1, contiguous and in order from position 0 (how the
    packers lay rows out; padding, id 0, at the end belongs to no segment). Offsets are the
    segments' first positions; entries past a row's last segment are -1 (the layout of cuDNN's
    q_offsets: jaxrl/models/cudnn_packed.py). Counted by a
    scatter, O(B x T), not by comparing ids pairwise."""
    b = segment_ids_BT.shape[0]
    counts_BM1 = jax.vmap(lambda row: jnp.zeros(max_segments + 1, jnp.int32)
                          .at[row].add(1, mode="drop"))(segment_ids_BT)
    lengths_BM = counts_BM1[:, 1:]
    present_BM = lengths_BM > 0
    starts_BM = jnp.cumsum(lengths_BM, axis=1) - lengths_BM
    offsets_BM1 = jnp.concatenate([jnp.where(present_BM, starts_BM, -1),
                                   jnp.full((b, 1), -1, jnp.int32)], axis=1)
    return jnp.where(present_BM, lengths_BM, -1), offsets_BM1


def _attention_cudnn(q_BTNH, k_BSGH, v_BSGH, segment_ids_BT, max_segments: int, scale: float):
    """cuDNN's fused flash attention (NVIDIA GPUs, bfloat16/float16): causal, GQA natively (K/V
    keep their G heads), and packed rows as cuDNN's ragged layout (per-segment lengths and
    offsets; jax.nn.dot_product_attention takes no segments), so no [T, T] mask or bias is
    built. At most `max_segments` segments a row (model.max_segments; the config checks the
    packers against it): cuDNN's softmax statistics are [B x max_segments, N, T] floats."""
    if segment_ids_BT is None:
        return jax.nn.dot_product_attention(q_BTNH, k_BSGH, v_BSGH, is_causal=True,
                                            scale=scale, implementation="cudnn")
    lengths_BM, offsets_BM1 = segment_layout(segment_ids_BT, max_segments)
    return packed_attention(q_BTNH, k_BSGH, v_BSGH, lengths_BM, offsets_BM1, scale)


def gelu_tanh(x):
    return jax.nn.gelu(x, approximate=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def gated_mlp(act, x_BTD, gate_DF, up_DF, down_FD):
    """act(x @ gate) * (x @ up) @ down, the gated MLP of every family. Its backward is
    autodiff's, with each weight gradient contracted over the tokens with the wider operand
    first (`weight_grad`): XLA:CPU then transposes the [tokens, D] input once instead of each
    [tokens, F] activation gradient, which cut a 3M-parameter RL train step's transposing
    copies from 0.52 s to 0.27 s (docs/benchmarks.md). CPU trainers only (mlp_backward=auto):
    its residuals are its own, not the names remat and offload policies act on."""
    return _gated(act, x_BTD, gate_DF, up_DF, down_FD)


def _gated(act, x_BTD, gate_DF, up_DF, down_FD):
    return (act(x_BTD @ gate_DF) * (x_BTD @ up_DF)) @ down_FD


def _gated_mlp_fwd(act, x_BTD, gate_DF, up_DF, down_FD):
    g_BTF, u_BTF = x_BTD @ gate_DF, x_BTD @ up_DF
    return (act(g_BTF) * u_BTF) @ down_FD, (x_BTD, g_BTF, u_BTF, gate_DF, up_DF, down_FD)


def _gated_mlp_bwd(act, res, dy_BTD):
    x_BTD, g_BTF, u_BTF, gate_DF, up_DF, down_FD = res
    h_BTF, gate_vjp = jax.vjp(lambda g, u: act(g) * u, g_BTF, u_BTF)
    dh_BTF = dy_BTD @ down_FD.T
    dg_BTF, du_BTF = gate_vjp(dh_BTF)
    dx_BTD = dg_BTF @ gate_DF.T + du_BTF @ up_DF.T
    return (dx_BTD, weight_grad(x_BTD, dg_BTF), weight_grad(x_BTD, du_BTF),
            weight_grad(h_BTF, dy_BTD))


gated_mlp.defvjp(_gated_mlp_fwd, _gated_mlp_bwd)


def _mlp(act, x_BTD, gate_DF, up_DF, down_FD, ordered: bool):
    return (gated_mlp if ordered else _gated)(act, x_BTD, gate_DF, up_DF, down_FD)


def swiglu(x_BTD, gate_DF, up_DF, down_FD, ordered: bool = False):
    """`ordered`: through gated_mlp's backward (ModelConfig.mlp_backward)."""
    return _mlp(jax.nn.silu, x_BTD, gate_DF, up_DF, down_FD, ordered)


def geglu(x_BTD, gate_DF, up_DF, down_FD, ordered: bool = False):
    """Gemma's MLP: the tanh approximation of GELU (PyTorch's gelu(approximate="tanh"))."""
    return _mlp(gelu_tanh, x_BTD, gate_DF, up_DF, down_FD, ordered)


def soft_cap(logits, cap: float | None):
    """cap * tanh(logits / cap), or the logits as they are without a cap."""
    return logits if cap is None else cap * jnp.tanh(logits / cap)
