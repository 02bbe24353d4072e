"""The model runner: JetStream's Engine API shape (prefill, insert, generate) over a paged KV
cache, as compiled programs. It holds no bookkeeping of its own: which pages and slots a
sequence has is the scheduler's (serving/scheduler.py), passed in as page tables.

    state = engine.init_decode_state()                        # the page pool + per-slot state
    state, logits = engine.prefill(params, state, tokens, starts, lengths, table)
    tokens, logprobs = engine.sample_first(logits, rows, samplings, sample_indices)
    state = engine.insert(state, slots, lengths, next_tokens, counts, samplings, indices)
    state, tokens, logprobs = engine.generate_steps(params, state, table, steps)

Prefill writes a chunk of each row's prompt straight into that row's pages and attends over
the pages before it (Sarathi-Serve's chunked prefill); decode does the same with one token per
slot. Both run `Transformer.extend` on a `PagedKV`, sized to the longest row they hold (a page
table width from a few buckets per doubling), so a step's cost follows the tokens held, not
`max_len`.
`update_params` swaps the weights between two steps and keeps every page (PipelineRL).
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxrl.models import ModelConfig, abstract_model, merge_params, param_axes, split_params
from serving.paged_kv import IMPLEMENTATIONS, PagedKV, table_width
from serving.sampling import sample, slot_keys
from sharding import mesh as shd
from sharding.reshard import reshard

POOL_AXES = ("layers", "pages", "page", "kv_heads", "head_dim")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    """The page pool and everything `generate` needs about every slot."""

    kv: jax.Array             # [L, P, K, 2G, H]: the pool (serving/paged_kv.py)
    lengths: jax.Array        # int32 [S]: tokens of each slot's sequence in the pool
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
    # Longest sequence (prompt + generated tokens): the width of a page table, a few integers
    # per slot; no memory is reserved per slot. Set it to the model's context.
    max_len: int = 128
    max_prefill_length: int = 64      # longest prompt accepted
    prefill_chunk: int = 32           # longer prompts are prefilled in chunks of this size
    # Prompt tokens the orchestrator prefills between two decode dispatches (Sarathi-Serve's
    # token budget): bounds how long running decodes wait while new requests are admitted.
    prefill_budget: int = 64
    min_bucket: int = 8               # smallest prefill padding bucket
    # Decode steps per dispatch in the orchestrator: fewer host round trips per token, at the
    # cost of up to this many steps before a finished slot is reused (vLLM's multi-step).
    steps_per_dispatch: int = 1
    dtype: str = "float32"            # weights and KV pool; bfloat16 on GPU/TPU
    page_size: int = 16               # tokens per KV page
    # Page-table widths per doubling: a step reads its longest row's pages rounded up to one of
    # these (4: at most 25% more than held, 4 programs per doubling; 1: up to 2x, 1 program).
    page_buckets: int = 4
    # Pages in the pool, the null page included. 0: from memory_fraction if set, else enough
    # for every slot at max_len (no oversubscription).
    num_pages: int = 0
    # GPU/TPU: size the pool to this fraction of the device memory free once the weights are
    # loaded (vLLM's gpu_memory_utilization, applied to what is left). 0: unused.
    memory_fraction: float = 0.0
    # Attention over the pages (serving/paged_kv.py). reference: gather + XLA attention, runs
    # everywhere; pallas: decode through the Pallas paged-attention kernel (serving/
    # paged_attention.py), compiled by Mosaic on TPU, run in Pallas's interpreter on CPU (to
    # check it: far too slow to serve with); refused on GPU, where reference is the path.
    attention: str = "reference"

    def __post_init__(self):
        if self.max_prefill_length >= self.max_len:
            raise ValueError(f"max_prefill_length={self.max_prefill_length} must be below "
                             f"max_len={self.max_len}")
        if self.prefill_chunk < self.min_bucket:
            raise ValueError(f"prefill_chunk={self.prefill_chunk} is below "
                             f"min_bucket={self.min_bucket}")
        for name in ("prefill_budget", "steps_per_dispatch", "max_concurrent_decodes",
                     "page_size", "page_buckets"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.num_pages < 0:
            raise ValueError(f"num_pages={self.num_pages} must be >= 0 (0: sized for you)")
        if self.num_pages and self.num_pages < self.pages_per_sequence + 1:
            raise ValueError(f"num_pages={self.num_pages} cannot hold one sequence of max_len="
                             f"{self.max_len} tokens: that needs {self.pages_per_sequence} pages "
                             f"of {self.page_size} plus the null page")
        if not 0 <= self.memory_fraction < 1:
            raise ValueError(f"memory_fraction={self.memory_fraction} must be in [0, 1)")
        if self.attention not in IMPLEMENTATIONS:
            raise ValueError(f"attention={self.attention!r} is not one of {IMPLEMENTATIONS}")

    @property
    def pages_per_sequence(self) -> int:
        return math.ceil(self.max_len / self.page_size)

    def row_bucket(self, busy: int) -> int:
        """Rows of a decode batch for `busy` slots: S/16, S/4 or S of the S slots (always S up
        to 8 slots), so 3 programs per page-table width."""
        s = self.max_concurrent_decodes
        sizes = (s,) if s <= 8 else (-(-s // 16), -(-s // 4), s)
        return next(size for size in sizes if size >= busy)

    def table_width(self, tokens: int) -> int:
        """Page-table width of a call whose longest row needs `tokens` positions."""
        return table_width(tokens, self.page_size, self.pages_per_sequence, self.page_buckets)


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
        self.buckets = tuple(b for b in (cfg.min_bucket * 2**i for i in range(32))
                             if b < cfg.prefill_chunk) + (cfg.prefill_chunk,)
        self.num_pages = cfg.num_pages or (
            self._pages_from_memory() if cfg.memory_fraction else
            cfg.max_concurrent_decodes * cfg.pages_per_sequence + 1)
        c = self.model_cfg
        platform = self.mesh.devices.flat[0].platform
        if cfg.attention == "pallas" and platform not in ("tpu", "cpu"):
            raise ValueError(f"attention='pallas' is a TPU (Mosaic) kernel; on {platform} use "
                             f"attention='reference'")
        self.pool_shape = (c.num_layers, self.num_pages, cfg.page_size, 2 * c.num_kv_heads,
                           c.head_dim)
        self.pool_sharding = self._pool_sharding(self.num_pages)
        self.params = None
        self.version = -1

    def _pages_from_memory(self) -> int:
        """Pages that fit in `memory_fraction` of the free memory of the most loaded device
        (the pool is sharded over kv heads where the tensor axis divides them, so a device
        holds its shard of every page)."""
        stats = [d.memory_stats() for d in self.mesh.devices.flat]
        if any(s is None or "bytes_limit" not in s for s in stats):
            raise ValueError(f"memory_fraction={self.cfg.memory_fraction}: the "
                             f"{self.mesh.devices.flat[0].platform} backend reports no device "
                             f"memory; set num_pages instead")
        free = min(s["bytes_limit"] - s["bytes_in_use"] for s in stats)
        c = self.model_cfg
        page = (c.num_layers, 1, self.cfg.page_size, 2 * c.num_kv_heads, c.head_dim)
        share = math.prod(self._pool_sharding(1).shard_shape(page)) * \
            jnp.dtype(c.compute_dtype).itemsize
        return max(int(self.cfg.memory_fraction * free) // share, 2)

    def _pool_sharding(self, pages: int):
        """The pool's sharding: over kv heads where the tensor axis divides them. Decided on
        the G kv heads, not the 2G interleaved ones, so a head's keys and values stay on one
        device."""
        c = self.model_cfg
        per_head = (c.num_layers, pages, self.cfg.page_size, c.num_kv_heads, c.head_dim)
        return shd.logical_to_sharding(POOL_AXES, per_head, self.mesh)

    def _cache(self, state: "DecodeState", table) -> PagedKV:
        spec = tuple(self.pool_sharding.spec) + (None,) * 5
        return PagedKV(state.kv, table, self.cfg.attention, self.mesh, spec[3],
                       interpret=self.mesh.devices.flat[0].platform != "tpu")

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
        """Makes `params` current. Call it between two `generate` steps; the pool is kept.
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
        s = self.cfg.max_concurrent_decodes
        zeros = lambda d: jnp.zeros((s,), d)  # noqa: E731
        pool = jnp.zeros(self.pool_shape, self.model_cfg.compute_dtype)
        return DecodeState(kv=pool, lengths=zeros(jnp.int32), tokens=zeros(jnp.int32),
                           counts=zeros(jnp.int32), temperature=zeros(jnp.float32),
                           top_k=zeros(jnp.int32), top_p=zeros(jnp.float32),
                           seeds=zeros(jnp.uint32), sample_index=zeros(jnp.int32))

    def _state_shardings(self) -> DecodeState:
        rep = shd.replicated(self.mesh)
        fields = {f.name: rep for f in dataclasses.fields(DecodeState)}
        return DecodeState(**{**fields, "kv": self.pool_sharding})

    def bucket(self, length: int) -> int:
        for b in self.buckets:
            if length <= b:
                return b
        raise ValueError(f"chunk of {length} tokens exceeds prefill_chunk={self.cfg.prefill_chunk}")

    def prefill(self, params, state: DecodeState, tokens_PT, starts_P, lengths_P, table_PW):
        """Writes the next chunk of P prompts into their pages: row i's `lengths_P[i]` tokens
        sit at positions starts_P[i].. and go into the pages of `table_PW[i]`. Returns
        (state, logits [P, V] after each row's last token). Rows are padded to a power of two
        (padding rows write only to the null page) so that few programs are compiled."""
        tokens_PT = np.asarray(tokens_PT, np.int32)
        p = tokens_PT.shape[0]
        rows = _pad_to_pow2(p)
        pad = lambda a, dtype: np.concatenate(  # noqa: E731
            [np.asarray(a, dtype), np.zeros((rows - p, *np.shape(a)[1:]), dtype)])
        state, logits = self._prefill(params, state, pad(tokens_PT, np.int32),
                                      pad(starts_P, np.int32), pad(lengths_P, np.int32),
                                      pad(table_PW, np.int32))
        return state, logits[:p]

    def sample_first(self, logits_PV, rows, samplings, sample_indices):
        """First tokens and logprobs for K samples: entry i is drawn from logits row `rows[i]`
        with `samplings[i]` as sample `sample_indices[i]` of its request."""
        args = _sampling_arrays(samplings, _pad_to_pow2(len(rows)))
        idx = _padded(rows, len(args[0]), np.int32)
        index = _padded(sample_indices, len(args[0]), np.int32)
        tokens, logprobs = self._sample_first(logits_PV, idx, index, *args)
        return tokens[: len(rows)], logprobs[: len(rows)]

    def insert(self, state: DecodeState, slots, lengths, next_tokens, counts, samplings,
               sample_indices) -> DecodeState:
        """JetStream's insert for K sequences whose pages are written: slot `slots[i]` decodes
        on from `next_tokens[i]` at position `lengths[i]`, having sampled `counts[i]` tokens.
        Nothing is copied: the slot reaches its pages through the page table."""
        k = _pad_to_pow2(len(slots))
        # Padding repeats the last insert: writing the same slot twice with the same data.
        return self._insert(state, _padded(slots, k, np.int32), _padded(lengths, k, np.int32),
                            _padded(next_tokens, k, np.int32), _padded(counts, k, np.int32),
                            *_sampling_arrays(samplings, k), _padded(sample_indices, k, np.int32))

    def copy_pages(self, state: DecodeState, src, dst) -> DecodeState:
        """Pool page src[i] copied to dst[i] in every layer (the partly filled last prompt page
        of a group, once per sample beyond the first)."""
        k = _pad_to_pow2(len(src))
        return self._copy_pages(state, _padded(src, k, np.int32), _padded(dst, k, np.int32))

    def generate(self, params, state: DecodeState, table_SW):
        """One decode step for every slot: (state, tokens [S], logprobs [S])."""
        state, tokens, logprobs = self.generate_steps(params, state, table_SW, 1)
        return state, tokens[0], logprobs[0]

    def generate_steps(self, params, state: DecodeState, table_SW, steps: int, slots=None):
        """`steps` decode steps in one dispatch: (state, tokens [K, S], logprobs [K, S]). The
        page table must already hold the pages the steps write.

        With `slots` (R of them, table_SW then [R, W] in the same order), only those slots are
        decoded: their rows are gathered into a batch of S/16, S/4 or S rows (S slots; always S
        when S <= 8), padded with rows of other slots that read and write only the null page and
        whose state is left as it was (another batch of the same step may be decoding them). A
        long tail with few busy slots then costs those rows, not every slot. Returns tokens and
        logprobs [K, R]."""
        table = np.asarray(table_SW, np.int32)
        if slots is None:
            return self._generate_steps(params, state, table, steps)
        slots = list(slots)
        rows = self.cfg.row_bucket(len(slots))
        taken = set(slots)
        idle = [s for s in range(self.cfg.max_concurrent_decodes) if s not in taken]
        padded = np.asarray(slots + idle[: rows - len(slots)], np.int32)
        table = np.concatenate([table, np.zeros((rows - len(slots), table.shape[1]), np.int32)])
        real = np.arange(rows) < len(slots)
        state, tokens, logprobs = self._generate_rows(params, state, table, padded, real, steps)
        return state, tokens[:, : len(slots)], logprobs[:, : len(slots)]

    # -- compiled programs ---------------------------------------------------------------------
    @partial(jax.jit, static_argnums=0, donate_argnums=2)
    def _prefill(self, params, state: DecodeState, tokens_PT, starts_P, lengths_P, table_PW):
        model = merge_params(self.graphdef, params)
        cache = self._cache(state, table_PW)
        x_PTD, cache = model.extend(tokens_PT, starts_P, cache, valid_B=lengths_P)
        last_P11 = jnp.maximum(lengths_P - 1, 0)[:, None, None]
        logits_PV = model.logits(jnp.take_along_axis(x_PTD, last_P11, axis=1))[:, 0]
        return dataclasses.replace(state, kv=cache.kv), logits_PV

    @partial(jax.jit, static_argnums=0)
    def _sample_first(self, logits_PV, rows_K, sample_index_K, temperature_K, top_k_K, top_p_K,
                      seeds_K):
        keys = slot_keys(seeds_K, sample_index_K, jnp.zeros_like(sample_index_K))
        return sample(logits_PV[rows_K], temperature_K, top_k_K, top_p_K, keys)

    @partial(jax.jit, static_argnums=0, donate_argnums=1)
    def _insert(self, state: DecodeState, slots_K, lengths_K, tokens_K, counts_K, temperature_K,
                top_k_K, top_p_K, seeds_K, sample_index_K):
        at = lambda a, x: a.at[slots_K].set(x)  # noqa: E731
        return dataclasses.replace(
            state, lengths=at(state.lengths, lengths_K), tokens=at(state.tokens, tokens_K),
            counts=at(state.counts, counts_K), temperature=at(state.temperature, temperature_K),
            top_k=at(state.top_k, top_k_K), top_p=at(state.top_p, top_p_K),
            seeds=at(state.seeds, seeds_K), sample_index=at(state.sample_index, sample_index_K))

    @partial(jax.jit, static_argnums=0, donate_argnums=1)
    def _copy_pages(self, state: DecodeState, src_K, dst_K):
        return dataclasses.replace(state, kv=state.kv.at[:, dst_K].set(state.kv[:, src_K]))

    @partial(jax.jit, static_argnums=(0, 4), donate_argnums=2)
    def _generate_steps(self, params, state: DecodeState, table_SW, steps: int):
        return self._scan_steps(params, state, table_SW, steps)

    @partial(jax.jit, static_argnums=(0, 6), donate_argnums=2)
    def _generate_rows(self, params, state: DecodeState, table_RW, slots_R, real_R, steps: int):
        per_slot = [f.name for f in dataclasses.fields(DecodeState) if f.name != "kv"]
        before = {n: getattr(state, n)[slots_R] for n in per_slot}
        rows = dataclasses.replace(state, **before)
        rows, tokens, logprobs = self._scan_steps(params, rows, table_RW, steps)

        def kept(name):   # padding rows keep their slots' state: only the real rows advance
            new, old = getattr(rows, name), before[name]
            real = real_R.reshape(real_R.shape + (1,) * (new.ndim - 1))
            return jnp.where(real, new, old)

        state = dataclasses.replace(state, kv=rows.kv, **{
            n: getattr(state, n).at[slots_R].set(kept(n)) for n in per_slot})
        return state, tokens, logprobs

    def _scan_steps(self, params, state: DecodeState, table_SW, steps: int):
        def body(state, _):
            state, tokens, logprobs = self._step(params, state, table_SW)
            return state, (tokens, logprobs)

        state, (tokens, logprobs) = jax.lax.scan(body, state, length=steps)
        return state, tokens, logprobs

    def _step(self, params, state: DecodeState, table_SW):
        model = merge_params(self.graphdef, params)
        cache = self._cache(state, table_SW)
        x_S1D, cache = model.extend(state.tokens[:, None], state.lengths, cache)
        logits_SV = model.logits(x_S1D)[:, 0]
        keys = slot_keys(state.seeds, state.sample_index, state.counts)
        tokens, logprobs = sample(logits_SV, state.temperature, state.top_k, state.top_p, keys)
        lengths = jnp.minimum(state.lengths + 1, self.cfg.max_len)
        state = dataclasses.replace(state, kv=cache.kv, lengths=lengths, tokens=tokens,
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
