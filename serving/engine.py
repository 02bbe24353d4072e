"""A generation engine in the shape of JetStream's Engine API, over a slot KV cache.

    prefix, first = engine.prefill(params, padded_tokens, true_length, sampling=...)
    state = engine.insert(prefix, state, slot, sampling, sample_index)
    state, tokens, logprobs = engine.generate(params, state)      # one token for every slot

The KV cache is `[layers, slots, max_len, kv_heads, head_dim]` in the serving dtype. A prompt
is prefilled in chunks of `prefill_chunk` tokens, each padded to a power-of-two bucket (one
compiled program per bucket); a chunk extends the prefix the previous chunk left, so the
orchestrator can interleave chunks with decode steps (Sarathi-Serve). `update_params` swaps the
weights between two `generate` calls and keeps every slot's cache (PipelineRL).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxrl.models import ModelConfig, abstract_model, merge_params, param_axes, split_params
from serving.sampling import SamplingParams, sample, slot_keys
from sharding import mesh as shd
from sharding.reshard import reshard

CACHE_AXES = ("layers", "batch", "length", "kv_heads", "head_dim")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Prefix:
    """The KV caches of P prompts (full length) and what to sample their first tokens from."""

    k: jax.Array          # [L, P, M, G, H]
    v: jax.Array
    length: jax.Array     # int32 [P]: prompt tokens in each row's cache
    logits: jax.Array     # float32 [P, V]: next-token logits after each row's last prompt token


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    """Everything `generate` needs about every slot."""

    k: jax.Array              # [L, S, M, G, H]
    v: jax.Array
    lengths: jax.Array        # int32 [S]: tokens in each slot's cache
    tokens: jax.Array         # int32 [S]: the token each slot feeds next
    counts: jax.Array         # int32 [S]: tokens sampled so far (drives the RNG)
    temperature: jax.Array    # float32 [S]
    top_k: jax.Array          # int32 [S]
    top_p: jax.Array          # float32 [S]
    seeds: jax.Array          # uint32 [S]
    sample_index: jax.Array   # int32 [S]: which of the request's n samples


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Sizes of the engine (all fixed at compile time)."""

    max_concurrent_decodes: int = 8   # slots in the decode batch
    max_len: int = 128                # KV cache length: prompt + generated tokens per slot
    max_prefill_length: int = 64      # longest prompt accepted
    prefill_chunk: int = 32           # longer prompts are prefilled in chunks of this size
    # Prompt tokens the orchestrator prefills between two decode dispatches (Sarathi-Serve's
    # token budget): bounds how long running decodes wait while new requests are admitted.
    prefill_budget: int = 64
    min_bucket: int = 8               # smallest prefill padding bucket
    # Decode steps per dispatch in the orchestrator: fewer host round trips per token, at the
    # cost of up to this many steps before a finished slot is reused (vLLM's multi-step).
    steps_per_dispatch: int = 1
    dtype: str = "float32"            # weights and KV cache; bfloat16 on GPU/TPU

    def __post_init__(self):
        if self.max_prefill_length >= self.max_len:
            raise ValueError(f"max_prefill_length={self.max_prefill_length} must be below "
                             f"max_len={self.max_len}")
        if self.prefill_chunk < self.min_bucket:
            raise ValueError(f"prefill_chunk={self.prefill_chunk} is below "
                             f"min_bucket={self.min_bucket}")
        if self.prefill_budget < 1:
            raise ValueError(f"prefill_budget={self.prefill_budget} must be >= 1")
        if self.steps_per_dispatch < 1:
            raise ValueError(f"steps_per_dispatch={self.steps_per_dispatch} must be >= 1")
        if self.max_concurrent_decodes < 1:
            raise ValueError(f"max_concurrent_decodes={self.max_concurrent_decodes} must be >= 1")


