"""The model runner: JetStream's Engine API shape (prefill, insert, generate) over a paged KV
cache, as compiled programs. It holds no bookkeeping of its own: which pages and slots a
sequence has is the scheduler's (serving/core/scheduler.py), passed in as page tables.

    state = engine.init_decode_state()                        # the page pool + per-slot state
    state, logits = engine.prefill(params, state, tokens, starts, lengths, table)
    tokens, logprobs = engine.sample_first(logits, rows, samplings, sample_indices)
    state = engine.insert(state, SlotBatch(slots, lengths, next_tokens, counts, samplings,
                                           indices))
    state, tokens, logprobs = engine.generate_steps(params, state, table, steps)
    state, decoded = engine.dispatch_steps(params, state, table, steps)   # read back later

Prefill writes a chunk of each row's prompt straight into that row's pages and attends over
the pages before it (Sarathi-Serve's chunked prefill); decode does the same with one token per
slot. Both run `Transformer.extend` on a `PagedKV`, sized to the longest row they hold (a page
table width from a few buckets per doubling), so a step's cost follows the tokens held, not
`max_len`.
The engine holds no weights: `prepare_params` places a set, every call takes one, and the
orchestrator swaps them between two steps, keeping every page (PipelineRL). Its programs are
compiled once per shape, before serving starts (serving/runner/programs.py).
"""

from __future__ import annotations

import dataclasses
import math
import threading

import jax
import numpy as np
from jax.sharding import Mesh

from jaxrl.models import ModelConfig, lora
from serving.runner.constraints import mask_words
from serving.runner.engine_config import MAX_POOLED_SLOTS, EngineConfig
from serving.runner.paged_kv import choose_attention
from serving.runner.programs import Programs, programs_for
from serving.runner.slot_batch import SlotBatch, padded, sampling_rows
from serving.runner.steps import DecodeState, Spec
from sharding import mesh as shd
from sharding.reshard import reshard

__all__ = ["DecodeState", "Decoded", "Engine", "EngineConfig", "SlotBatch"]


