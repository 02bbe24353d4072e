"""The engine's sizes, all fixed at compile time: slots, lengths, prefill chunks and budget,
pages, page-table widths, and the shapes of its calls that follow from them
(serving/runner/programs.py compiles one program per shape)."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax.numpy as jnp

from serving.runner.paged_kv import IMPLEMENTATIONS, KV_CACHE_DTYPES, table_width
from serving.runner.sampling import FEATURES

# An engine on a GPU or TPU, where the user sets none of these (`EngineConfig.for_platform`),
# is sized as vLLM sizes one: weights and pool within 90% of the device's memory
# (gpu_memory_utilization), as many slots as the pool holds prompts, up to 256 (max_num_seqs),
# bfloat16, and prompts prefilled in chunks of up to 512 tokens within 2,048 prompt tokens
# between two decode dispatches (vLLM's max_num_batched_tokens; one of Sarathi-Serve's token
# budgets). On CPU the fields' own defaults hold.
ACCELERATOR_DEFAULTS = {"memory_fraction": 0.9, "max_concurrent_decodes": 0,
                        "dtype": "bfloat16", "prefill_chunk": 512, "prefill_budget": 2048}
MAX_POOLED_SLOTS = 256        # max_concurrent_decodes=0: at most this many slots
# Speculative decoding's drafters (serving/core/drafts.py): "off", drafts from the prompt's
# group and earlier rollouts ("suffix"), or from the sequence itself ("ngram").
SPECULATIVE = ("off", "suffix", "ngram")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Sizes of the engine (all fixed at compile time). The one place an engine default is
    written: `jaxrl serve`'s flags hold the same (tests/test_cli.py checks), and an RL run's
    `rl.engine` is one of these, its lengths and chunks set from the run's own keys."""

    # Slots in the decode batch. 0: as many as the pool holds prompts of max_prefill_length,
    # up to MAX_POOLED_SLOTS (needs memory_fraction: the Engine sizes both from the device).
    max_concurrent_decodes: int = 32
    # Longest sequence (prompt + generated tokens): the width of a page table, a few integers
    # per slot; no memory is reserved per slot. Set it to the model's context.
    max_len: int = 128
    max_prefill_length: int = 64      # longest prompt accepted
    prefill_chunk: int = 16           # longer prompts are prefilled in chunks of this size
    # Prompt tokens the orchestrator prefills between two decode dispatches (Sarathi-Serve's
    # token budget): bounds how long running decodes wait while new requests are admitted.
    prefill_budget: int = 64
    min_bucket: int = 8               # smallest prefill padding bucket
    # Decode steps per dispatch in the orchestrator: fewer host round trips per token, at the
    # cost of up to this many steps before a finished slot is reused (vLLM's multi-step).
    steps_per_dispatch: int = 1
    dtype: str = "float32"            # weights and KV pool; bfloat16 on GPU/TPU
    # The KV pool's storage: auto (dtype) or fp8 (float8 e4m3, one byte a value: twice the
    # pages of a bf16 pool in the same memory, half the bytes a decode step reads; values are
    # clipped to e4m3's +-448 and rounded, with no scale, as vLLM's kv_cache_dtype=fp8 without
    # calibrated scales). Attention computes in `dtype`.
    kv_cache_dtype: str = "auto"
    page_size: int = 16               # tokens per KV page
    # Page-table widths per doubling: a step reads its longest row's pages rounded up to one of
    # these (4: at most 25% more than held, 4 programs per doubling; 1: up to 2x, 1 program).
    page_buckets: int = 4
    # Page tables are at least this many tokens wide: fewer programs to compile at start (one
    # per width and row size, about 0.5 s each for a small model on a CPU), at the cost of
    # reading more pages per step while sequences are short.
    min_table_tokens: int = 0
    # Pages in the pool, the null page included. 0: from memory_fraction if set, else enough
    # for every slot at max_len (no oversubscription).
    num_pages: int = 0
    # GPU/TPU: the weights, the pool and the largest call's activations within this fraction
    # of each device's memory (vLLM's gpu_memory_utilization); the pool takes what the others
    # leave. 0: unused.
    memory_fraction: float = 0.0
    # Attention over the pages (serving/runner/paged_kv.py). reference: gather the table's pages +
    # XLA attention, one program per table width, runs everywhere; loop: decode steps and
    # prefill chunks read the pages in a loop up to the last block a query sees, one program
    # for every width (fewer programs to compile, and faster on CPU); pallas: decode through
    # the Pallas paged-attention kernel (serving/runner/paged_attention.py), compiled by Mosaic on
    # TPU, run in Pallas's interpreter on CPU (to check it: far too slow to serve with),
    # refused on GPU; triton: decode through the Pallas GPU kernel (serving/runner/
    # paged_attention_gpu.py, flash decoding), lowered by Triton on GPU, plain XLA on CPU,
    # refused on TPU; native: as loop, in a C++ kernel through XLA's FFI (serving/runner/native),
    # CPU only, the fastest there.
    # auto: native on CPU (loop where no C++ compiler is found), reference on GPU and TPU.
    attention: str = "auto"
    # Compile `score` (serving/runner/programs.py) at start, one program per power-of-two length up
    # to max_len: log-probs of given tokens, for prompt log-probs (`echo`) and top_logprobs.
    score: bool = False
    # A mixture-of-experts model's routing: prefill and decode also return the experts each
    # token was routed to in each layer, and every sample comes back with them (Sample.routes),
    # for the trainer to compare with its own or replay (rl.moe_routing).
    record_routes: bool = False
    # What the sampling programs can do beyond temperature (serving/runner/sampling.py, FEATURES): a
    # request that needs more is refused. An RL run's engine compiles only what its own
    # sampling uses; a server, everything.
    sampling_features: tuple[str, ...] = FEATURES
    # Speculative decoding (serving/runner/speculate.py): in the tail, rows verify drafts of up
    # to `speculative_tokens` tokens proposed by a drafter without a model (SPECULATIVE),
    # several tokens a step, the sampled distribution exactly the engine's own; the engine
    # drafts half as far where that costs less a token (draft_lengths).
    speculative: str = "off"
    speculative_tokens: int = 4

    def __post_init__(self):
        unknown = [f for f in self.sampling_features if f not in FEATURES]
        if unknown:
            raise ValueError(f"sampling_features {unknown} unknown: each is one of {FEATURES}")
        if self.max_prefill_length >= self.max_len:
            raise ValueError(f"max_prefill_length={self.max_prefill_length} must be below "
                             f"max_len={self.max_len}")
        if self.prefill_chunk < self.min_bucket:
            raise ValueError(f"prefill_chunk={self.prefill_chunk} is below "
                             f"min_bucket={self.min_bucket}")
        if self.speculative not in SPECULATIVE:
            raise ValueError(f"speculative={self.speculative!r} is not one of {SPECULATIVE}")
        if self.speculative != "off" and not 1 <= self.speculative_tokens <= 16:
            raise ValueError(f"speculative_tokens={self.speculative_tokens} must be in [1, 16]")
        if self.speculative != "off" and self.record_routes:
            raise ValueError("speculative decoding does not record routes (record_routes): "
                             "a verify step's routing is not sent back")
        if self.max_concurrent_decodes == 0 and not self.memory_fraction:
            raise ValueError("max_concurrent_decodes=0 (as many slots as the pool holds) needs "
                             "memory_fraction: the pool sized from device memory")
        for name in ("prefill_budget", "steps_per_dispatch", "page_size", "page_buckets"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.max_concurrent_decodes < 0:
            raise ValueError(f"max_concurrent_decodes={self.max_concurrent_decodes} must be "
                             f">= 0 (0: as many as the pool holds)")
        if self.num_pages < 0:
            raise ValueError(f"num_pages={self.num_pages} must be >= 0 (0: sized for you)")
        if self.num_pages and self.num_pages < self.pages_per_sequence + 1:
            raise ValueError(f"num_pages={self.num_pages} cannot hold one sequence of max_len="
                             f"{self.max_len} tokens: that needs {self.pages_per_sequence} pages "
                             f"of {self.page_size} plus the null page")
        if not 0 <= self.memory_fraction < 1:
            raise ValueError(f"memory_fraction={self.memory_fraction} must be in [0, 1)")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not one of "
                             f"{tuple(KV_CACHE_DTYPES)}")
        if self.attention not in ("auto", *IMPLEMENTATIONS):
            raise ValueError(f"attention={self.attention!r} is not one of "
                             f"{('auto', *IMPLEMENTATIONS)}")

    @classmethod
    def for_platform(cls, platform: str, **given) -> "EngineConfig":
        """The engine `given` asks for, on `platform` ("cpu", "gpu", "tpu"): a field `given`
        leaves out takes ACCELERATOR_DEFAULTS' value on a GPU or TPU, its own default on CPU.
        A pool of `num_pages` given keeps slots at their default; prefill chunks stay within
        the longest prompt (rounded up to a power of two)."""
        if platform == "cpu":
            return cls(**given)
        auto = dict(ACCELERATOR_DEFAULTS)
        if given.get("num_pages") or given.get("memory_fraction") == 0:
            auto.pop("memory_fraction")
            auto.pop("max_concurrent_decodes")
        longest = given.get("max_prefill_length", cls.max_prefill_length)
        min_bucket = given.get("min_bucket", cls.min_bucket)
        auto["prefill_chunk"] = max(min_bucket, min(auto["prefill_chunk"],
                                                    1 << max(longest - 1, 1).bit_length()))
        return cls(**{**auto, **given})

    def with_pool(self, num_pages: int) -> "EngineConfig":
        """This config once its pool holds `num_pages` pages: slots 0 become as many as hold a
        prompt of max_prefill_length each (and one token more), up to MAX_POOLED_SLOTS."""
        if self.max_concurrent_decodes:
            return self
        per_prompt = math.ceil((self.max_prefill_length + 1) / self.page_size)
        slots = max(1, min(MAX_POOLED_SLOTS, (num_pages - 1) // per_prompt))
        return dataclasses.replace(self, max_concurrent_decodes=slots)

    @property
    def pool_dtype(self):
        """The KV pool's element type."""
        return jnp.dtype(KV_CACHE_DTYPES[self.kv_cache_dtype] or self.dtype)

    @property
    def pages_per_sequence(self) -> int:
        return math.ceil(self.max_len / self.page_size)

    # -- the shapes of the engine's calls (serving/runner/programs.py compiles each of them) --------
    @functools.cached_property
    def row_sizes(self) -> tuple[int, ...]:
        """Rows of a decode batch, an insert, a page copy or a first-token draw: S/16, S/4 or S
        of the S slots (always S up to 8 slots)."""
        s = self.max_concurrent_decodes
        return (s,) if s <= 8 else tuple(sorted({-(-s // 16), -(-s // 4), s}))

    def row_bucket(self, n: int) -> int:
        return self._row_buckets[n]

    @functools.cached_property
    def _row_buckets(self) -> tuple[int, ...]:
        """row_bucket(n) for every n up to the slots (the engine loop asks per step and row)."""
        return tuple(next(size for size in self.row_sizes if size >= n)
                     for n in range(self.max_concurrent_decodes + 1))

    @functools.cached_property
    def buckets(self) -> tuple[int, ...]:
        """Prefill chunk lengths: powers of two from min_bucket, then prefill_chunk."""
        return tuple(b for b in (self.min_bucket * 2**i for i in range(32))
                     if b < self.prefill_chunk) + (self.prefill_chunk,)

    @functools.cached_property
    def score_buckets(self) -> tuple[int, ...]:
        """Sequence lengths `score` is compiled for (none unless `score`): powers of two from
        16, then max_len."""
        if not self.score:
            return ()
        return tuple(b for b in (16 * 2**i for i in range(32)) if b < self.max_len) + (
            self.max_len,)

    def bucket(self, length: int) -> int:
        for b in self.buckets:
            if length <= b:
                return b
        raise ValueError(f"chunk of {length} tokens exceeds prefill_chunk={self.prefill_chunk}")

    def prefill_rows(self, bucket: int) -> int:
        """Rows of a prefill call whose longest chunk pads to `bucket`: the padded grid stays
        within the prefill budget (rounded up to a power of two), and a call has at most one
        row per slot."""
        grid = 1 << (max(self.prefill_budget, self.prefill_chunk) - 1).bit_length()
        return max(1, min(grid // bucket, self.max_concurrent_decodes))

    @property
    def max_prefill_rows(self) -> int:
        return self.prefill_rows(self.buckets[0])

    def table_width(self, tokens: int) -> int:
        """Page-table width of a decode call whose longest row needs `tokens` positions."""
        return self._width(tokens, self.page_buckets)

    def prefill_width(self, tokens: int) -> int:
        """Page-table width of a prefill call (one width per doubling: prefill is compute-bound
        and its programs are many)."""
        return self._width(tokens, 1)

    def _width(self, tokens: int, per_doubling: int) -> int:
        """The loop and native attentions read only the blocks their rows hold whatever the
        width: one width, the whole table."""
        if self.attention in ("loop", "native"):
            return self.pages_per_sequence
        return table_width(max(tokens, self.min_table_tokens), self.page_size,
                           self.pages_per_sequence, per_doubling)

    @functools.cached_property
    def decode_widths(self) -> tuple[int, ...]:
        ends = range(1, self.max_len + self.steps_per_dispatch + 1)
        return tuple(sorted({self.table_width(t) for t in ends}))

    @functools.cached_property
    def draft_lengths(self) -> tuple[int, ...]:
        """The draft lengths a verify program is compiled for: speculative_tokens, and half
        of it (serving/core/speculation.py chooses between them and decoding by load)."""
        if self.speculative == "off":
            return ()
        k = self.speculative_tokens
        return tuple(sorted({max(1, k // 2), k}))

    @functools.cached_property
    def verify_widths(self) -> tuple[int, ...]:
        """Widths of a verify call: its rows' next speculative_tokens + 1 positions."""
        if self.speculative == "off":
            return ()
        ends = range(1, self.max_len + self.speculative_tokens + 1)
        return tuple(sorted({self.table_width(t) for t in ends}))

    @functools.cached_property
    def prefill_widths(self) -> tuple[int, ...]:
        return tuple(sorted({self.prefill_width(t) for t in range(1, self.max_len + 1)}))
