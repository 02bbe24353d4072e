"""What each of the engine's programs computes: module-level functions of a `Spec` (model
config, engine config, mesh, pool size) and their arguments, jitted and compiled per shape by
serving/runner/programs.py. Every output is pinned to one layout (serving/runner/spec.py, `pinned`)."""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp

from jaxrl.models import merge_params
from jaxrl.models.kv_cache import scatter_set
from serving.runner.sampling import Draws, sample, slot_keys, with_bias, with_penalties
from serving.runner.spec import PER_SLOT, DecodeState, Spec, empty_state, pinned
from sharding import mesh as shd

# Generated tokens an insert counts per call for a penalized sample (a longer history, from a
# preempted or carried-over sample, takes more calls).
HISTORY_CHUNK = 32


def _prefill(spec: Spec, params, state: DecodeState, tokens_PT, starts_P, lengths_P, table_PW):
    """(state, logits [max_prefill_rows, V]), and with record_routes each token's experts
    [P, T, L, K] after them."""
    model = merge_params(spec.graphdef, params)
    x_PTD, cache, *routes = model.extend(tokens_PT, starts_P, spec.cache(state.kv, table_PW),
                                         valid_B=lengths_P, routes=spec.cfg.record_routes)
    last_P11 = jnp.maximum(lengths_P - 1, 0)[:, None, None]
    logits_PV = model.logits(jnp.take_along_axis(x_PTD, last_P11, axis=1))[:, 0]
    # Padded to the most rows any prefill call has, so one sampling program serves them all.
    logits_PV = jnp.pad(logits_PV, ((0, spec.cfg.max_prefill_rows - logits_PV.shape[0]), (0, 0)))
    return pinned(spec, dataclasses.replace(state, kv=cache.kv), logits_PV, *routes)


def _banned(banned_S, min_tokens_S, counts_S):
    """The token each slot may not draw now: its ban while it has fewer than min_tokens."""
    return jnp.where(counts_S < min_tokens_S, banned_S, -1)


def _sample_first(spec: Spec, logits_PV, rows_K, index_K, sampling_K: dict, allowed_KW):
    """Each entry's first token from logits row `rows_K`, as sample `index_K` of its request,
    under `sampling_K` (arrays [K, ...] keyed by spec.SAMPLING)."""
    zeros = jnp.zeros_like(index_K)
    keys = slot_keys(sampling_K["seeds"], index_K, zeros)
    has = spec.cfg.sampling_features.__contains__
    s = sampling_K
    # A sample's first token: nothing generated yet to penalize.
    tokens_K, logprobs_K = sample(
        logits_PV[rows_K], Draws(s["temperature"], s["top_k"], s["top_p"], keys),
        _banned(s["banned"], s["min_tokens"], zeros) if has("min_tokens") else None,
        allowed_KW if has("grammar") else None,
        partial(with_bias, ids_SB=s["bias_ids"], values_SB=s["bias_values"])
        if has("logit_bias") else None, top_k_top_p=has("top_k_top_p"))
    rep = shd.replicated(spec.mesh)
    return (jax.lax.with_sharding_constraint(tokens_K, rep),
            jax.lax.with_sharding_constraint(logprobs_K, rep))


def _insert(spec: Spec, state: DecodeState, slots_K, rows_K: dict, history_KC, reset):
    """Puts K sequences into their slots: `rows_K` holds each per-slot field's values [K, ...]
    (spec.PER_SLOT). A penalized one's token counts are rebuilt from the tokens it has
    generated (`history_KC`, -1 padding), a chunk per call: `reset` zeroes them first, later
    calls (a long history) add on."""
    state = dataclasses.replace(state, **{
        n: getattr(state, n).at[slots_K].set(rows_K[n]) for n in PER_SLOT})
    penalized_K = (rows_K["presence"] != 0) | (rows_K["frequency"] != 0)

    def recount(seen_SV):
        s, v = seen_SV.shape
        # Out-of-range indices are dropped: unpenalized entries, padding, and -1 history.
        cleared_K = jnp.where(penalized_K & reset, slots_K, s)
        seen_SV = seen_SV.at[cleared_K].set(0, mode="drop")
        slot_KC = jnp.where(penalized_K[:, None] & (history_KC >= 0), slots_K[:, None], s)
        return seen_SV.at[slot_KC, history_KC].add(1, mode="drop")

    if "penalties" not in spec.cfg.sampling_features:
        return pinned(spec, state)[0]
    seen = jax.lax.cond(jnp.any(penalized_K), recount, lambda z: z, state.seen)
    return pinned(spec, dataclasses.replace(state, seen=seen))[0]


def _copy_pages(spec: Spec, state: DecodeState, src_K, dst_K):
    return pinned(spec, dataclasses.replace(
        state, kv=scatter_set(state.kv, (slice(None), dst_K), state.kv[:, src_K])))[0]