class Engine:
    """The programs of one model on one mesh, and the host-side padding of their arguments.
    It holds no weights: the caller passes them to every call (the orchestrator owns them)."""

    def __init__(self, model_cfg: ModelConfig, cfg: EngineConfig = EngineConfig(),
                 mesh: Mesh | None = None):
        self.model_cfg = dataclasses.replace(model_cfg, dtype=cfg.dtype, param_dtype=cfg.dtype,
                                             attention="xla")
        self.mesh = mesh or shd.make_mesh(shd.MeshConfig(fsdp=1), jax.devices()[:1])
        platform = self.mesh.devices.flat[0].platform
        cfg = dataclasses.replace(cfg, attention=choose_attention(cfg.attention, platform))
        if cfg.record_routes and not model_cfg.num_experts:
            raise ValueError(f"record_routes needs a mixture-of-experts model; "
                             f"model.family={model_cfg.family} has no experts")
        self.num_pages = cfg.num_pages or (
            self._pages_from_memory(cfg) if cfg.memory_fraction else
            cfg.max_concurrent_decodes * cfg.pages_per_sequence + 1)
        self.cfg = cfg = cfg.with_pool(self.num_pages)
        self.spec = Spec(self.model_cfg, cfg, self.mesh, self.num_pages)
        self.programs: Programs = programs_for(self.spec)
        self.graphdef = self.spec.graphdef
        self.param_target = self.spec.param_target
        self.pool_shape = self.spec.pool_shape
        self.pool_sharding = self.spec.pool_sharding()
        self.buckets = cfg.buckets
        self._all_allowed_masks: dict[int, jax.Array] = {}    # rows -> all-allowed masks

    def _pages_from_memory(self, cfg: EngineConfig, stats: list[dict] | None = None) -> int:
        """Pages that fit beside the weights and the largest call's activations within
        `memory_fraction` of each device's memory (vLLM's gpu_memory_utilization), on the most
        loaded device. The weights count once whether they are placed yet or not (the larger
        of the memory in use and their share); the pool is sharded over kv heads where the
        tensor axis divides them, so a device holds its shard of every page. `stats`: each
        device's `memory_stats()` (read from the devices when None)."""
        stats = stats or [d.memory_stats() for d in self.mesh.devices.flat]
        if any(s is None or "bytes_limit" not in s for s in stats):
            raise ValueError(f"memory_fraction={cfg.memory_fraction}: the "
                             f"{self.mesh.devices.flat[0].platform} backend reports no device "
                             f"memory; set num_pages instead")
        c, probe = self.model_cfg, Spec(self.model_cfg, cfg, self.mesh, 1)
        weights = sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
                      for a in jax.tree.leaves(probe.param_target))
        room = min(cfg.memory_fraction * s["bytes_limit"] - max(s["bytes_in_use"], weights)
                   for s in stats) - _activations(c, cfg)
        page = (c.num_layers, 1, cfg.page_size, 2 * c.num_kv_heads, c.head_dim)
        share = math.prod(probe.pool_sharding(1).shard_shape(page)) * cfg.pool_dtype.itemsize
        pages = int(room) // share
        if pages < cfg.pages_per_sequence + 1:
            raise ValueError(f"memory_fraction={cfg.memory_fraction} leaves room for {pages} KV "
                             f"pages beside the weights ({weights / 2**30:.2f} GiB a device); "
                             f"one sequence of max_len={cfg.max_len} needs "
                             f"{cfg.pages_per_sequence + 1}")
        return pages

    def compile(self, largest_only: bool = False) -> int:
        """Compiles every program the engine can run, on this thread (serving/runner/programs.py;
        `largest_only`: those its largest batches and prefill chunks need, `compile_wanted`
        the others as calls ask for them); returns how many were compiled now (0 when an
        engine of the same spec did it)."""
        return self.programs.compile_all(largest_only)

    def compile_wanted(self, stop: threading.Event) -> int:
        """Compiles, beside the running engine, the programs of smaller batches and chunks as
        calls ask for them (serving/runner/programs.py); until they are, those calls run padded."""
        return self.programs.compile_wanted(stop)

    # -- JetStream Engine API ------------------------------------------------------------------
    @property
    def max_concurrent_decodes(self) -> int:
        return self.cfg.max_concurrent_decodes

    @property
    def max_prefill_length(self) -> int:
        return self.cfg.max_prefill_length

    def prepare_params(self, params, *, pulled: bool = False):
        """`params` (a pure dict, any placement) checked, placed on the serving mesh and cast
        to the serving dtype: what every call takes. Safe in any thread; a bad tree, shape,
        dtype or a NaN raises WeightUpdateError before anything is copied (`pulled`: a pull's
        arrays, checked for NaN already and placed without a copy: sharding/reshard.py). A model
        with LoRA adapters also takes exactly its adapters (`adapters_only`): an update of those
        alone, the base kept."""
        target = lora.trainable(self.param_target) if self.adapters_only(params) else \
            self.param_target
        return reshard(params, target, pulled=pulled)

    def adapters_only(self, params) -> bool:
        """Whether `params` names this model's adapters and nothing else: an update that
        replaces the adapters and keeps the base (`prepare_params` then checks it holds every
        adapter)."""
        if not self.model_cfg.lora.enabled or set(params) != {"layers"}:
            return False
        names = set(params["layers"])
        return bool(names) and names <= set(lora.trainable(self.param_target)["layers"])

    def init_decode_state(self) -> DecodeState:
        return self.programs("init", ())

    def abstract_decode_state(self) -> DecodeState:
        """Shapes, dtypes and shardings of a decode state, no memory (ahead-of-time compiles)."""
        return self.spec.abstract_state()

    def bucket(self, length: int) -> int:
        """The prefill chunk bucket a chunk of `length` tokens pads to (of those compiled)."""
        return self.programs.bucket(length)

    def prefill(self, params, state: DecodeState, tokens_PT, starts_P, lengths_P, table_PW,
                adapters_P=None):
        """Writes the next chunk of P prompts into their pages: row i's `lengths_P[i]` tokens
        sit at positions starts_P[i].. and go into the pages of `table_PW[i]`. Returns
        (state, logits [P, V] after each row's last token; more rows may follow, padding).
        Rows are padded to `cfg.prefill_rows` of their chunk bucket (padding rows write only to
        the null page), tokens to the bucket, the table to a prefill width. With
        `cfg.record_routes`: (state, logits, experts [P, T, L, K] of each row's tokens).
        `adapters_P`: each row's LoRA adapter set (a model holding several; default 0)."""
        tokens_PT = np.asarray(tokens_PT, np.int32)
        p, t = tokens_PT.shape
        bucket = self.bucket(t)
        rows = self.cfg.prefill_rows(bucket)
        if p > rows:
            raise ValueError(f"a prefill of {p} chunks of up to {bucket} tokens: at most {rows} "
                             f"(EngineConfig.prefill_rows)")
        table_PW = np.asarray(table_PW, np.int32)
        width = self.cfg.prefill_width(table_PW.shape[1] * self.cfg.page_size)
        grid = np.zeros((rows, bucket), np.int32)
        grid[:p, :t] = tokens_PT
        table = np.zeros((rows, width), np.int32)
        table[:p, : table_PW.shape[1]] = table_PW[:, :width]
        state, logits, *routes = self.programs("prefill", (rows, bucket, width), params, state,
                                               grid, _rows(starts_P, rows),
                                               _rows(lengths_P, rows), table,
                                               _rows([0] * p if adapters_P is None
                                                     else adapters_P, rows))
        # logits [max_prefill_rows, V]: rows past P are padding
        return (state, logits, *(np.asarray(r)[:p, :t] for r in routes))

    def score(self, params, tokens, adapter: int = 0
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Log-probs of `tokens` under the model, each given those before it: (logprobs [n-1],
        top ids [n-1, 20], top log-probs [n-1, 20]); row i scores tokens[i + 1]. Needs
        `EngineConfig.score`. `adapter`: the LoRA adapter set (a model holding several)."""
        n = len(tokens)
        if not self.cfg.score:
            raise ValueError("prompt log-probs need the engine's score programs "
                             "(EngineConfig.score, `jaxrl serve --score`)")
        if not 2 <= n <= self.cfg.max_len:
            raise ValueError(f"a sequence of {n} tokens cannot be scored: from 2 to "
                             f"max_len={self.cfg.max_len}")
        bucket = next(b for b in self.cfg.score_buckets if b >= n)
        grid = np.zeros(bucket, np.int32)
        grid[:n] = tokens
        out = self.programs("score", (bucket,), params, grid, np.int32(adapter))
        return tuple(np.asarray(a)[: n - 1] for a in out)

    def sample_first(self, logits_PV, rows, samplings, sample_indices, eos_id=None,
                     allowed=None):
        """First tokens and logprobs for K samples: entry i is drawn from logits row `rows[i]`
        with `samplings[i]` as sample `sample_indices[i]` of its request (`eos_id`: the token
        a sampling's min_tokens bans; `allowed`: [K, mask words] token bitmasks, None for
        none: serving/runner/constraints.py)."""
        k = self.programs.row_bucket("sample_first", len(rows))
        tokens, logprobs = self.programs(
            "sample_first", (k,), logits_PV, padded(rows, k, np.int32),
            padded(sample_indices, k, np.int32), sampling_rows(samplings, k, eos_id),
            self._masks(allowed, k))
        return np.asarray(tokens)[: len(rows)], np.asarray(logprobs)[: len(rows)]

    def _masks(self, allowed, rows: int):
        """Token bitmasks for `rows` rows: `allowed`'s, padded with all-allowed rows, or (None)
        the all-allowed masks kept on the device, so that free text sends nothing."""
        if allowed is None:
            return self._all_allowed(rows)
        out = np.full((rows, mask_words(self.model_cfg.vocab_size)), -1, np.int32)
        out[: len(allowed)] = allowed
        return out

    def _all_allowed(self, rows: int):
        mask = self._all_allowed_masks.get(rows)
        if mask is None:
            words = mask_words(self.model_cfg.vocab_size)
            mask = self._all_allowed_masks[rows] = jax.device_put(
                np.full((rows, words), -1, np.int32), shd.replicated(self.mesh))
        return mask

    def insert(self, state: DecodeState, batch: SlotBatch, eos_id=None) -> DecodeState:
        """JetStream's insert for the K sequences of `batch`, whose pages are written. Nothing
        is copied: each slot reaches its pages through the page table. A penalized sample's
        token counts are rebuilt from its history, a chunk per call."""
        k = self.programs.row_bucket("insert", len(batch.slots))
        slots, rows = padded(batch.slots, k, np.int32), batch.rows(k, eos_id)
        for chunk, first in batch.history_chunks(k):
            state = self.programs("insert", (k,), state, slots, rows, chunk, np.bool_(first))
        return state

    def copy_pages(self, state: DecodeState, src, dst) -> DecodeState:
        """Pool page src[i] copied to dst[i] in every layer (the partly filled last prompt page
        of a group, once per sample beyond the first)."""
        k = self.programs.row_bucket("copy_pages", len(src))
        return self.programs("copy_pages", (k,), state, padded(src, k, np.int32),
                             padded(dst, k, np.int32))

    def generate(self, params, state: DecodeState, table_SW):
        """One decode step for every slot: (state, tokens [S], logprobs [S])."""
        state, tokens, logprobs, *routes = self.generate_steps(params, state, table_SW, 1)
        return (state, tokens[0], logprobs[0], *(r[0] for r in routes))

    def generate_steps(self, params, state: DecodeState, table_SW, steps: int, slots=None,
                       allowed=None):
        """`steps` decode steps, read back: (state, tokens [K, R], logprobs [K, R], ...) as
        `dispatch_steps`'s `Decoded.fetch`."""
        state, decoded = self.dispatch_steps(params, state, table_SW, steps, slots, allowed)
        return (state, *decoded.fetch())

    def dispatch_steps(self, params, state: DecodeState, table_SW, steps: int, slots=None,
                       allowed=None) -> tuple[DecodeState, "Decoded"]:
        """Dispatches `steps` decode steps and returns at once: (state, their outputs still on
        the device). The sampled tokens stay in the state too, so the next dispatch can follow
        before these are read back. The page table must already hold the pages the steps
        write; `steps` is 1 or cfg.steps_per_dispatch. `allowed`: [R, mask words] token
        bitmasks of the rows (serving/runner/constraints.py), one step only.

        With `slots` (R of them, table_SW then [R, W] in the same order), only those slots are
        decoded: their rows are gathered into a batch of S/16, S/4 or S rows (S slots; always S
        when S <= 8), padded with rows of other slots that read and write only the null page and
        whose state is left as it was (another batch of the same step may be decoding them). A
        long tail with few busy slots then costs those rows, not every slot."""
        slots = list(range(self.cfg.max_concurrent_decodes)) if slots is None else list(slots)
        rows, padded, grid, real = self._gathered("decode", slots, table_SW)
        width = grid.shape[1]
        if allowed is not None and steps != 1:
            raise ValueError(f"token masks apply to one decode step at a time, not {steps}")
        if steps == 1:
            state, logits, *routes = self.programs("decode", (rows, width), params, state, grid,
                                                   padded)
            state, tokens, logprobs = self.programs("advance", (rows,), state, logits, padded,
                                                    real, self._masks(allowed, rows))
        else:
            state, tokens, logprobs, *routes = self.programs(
                "decode_steps", (rows, width, steps), params, state, grid, padded, real)
        return state, Decoded(tokens, logprobs, routes, len(slots), one_step=steps == 1)

    def verify(self, params, state: DecodeState, table_RW, slots, drafts, length: int | None = None
               ) -> tuple[DecodeState, list[list[int]], list[list[float]]]:
        """One speculative step for `slots` (R of them, table_RW [R, W] in the same order, its
        pages holding each row's next len(draft) + 1 positions): each feeds its last token and
        its draft (`drafts`, R lists of at most speculative_tokens tokens) and keeps the tokens
        the rejection rule keeps (serving/runner/speculate.py). Returns (state, each row's
        kept tokens, their log-probs), read back: from 1 to len(draft) + 1 tokens a row.
        `length`: the compiled draft length to run at (cfg.draft_lengths; default the
        longest)."""
        k = self.cfg.speculative_tokens if length is None else length
        if self.cfg.speculative == "off":
            raise ValueError("verify needs speculative decoding (EngineConfig.speculative)")
        if k not in self.cfg.draft_lengths:
            raise ValueError(f"draft length {k}: the engine verifies drafts of "
                             f"{list(self.cfg.draft_lengths)} tokens")
        if any(len(d) > k for d in drafts):
            raise ValueError(f"drafts of {max(map(len, drafts))} tokens: at most {k}")
        rows, padded, grid, real = self._gathered("verify", list(slots), table_RW)
        proposed = np.full((rows, k), -1, np.int32)
        for i, d in enumerate(drafts):
            proposed[i, : len(d)] = d
        state, tokens, logprobs, emitted = self.programs(
            "verify", (rows, grid.shape[1], k), params, state, grid, padded, proposed, real)
        tokens, logprobs, emitted = (np.asarray(a) for a in (tokens, logprobs, emitted))
        n = len(drafts)
        return (state, [tokens[i, : emitted[i]].tolist() for i in range(n)],
                [logprobs[i, : emitted[i]].tolist() for i in range(n)])

    def _gathered(self, family: str, slots: list[int], table):
        """A batch of `slots` as the decode programs take it: (rows, the slots padded with
        idle ones to the row bucket, the page table padded to its width, which rows are
        real)."""
        s = self.cfg.max_concurrent_decodes
        table = np.asarray(table, np.int32)
        rows = self.programs.row_bucket(family, len(slots))
        width = self.cfg.table_width(table.shape[1] * self.cfg.page_size)
        taken = set(slots)
        idle = [i for i in range(s) if i not in taken]
        padded = np.asarray(slots + idle[: rows - len(slots)], np.int32)
        grid = np.zeros((rows, width), np.int32)
        grid[: len(slots), : table.shape[1]] = table[:, :width]
        return rows, padded, grid, np.arange(rows) < len(slots)


@dataclasses.dataclass
class Decoded:
    """A decode dispatch's outputs while the device may still be computing them: `fetch` waits
    and reads them back. Their copy to the host starts at once."""
    tokens: jax.Array             # [K, R'] (or [R'] for one step), R' >= rows: padding rows
    logprobs: jax.Array
    routes: list                  # with record_routes: the experts each fed token went to
    rows: int
    one_step: bool

    def __post_init__(self):
        for a in (self.tokens, self.logprobs, *self.routes):
            a.copy_to_host_async()

    def fetch(self) -> tuple[np.ndarray, ...]:
        """(tokens [K, rows], logprobs [K, rows], *routes [K, rows, L, K']) as host arrays."""
        n = self.rows
        out = [np.asarray(a) for a in (self.tokens, self.logprobs, *self.routes)]
        if self.one_step:
            out = [a[None] for a in out]
        return tuple(a[:, :n] for a in out)    # host arrays: slicing them compiles nothing


def _activations(c: ModelConfig, cfg: EngineConfig) -> int:
    """Bytes the largest call's activations may take, an upper estimate (vLLM measures a
    profiling run instead): a prefill grid's hidden states and MLP intermediates in float32,
    and float32 logits of every slot (or of MAX_POOLED_SLOTS while slots follow the pool)."""
    grid = 1 << (max(cfg.prefill_budget, cfg.prefill_chunk) - 1).bit_length()
    rows = max(cfg.max_concurrent_decodes or MAX_POOLED_SLOTS, cfg.max_prefill_rows)
    return 4 * (grid * (4 * c.embed_dim + 2 * c.mlp_dim) + 2 * rows * c.vocab_size)


def _rows(values, rows: int) -> np.ndarray:
    """`values` as int32 padded with zeros to `rows`."""
    out = np.zeros((rows,), np.int32)
    out[: len(values)] = values
    return out
