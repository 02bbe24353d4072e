"""The engine's programs as plain functions: what fixes them (`Spec`: model config, engine
config, mesh, pool size; equal specs share their executables), the state the decode programs
carry (`DecodeState`: the page pool and each slot's sampling state) and what each program
computes, as module-level functions of a Spec and their arguments, jitted and compiled per
shape by serving/runner/programs.py. Every output is pinned to one layout (`pinned`)."""

from __future__ import annotations

import dataclasses
import functools
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxrl.models import ModelConfig, abstract_model, merge_params, param_axes, split_params
from jaxrl.models import lora
from jaxrl.models.kv_cache import scatter_set
from jaxrl.models.transformer import run_layers
from serving.runner.paged_kv import KERNEL_PLATFORMS, PagedKV
from serving.runner.sampling import (MAX_LOGIT_BIAS, Draws, sample, slot_keys, with_bias,
                                     with_penalties)
from sharding import mesh as shd

POOL_AXES = ("layers", "pages", "page", "kv_heads", "head_dim")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    """The page pool and everything `generate` needs about every slot."""

    kv: jax.Array             # [L, P, K, 2G, H]: the pool (serving/runner/paged_kv.py)
    lengths: jax.Array        # int32 [S]: tokens of each slot's sequence in the pool
    tokens: jax.Array         # int32 [S]: the token each slot feeds next
    counts: jax.Array         # int32 [S]: tokens sampled so far (drives the RNG)
    temperature: jax.Array    # float32 [S]
    top_k: jax.Array          # int32 [S]
    top_p: jax.Array          # float32 [S]
    seeds: jax.Array          # uint32 [S]
    banned: jax.Array         # int32 [S]: the token (EOS) a slot may not draw before ...
    min_tokens: jax.Array     # int32 [S]: ... it has sampled this many (-1: no ban)
    sample_index: jax.Array   # int32 [S]: which of the request's n samples
    bias_ids: jax.Array       # int32 [S, MAX_LOGIT_BIAS]: logit_bias's tokens (-1: none) ...
    bias_values: jax.Array    # float32 [S, MAX_LOGIT_BIAS]: ... and their biases
    presence: jax.Array       # float32 [S]: presence_penalty ...
    frequency: jax.Array      # float32 [S]: ... and frequency_penalty, applied from ...
    seen: jax.Array           # int32 [S, V]: ... how often each slot has drawn each token
    adapter: jax.Array        # int32 [S]: the LoRA adapter set it decodes with (lora.adapters)


# What a decode batch gathers for its rows (`seen` is gathered only when a row is penalized).
PER_SLOT = tuple(f.name for f in dataclasses.fields(DecodeState) if f.name not in ("kv", "seen"))
# The per-slot fields a request's sampling parameters fill (serving.runner.engine's
# _sampling_arrays); the first token is drawn with them alone.
SAMPLING = ("temperature", "top_k", "top_p", "seeds", "banned", "min_tokens", "bias_ids",
            "bias_values")
# Each per-slot field's (dtype, shape after the slot axis): an insert's and a first draw's rows
# are dicts of arrays [K, ...] keyed by these names.
ROW_TYPES = {n: (jnp.int32, ()) for n in PER_SLOT} | {
    "temperature": (jnp.float32, ()), "top_p": (jnp.float32, ()), "seeds": (jnp.uint32, ()),
    "bias_ids": (jnp.int32, (MAX_LOGIT_BIAS,)), "bias_values": (jnp.float32, (MAX_LOGIT_BIAS,)),
    "presence": (jnp.float32, ()), "frequency": (jnp.float32, ())}


@dataclasses.dataclass(frozen=True)
class Spec:
    """What fixes every program of an engine: equal specs share their executables."""

    model_cfg: ModelConfig
    cfg: "EngineConfig"  # noqa: F821 (serving/runner/engine_config.py)
    mesh: Mesh
    num_pages: int

    @functools.cached_property
    def graphdef(self):
        return split_params(abstract_model(self.model_cfg))[0]

    @functools.cached_property
    def param_target(self):
        """ShapeDtypeStructs (with shardings) of the weights in the serving dtype and layout."""
        _, abstract = split_params(abstract_model(self.model_cfg))
        shardings = shd.tree_shardings(param_axes(self.model_cfg), abstract, self.mesh)
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            abstract, shardings)

    @property
    def pool_shape(self) -> tuple[int, ...]:
        c = self.model_cfg
        return (c.num_layers, self.num_pages, self.cfg.page_size, 2 * c.num_kv_heads,
                c.head_dim)

    def pool_sharding(self, pages: int | None = None):
        """The pool's sharding: over kv heads where the tensor axis divides them. Decided on
        the G kv heads, not the 2G interleaved ones, so a head's keys and values stay on one
        device."""
        c = self.model_cfg
        per_head = (c.num_layers, pages or self.num_pages, self.cfg.page_size, c.num_kv_heads,
                    c.head_dim)
        return shd.logical_to_sharding(POOL_AXES, per_head, self.mesh)

    def state_shardings(self) -> DecodeState:
        rep = shd.replicated(self.mesh)
        return DecodeState(kv=self.pool_sharding(), seen=rep, **{n: rep for n in PER_SLOT})

    def abstract_state(self) -> DecodeState:
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            jax.eval_shape(partial(empty_state, self)), self.state_shardings())

    def cache(self, kv, table) -> PagedKV:
        head_axis = (tuple(self.pool_sharding().spec) + (None,) * 5)[3]
        home = KERNEL_PLATFORMS.get(self.cfg.attention)
        return PagedKV(kv, table, self.cfg.attention, self.mesh, head_axis,
                       interpret=self.mesh.devices.flat[0].platform != home)