class Engine:
    def __init__(self, model_cfg: ModelConfig, cfg: EngineConfig = EngineConfig(),
                 mesh: Mesh | None = None):
        self.cfg = cfg
        self.model_cfg = dataclasses.replace(model_cfg, dtype=cfg.dtype, param_dtype=cfg.dtype,
                                             attention="xla")
        self.mesh = mesh or shd.make_mesh(shd.MeshConfig(fsdp=1), jax.devices()[:1])
        self.graphdef, abstract = split_params(abstract_model(self.model_cfg))
        shardings = shd.tree_shardings(param_axes(self.model_cfg), abstract, self.mesh)
        self.param_target = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
        c = self.model_cfg
        self.cache_shape = (c.num_layers, cfg.max_concurrent_decodes, cfg.max_len,
                            c.num_kv_heads, c.head_dim)
        self.cache_sharding = shd.logical_to_sharding(CACHE_AXES, self.cache_shape, self.mesh)
        self.buckets = tuple(b for b in (cfg.min_bucket * 2**i for i in range(32))
                             if b < cfg.prefill_chunk) + (cfg.prefill_chunk,)
        self.params = None
        self.version = -1

    # -- JetStream Engine API ------------------------------------------------------------------
    @property
    def max_concurrent_decodes(self) -> int:
        return self.cfg.max_concurrent_decodes

    @property
    def max_prefill_length(self) -> int:
        return self.cfg.max_prefill_length

    def load_params(self, params, version: int = 0):
        """Places `params` (a pure dict, any placement) on the serving mesh in the serving dtype
        and makes them current."""
        self.update_params(params, version)
        return self.params

    def prepare_params(self, params):
        """The expensive half of an update (checks, transfer, cast); safe in any thread."""
        return reshard(params, self.param_target)

    def update_params(self, params, version: int, *, prepared: bool = False) -> None:
        """Makes `params` current. Call it between two `generate` steps; slot caches are kept.
        A bad update raises WeightUpdateError and leaves the current weights in place."""
        self.params = params if prepared else self.prepare_params(params)
        self.version = version

    def init_decode_state(self) -> DecodeState:
        return jax.jit(self._empty_state, out_shardings=self._state_shardings())()

    def abstract_decode_state(self) -> DecodeState:
        """Shapes, dtypes and shardings of a decode state, no memory (ahead-of-time compiles)."""
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            jax.eval_shape(self._empty_state), self._state_shardings())

    def _empty_state(self) -> DecodeState:
        return _state_like(self.cfg.max_concurrent_decodes, self.cache_shape,
                           self.model_cfg.compute_dtype)

    def _state_shardings(self) -> DecodeState:
        out = jax.tree.map(lambda _: shd.replicated(self.mesh),
                           _state_like(self.cfg.max_concurrent_decodes))
        return dataclasses.replace(out, k=self.cache_sharding, v=self.cache_sharding)

    def bucket(self, length: int) -> int:
        for b in self.buckets:
            if length <= b:
                return b
        raise ValueError(f"chunk of {length} tokens exceeds prefill_chunk={self.cfg.prefill_chunk}")

    def prefill(self, params, padded_tokens, true_length: int, *,
                sampling: SamplingParams = SamplingParams(), existing_prefix: Prefix | None = None):
        """JetStream's prefill for one prompt: extends `existing_prefix` (or an empty one) by
        `padded_tokens[:true_length]`. Returns (prefix, (first_tokens [n], first_logprobs [n])):
        the first token of each of the request's n samples, drawn after the last prompt token."""
        prefix = self.prefill_batch(params, np.asarray(padded_tokens)[None], [true_length],
                                    existing_prefix)
        return prefix, self.sample_first(prefix, [0] * sampling.n, [sampling] * sampling.n,
                                         list(range(sampling.n)))

    def prefill_batch(self, params, tokens_PT, true_lengths, existing_prefix=None) -> Prefix:
        """Prefills P prompts (or the next chunk of each) in one call. Rows are padded to a
        power of two so that few programs are compiled; the prefix keeps the padding rows."""
        tokens_PT = np.asarray(tokens_PT, np.int32)
        p = tokens_PT.shape[0]
        rows = 1 << (p - 1).bit_length()
        lengths = np.ones(rows, np.int32)
        lengths[:p] = true_lengths
        tokens = np.zeros((rows, tokens_PT.shape[1]), np.int32)
        tokens[:p] = tokens_PT
        if existing_prefix is None:
            c = self.model_cfg
            shape = (c.num_layers, rows, self.cfg.max_len, c.num_kv_heads, c.head_dim)
            existing_prefix = Prefix(k=jnp.zeros(shape, c.compute_dtype),
                                     v=jnp.zeros(shape, c.compute_dtype),
                                     length=jnp.zeros((rows,), jnp.int32),
                                     logits=jnp.zeros((rows, c.vocab_size), jnp.float32))
        return self._prefill(params, existing_prefix, tokens, lengths)

    def sample_first(self, prefix: Prefix, rows, samplings, sample_indices):
        """First tokens and logprobs for K samples: entry i is drawn from prefix row `rows[i]`
        with `samplings[i]` as sample `sample_indices[i]` of its request."""
        args = _sampling_arrays(samplings, _pad_to_pow2(len(rows)))
        idx = _padded(rows, len(args[0]), np.int32)
        index = _padded(sample_indices, len(args[0]), np.int32)
        tokens, logprobs = self._sample_first(prefix.logits, idx, index, *args)
        return tokens[: len(rows)], logprobs[: len(rows)]

    def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int,
               sampling: SamplingParams = SamplingParams(), sample_index: int = 0,
               first_token=None, row: int = 0) -> DecodeState:
        """JetStream's insert: copies prefix row `row` into `slot`; the slot then decodes from
        `first_token` (the one prefill drew for this sample; default: the greedy one)."""
        if first_token is None:
            first_token = int(jnp.argmax(prefix.logits[row]))
        return self.insert_batch(prefix, decode_state, [slot], [row], [sampling],
                                 [sample_index], [first_token])

    def insert_batch(self, prefix: Prefix, decode_state: DecodeState, slots, rows, samplings,
                     sample_indices, first_tokens) -> DecodeState:
        """K inserts in one call: prefix row `rows[i]` goes to slot `slots[i]`."""
        k = _pad_to_pow2(len(slots))
        # Padding repeats the last insert: writing the same slot twice with the same data.
        return self._insert(decode_state, prefix, _padded(slots, k, np.int32),
                            _padded(rows, k, np.int32), _padded(first_tokens, k, np.int32),
                            *_sampling_arrays(samplings, k), _padded(sample_indices, k, np.int32))

    def generate(self, params, decode_state: DecodeState):
        """One decode step for every slot: (decode_state, tokens [S], logprobs [S])."""
        return self._generate(params, decode_state)

    def generate_steps(self, params, decode_state: DecodeState, steps: int):
        """`steps` decode steps in one dispatch: (decode_state, tokens [K, S], logprobs [K, S]),
        exactly what `steps` calls of `generate` would give."""
        return self._generate_steps(params, decode_state, steps)

    # -- compiled programs ---------------------------------------------------------------------
    @partial(jax.jit, static_argnums=0)
    def _prefill(self, params, prefix: Prefix, tokens_PT, true_lengths_P):
        model = merge_params(self.graphdef, params)
        x_PTD, k, v = model.extend(tokens_PT, prefix.length, prefix.k, prefix.v)
        last_PD = jnp.take_along_axis(x_PTD, (true_lengths_P - 1)[:, None, None], axis=1)
        logits_PV = model.logits(last_PD)[:, 0]
        return Prefix(k=k, v=v, length=prefix.length + true_lengths_P, logits=logits_PV)

    @partial(jax.jit, static_argnums=0)
    def _sample_first(self, logits_PV, rows_K, sample_index_K, temperature_K, top_k_K, top_p_K,
                      seeds_K):
        keys = slot_keys(seeds_K, sample_index_K, jnp.zeros_like(sample_index_K))
        return sample(logits_PV[rows_K], temperature_K, top_k_K, top_p_K, keys)

    @partial(jax.jit, static_argnums=0, donate_argnums=1)
    def _insert(self, state: DecodeState, prefix: Prefix, slots_K, rows_K, first_tokens_K,
                temperature_K, top_k_K, top_p_K, seeds_K, sample_index_K):
        at = lambda a, x: a.at[slots_K].set(x)  # noqa: E731
        return DecodeState(
            k=state.k.at[:, slots_K].set(prefix.k[:, rows_K]),
            v=state.v.at[:, slots_K].set(prefix.v[:, rows_K]),
            lengths=at(state.lengths, prefix.length[rows_K]), tokens=at(state.tokens, first_tokens_K),
            counts=at(state.counts, 1), temperature=at(state.temperature, temperature_K),
            top_k=at(state.top_k, top_k_K), top_p=at(state.top_p, top_p_K),
            seeds=at(state.seeds, seeds_K), sample_index=at(state.sample_index, sample_index_K))

    @partial(jax.jit, static_argnums=0, donate_argnums=2)
    def _generate(self, params, state: DecodeState):
        return self._step(params, state)

    @partial(jax.jit, static_argnums=(0, 3), donate_argnums=2)
    def _generate_steps(self, params, state: DecodeState, steps: int):
        def body(state, _):
            state, tokens, logprobs = self._step(params, state)
            return state, (tokens, logprobs)

        state, (tokens, logprobs) = jax.lax.scan(body, state, length=steps)
        return state, tokens, logprobs

    def _step(self, params, state: DecodeState):
        model = merge_params(self.graphdef, params)
        x_S1D, k, v = model.extend(state.tokens[:, None], state.lengths, state.k, state.v)
        logits_SV = model.logits(x_S1D)[:, 0]
        keys = slot_keys(state.seeds, state.sample_index, state.counts)
        tokens, logprobs = sample(logits_SV, state.temperature, state.top_k, state.top_p, keys)
        lengths = jnp.minimum(state.lengths + 1, self.cfg.max_len)
        state = dataclasses.replace(state, k=k, v=v, lengths=lengths, tokens=tokens,
                                    counts=state.counts + 1)
        return state, tokens, logprobs


def _pad_to_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _padded(values, k: int, dtype) -> np.ndarray:
    """`values` as an array of length k, the last value repeated."""
    values = list(values)
    return np.asarray(values + values[-1:] * (k - len(values)), dtype)


def _sampling_arrays(samplings, k: int):
    """Per-entry (temperature, top_k, top_p, seed) arrays of length k."""
    return (_padded([s.temperature for s in samplings], k, np.float32),
            _padded([s.top_k for s in samplings], k, np.int32),
            _padded([s.top_p for s in samplings], k, np.float32),
            _padded([s.seed for s in samplings], k, np.uint32))


def _state_like(s: int, cache_shape=None, dtype=jnp.float32) -> DecodeState:
    zeros = lambda d: jnp.zeros((s,), d)  # noqa: E731
    cache = jnp.zeros(cache_shape or (1,), dtype)
    return DecodeState(k=cache, v=cache, lengths=zeros(jnp.int32), tokens=zeros(jnp.int32),
                       counts=zeros(jnp.int32), temperature=zeros(jnp.float32),
                       top_k=zeros(jnp.int32), top_p=jnp.ones((s,), jnp.float32),
                       seeds=zeros(jnp.uint32), sample_index=zeros(jnp.int32))
