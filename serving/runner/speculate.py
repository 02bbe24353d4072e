"""Speculative decoding's verify step: each speculating row's last token and its draft (up to
K proposed tokens, serving/core/drafts.py) through the model at once, k+1 query tokens a row
against the paged KV, and the tokens kept sampled so that the distribution is exactly the
engine's own.

A draft from text (no draft model) is a point-mass proposal q = delta(x), so the rejection
rule of speculative sampling (Leviathan et al., Chen et al.; vLLM's rejection sampler for
model-free drafts) becomes: accept the drafted x with probability p(x) under the target; at
the first rejection draw from p with x removed and renormalised (max(p - q, 0), normalised);
after a fully accepted draft draw one more token from p. p is the very distribution the
engine's sampler draws from (serving/runner/sampling.py's `target`): temperature, top-k, top-p,
logit bias, presence and frequency penalties counted over the tokens accepted before each
position, min_tokens' ban at each position's count. A greedy row accepts x only where it is the
argmax and otherwise takes the argmax: token for token the engine without speculation. Rows
with a grammar do not speculate (their masks follow the tokens before them, on the host).

Randomness: position j of a row draws with the key its token would have had without
speculation (seed, sample index, count), and its accept test uses a key folded from that one:
a row with an empty draft draws exactly the token the plain decode step draws.

Every emitted token reports the log-prob the plain step reports (the model's, under
temperature, before bias, penalties and cuts): the behaviour log-probs the loss uses. Keys and
values are written for the fed tokens; those past the accepted ones lie beyond the row's new
length, are never read, and are overwritten as the sequence moves on (the scheduler frees
whole pages past it).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxrl.models import merge_params
from serving.runner.sampling import (inverse_cdf, slot_keys, target, with_bias,
                                     with_penalties)
from serving.runner.steps import PER_SLOT, Spec, _banned, adapter_rows, pinned


def _verify(spec: Spec, params, state, table_RW, slots_R, drafts_RK, real_R):
    """Rows `slots_R` feed their last token and their draft (`drafts_RK`, -1 past each draft's
    end): (state, tokens [R, K+1], log-probs [R, K+1], emitted [R]), row r's first emitted[r]
    tokens kept (its accepted draft tokens, then the one drawn after them); padding rows
    (real_R false) emit nothing and leave their slots as they were."""
    r, k = drafts_RK.shape
    rows = {n: getattr(state, n)[slots_R] for n in PER_SLOT}
    n_R = jnp.where(real_R, jnp.sum(drafts_RK >= 0, axis=1), 0)
    fed_RT = jnp.concatenate([rows["tokens"][:, None], jnp.maximum(drafts_RK, 0)], axis=1)
    model = merge_params(spec.graphdef, params)
    x_RTD, cache = model.extend(fed_RT, rows["lengths"], spec.cache(state.kv, table_RW),
                                valid_B=jnp.where(real_R, n_R + 1, 0),
                                adapters_B=adapter_rows(spec, rows["adapter"]))
    logits_NV = model.logits(x_RTD).reshape(r * (k + 1), -1)
    step_T = jnp.arange(k + 1)
    counts_RT = rows["counts"][:, None] + step_T[None, :]
    each = lambda a: jnp.repeat(a, k + 1, axis=0)  # noqa: E731  [R, ...] -> [R*(K+1), ...]
    p = target(logits_NV, each(rows["temperature"]), each(rows["top_k"]), each(rows["top_p"]),
               *_constraints(spec, state, slots_R, rows, drafts_RK, counts_RT, each))
    keys_N = slot_keys(each(rows["seeds"]), each(rows["sample_index"]), counts_RT.reshape(-1))
    # x_{j+1} (the draft's token at position j) against p_j
    proposed_N = jnp.concatenate([drafts_RK, jnp.full((r, 1), -1, jnp.int32)], 1).reshape(-1)
    has_N = proposed_N >= 0
    probs_NV = jax.nn.softmax(p.cut_SV, axis=-1)
    p_x_N = jnp.take_along_axis(probs_NV, jnp.maximum(proposed_N, 0)[:, None], axis=1)[:, 0]
    u_N = jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, 1)))(keys_N)
    accept_N = has_N & jnp.where(p.greedy_S, proposed_N == p.argmax_S, u_N < p_x_N)
    residual_NV = jnp.where(has_N[:, None] & (jnp.arange(probs_NV.shape[1]) ==
                                              proposed_N[:, None]), -jnp.inf, p.cut_SV)
    drawn_N = jnp.where(p.greedy_S, p.argmax_S, inverse_cdf(keys_N, residual_NV))
    # accepted: the leading run of accepted positions; the token after them is drawn
    accepted_R = jnp.sum(jnp.cumprod(accept_N.reshape(r, k + 1).astype(jnp.int32), axis=1),
                         axis=1)
    drafted_RT = jnp.concatenate([fed_RT[:, 1:], fed_RT[:, :1]], axis=1)   # last: unused
    tokens_RT = jnp.where(step_T[None, :] < accepted_R[:, None], drafted_RT,
                          drawn_N.reshape(r, k + 1))
    emitted_R = jnp.where(real_R, accepted_R + 1, 0)
    tokens_RT = jnp.where(step_T[None, :] < emitted_R[:, None], tokens_RT, -1)
    logprobs_RT = jnp.take_along_axis(p.logp_SV, jnp.maximum(tokens_RT, 0).reshape(-1, 1),
                                      axis=1).reshape(r, k + 1)
    last_R = jnp.take_along_axis(tokens_RT, jnp.maximum(emitted_R - 1, 0)[:, None], 1)[:, 0]
    new = {"lengths": jnp.minimum(rows["lengths"] + emitted_R, spec.cfg.max_len),
           "tokens": last_R, "counts": rows["counts"] + emitted_R}
    seen = state.seen
    if "penalties" in spec.cfg.sampling_features:
        slot_RT = jnp.where(tokens_RT >= 0, slots_R[:, None], seen.shape[0])
        seen = seen.at[slot_RT, jnp.maximum(tokens_RT, 0)].add(1, mode="drop")
    state = dataclasses.replace(state, kv=cache.kv, seen=seen, **{
        n: getattr(state, n).at[slots_R].set(jnp.where(real_R, v, rows[n]))
        for n, v in new.items()})
    return pinned(spec, state, tokens_RT, logprobs_RT, emitted_R)


def _constraints(spec: Spec, state, slots_R, rows, drafts_RK, counts_RT, each):
    """`target`'s ban, mask (none: grammar rows do not speculate) and adjustment at every
    position: min_tokens' ban at the position's count; logit bias; penalties over the tokens
    drawn so far and the draft's tokens before the position."""
    has = spec.cfg.sampling_features.__contains__
    r, k = drafts_RK.shape

    def seen():
        drafted_RKV = jax.nn.one_hot(drafts_RK, state.seen.shape[1], dtype=jnp.int32)
        before_RTV = jnp.concatenate([jnp.zeros_like(drafted_RKV[:, :1]),
                                      jnp.cumsum(drafted_RKV, axis=1)], axis=1)
        return (state.seen[slots_R][:, None] + before_RTV).reshape(r * (k + 1), -1)

    def adjust(logits_NV):
        if has("logit_bias"):
            logits_NV = with_bias(logits_NV, each(rows["bias_ids"]), each(rows["bias_values"]))
        if has("penalties"):
            logits_NV = with_penalties(logits_NV, each(rows["presence"]),
                                       each(rows["frequency"]), seen)
        return logits_NV

    banned = _banned(each(rows["banned"]), each(rows["min_tokens"]), counts_RT.reshape(-1)) \
        if has("min_tokens") else None
    return (banned, None, adjust if has("logit_bias") or has("penalties") else None,
            has("top_k_top_p"))


# (function, static argument numbers, donated argument numbers), the spec not counted.
PROGRAMS = {"verify": (_verify, (), (1,))}