def empty_state(spec: Spec) -> DecodeState:
    s = spec.cfg.max_concurrent_decodes
    zeros = lambda d: jnp.zeros((s,), d)  # noqa: E731
    return pinned(spec, DecodeState(kv=jnp.zeros(spec.pool_shape, spec.cfg.pool_dtype),
                       lengths=zeros(jnp.int32), tokens=zeros(jnp.int32),
                       counts=zeros(jnp.int32), temperature=zeros(jnp.float32),
                       top_k=zeros(jnp.int32), top_p=zeros(jnp.float32),
                       seeds=zeros(jnp.uint32), banned=zeros(jnp.int32) - 1,
                       min_tokens=zeros(jnp.int32), sample_index=zeros(jnp.int32),
                       bias_ids=jnp.full((s, MAX_LOGIT_BIAS), -1, jnp.int32),
                       bias_values=jnp.zeros((s, MAX_LOGIT_BIAS), jnp.float32),
                       presence=zeros(jnp.float32), frequency=zeros(jnp.float32),
                       seen=jnp.zeros((s, spec.model_cfg.vocab_size), jnp.int32),
                       adapter=zeros(jnp.int32)))[0]


# Every output is pinned to one layout (the pool over kv heads, everything else replicated):
# each program is compiled for the layouts the others produce, ahead of time.
def pinned(spec: Spec, state: DecodeState, *arrays):
    rep = shd.replicated(spec.mesh)
    state = jax.lax.with_sharding_constraint(state, spec.state_shardings())
    return (state, *(jax.lax.with_sharding_constraint(a, rep) for a in arrays))


# -- the programs ----------------------------------------------------------------------------------

# Generated tokens an insert counts per call for a penalized sample (a longer history, from a
# preempted or carried-over sample, takes more calls).
HISTORY_CHUNK = 32


def adapter_rows(spec: Spec, adapters_B):
    """Each row's LoRA adapter set for `Transformer.extend`, where the model holds several."""
    return adapters_B if spec.model_cfg.lora.adapters > 1 else None


def _prefill(spec: Spec, params, state: DecodeState, tokens_PT, starts_P, lengths_P, table_PW,
             adapters_P):
    """(state, logits [max_prefill_rows, V]), and with record_routes each token's experts
    [P, T, L, K] after them."""
    model = merge_params(spec.graphdef, params)
    x_PTD, cache, *routes = model.extend(tokens_PT, starts_P, spec.cache(state.kv, table_PW),
                                         valid_B=lengths_P, routes=spec.cfg.record_routes,
                                         adapters_B=adapter_rows(spec, adapters_P))
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


def _forward_rows(spec: Spec, params, kv, tokens_R, lengths_R, table_RW, adapters_R):
    """One token per row through the model: (pool, logits [R, V]), and with record_routes the
    token's experts [R, L, K]."""
    model = merge_params(spec.graphdef, params)
    x_R1D, cache, *routes = model.extend(tokens_R[:, None], lengths_R, spec.cache(kv, table_RW),
                                         routes=spec.cfg.record_routes,
                                         adapters_B=adapter_rows(spec, adapters_R))
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
                                           state.lengths[slots_R], table_RW,
                                           state.adapter[slots_R])
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


def _score(spec: Spec, params, tokens_T, adapter):
    """One sequence through the model, every position at once: the log-prob of each token
    given those before it, [T-1] (position i scores token i + 1), and the SCORE_TOP most
    likely tokens at each position, ids [T-1, 20] and log-probs. Causal: padding after the
    sequence changes none of its rows. No pages are read or written: prompt log-probs (`echo`)
    and top_logprobs."""
    model = merge_params(spec.graphdef, params)
    rows = adapter_rows(spec, adapter[None])
    stack = None if rows is None else lora.rows_stack(run_layers, rows)
    logits_TV = model.logits(model.hidden(tokens_T[None], stack_fn=stack))[0, :-1]
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