def _forward_rows(spec: Spec, params, kv, tokens_R, lengths_R, table_RW):
    """One token per row through the model: (pool, logits [R, V]), and with record_routes the
    token's experts [R, L, K]."""
    model = merge_params(spec.graphdef, params)
    x_R1D, cache, *routes = model.extend(tokens_R[:, None], lengths_R, spec.cache(kv, table_RW),
                                         routes=spec.cfg.record_routes)
    return (cache.kv, model.logits(x_R1D)[:, 0], *(r[:, 0] for r in routes))


def _advance(spec: Spec, state: DecodeState, logits_RV, slots_R, real_R, allowed_RW=None):
    """Samples each row's next token (within its token mask: serving/runner/constraints.py) and
    moves its slot on by one; padding rows (real_R false) leave their slots as they were."""
    rows = {n: getattr(state, n)[slots_R] for n in PER_SLOT}
    keys = slot_keys(rows["seeds"], rows["sample_index"], rows["counts"])
    has = spec.cfg.sampling_features.__contains__

    def adjust(logits_RV):
        if has("logit_bias"):
            logits_RV = with_bias(logits_RV, rows["bias_ids"], rows["bias_values"])
        if has("penalties"):
            logits_RV = with_penalties(logits_RV, rows["presence"], rows["frequency"],
                                       lambda: state.seen[slots_R])
        return logits_RV

    tokens_R, logprobs_R = sample(
        logits_RV, Draws(rows["temperature"], rows["top_k"], rows["top_p"], keys),
        _banned(rows["banned"], rows["min_tokens"], rows["counts"])
        if has("min_tokens") else None, allowed_RW if has("grammar") else None,
        adjust if has("logit_bias") or has("penalties") else None,
        top_k_top_p=has("top_k_top_p"))
    new = {"lengths": jnp.minimum(rows["lengths"] + 1, spec.cfg.max_len), "tokens": tokens_R,
           "counts": rows["counts"] + 1}
    seen = state.seen   # token counts: only penalties read them
    if has("penalties"):
        seen = seen.at[slots_R, tokens_R].add(real_R.astype(jnp.int32))
    state = dataclasses.replace(state, seen=seen, **{
        n: getattr(state, n).at[slots_R].set(jnp.where(real_R, v, rows[n]))
        for n, v in new.items()})
    return pinned(spec, state, tokens_R, logprobs_R)


def _decode(spec: Spec, params, state: DecodeState, table_RW, slots_R):
    """The forward half of one decode step for the rows `slots_R`: (state with their keys and
    values written, logits [R, V]). Padding rows read and write only the null page."""
    kv, logits_RV, *routes = _forward_rows(spec, params, state.kv, state.tokens[slots_R],
                                           state.lengths[slots_R], table_RW)
    return pinned(spec, dataclasses.replace(state, kv=kv), logits_RV, *routes)


def _decode_steps(spec: Spec, params, state: DecodeState, table_RW, slots_R, real_R,
                  steps: int):
    """`steps` whole decode steps (forward and sampling) in one program (steps_per_dispatch >
    1): (state, tokens [steps, R], logprobs [steps, R]), and with record_routes the fed
    tokens' experts [steps, R, L, K]."""
    def body(state, _):
        state, logits_RV, *routes = _decode(spec, params, state, table_RW, slots_R)
        state, tokens_R, logprobs_R = _advance(spec, state, logits_RV, slots_R, real_R)
        return state, (tokens_R, logprobs_R, *routes)

    state, out = jax.lax.scan(body, state, length=steps)
    return pinned(spec, state, *out)


# The most alternatives `score` returns per position (OpenAI's top_logprobs limit).
SCORE_TOP = 20


def _score(spec: Spec, params, tokens_T):
    """One sequence through the model, every position at once: the log-prob of each token
    given those before it, [T-1] (position i scores token i + 1), and the SCORE_TOP most
    likely tokens at each position, ids [T-1, 20] and log-probs. Causal: padding after the
    sequence changes none of its rows. No pages are read or written: prompt log-probs (`echo`)
    and top_logprobs."""
    model = merge_params(spec.graphdef, params)
    logits_TV = model(tokens_T[None])[0, :-1].astype(jnp.float32)
    logp_TV = jax.nn.log_softmax(logits_TV, axis=-1)
    token_T = jnp.take_along_axis(logp_TV, tokens_T[1:, None], axis=1)[:, 0]
    top_values, top_ids = jax.lax.top_k(logp_TV, min(SCORE_TOP, logp_TV.shape[-1]))
    rep = shd.replicated(spec.mesh)
    return tuple(jax.lax.with_sharding_constraint(a, rep)
                 for a in (token_T, top_ids, top_values))


# (function, static argument numbers, donated argument numbers), the spec not counted.
PROGRAMS = {
    "init": (empty_state, (), ()),
    "prefill": (_prefill, (), (1,)),
    "sample_first": (_sample_first, (), ()),
    "insert": (_insert, (), (0,)),
    "copy_pages": (_copy_pages, (), (0,)),
    "decode": (_decode, (), (1,)),
    "advance": (_advance, (), (0,)),
    "decode_steps": (_decode_steps, (5,), (1,)),
    "score": (_score, (), ()),
}
