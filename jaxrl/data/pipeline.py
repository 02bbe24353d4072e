"""The trainer's input pipeline: rollout stream -> lag filter -> one step's samples -> packed
microbatches -> device, as Grain transformations with a checkpointable iterator.

A step always trains on exactly `rl.batch_size` samples, so the synchronous baseline trains on
exactly the batch it generated and both modes spend the same samples per step. The samples are
packed first-fit (Grain's `FirstFitPackIterDataset`) into rows of `pack_len` tokens with
segment ids and positions; the rows fill `max_microbatches` microbatches of `microbatch_rows`,
the worst case, and the step skips the empty ones (see `RLConfig.max_microbatches`).
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import grain
import numpy as np

from jaxrl.data.rollouts import Rollout, RolloutLog, RolloutSource
from jaxrl.rl.config import RLConfig

# Arrays of a packed microbatch, all [rows, pack_len].
FEATURES = ("input_ids", "targets", "loss_mask", "behaviour_logp", "advantages")


class DropCounter:
    """Samples dropped by a filter, read by the loop for its metrics (thread-safe)."""

    def __init__(self, total: int = 0):
        self._lock = threading.Lock()
        self._total = total

    def add(self, n: int = 1) -> None:
        with self._lock:
            self._total += n

    @property
    def total(self) -> int:
        with self._lock:
            return self._total


class LagFilter(grain.transforms.Filter):
    """Keeps samples whose oldest token is at most `max_lag` optimizer steps older than the
    trainer's weights (PipelineRL's max lag); counts the rest."""

    def __init__(self, current_step: Callable[[], int], max_lag: int, dropped: DropCounter):
        self.current_step = current_step
        self.max_lag = max_lag
        self.dropped = dropped

    def filter(self, rollout: Rollout) -> bool:
        keep = self.current_step() - min(rollout.versions) <= self.max_lag
        if not keep:
            self.dropped.add()
        return keep


def features(rollout: Rollout) -> dict[str, np.ndarray]:
    """Next-token arrays of one sample: the loss counts completion tokens only."""
    tokens = np.asarray(rollout.prompt + rollout.completion, np.int32)
    n_prompt, n_completion = len(rollout.prompt), len(rollout.completion)
    completion = np.zeros(len(tokens) - 1, bool)
    completion[n_prompt - 1:] = True
    behaviour = np.zeros(len(tokens) - 1, np.float32)
    behaviour[n_prompt - 1:] = rollout.logprobs
    assert len(rollout.logprobs) == n_completion == len(rollout.versions)
    return {"input_ids": tokens[:-1], "targets": tokens[1:],
            "loss_mask": completion.astype(np.float32), "behaviour_logp": behaviour,
            "advantages": np.where(completion, rollout.advantage, 0.0).astype(np.float32)}


def pack(rollouts: list[Rollout], cfg: RLConfig) -> dict[str, Any]:
    """One step's samples as `{"arrays": {name: [M, R, T]}, "microbatches": used M,
    "rollouts": ...}`, packed first-fit into M * R rows of `pack_len` tokens."""
    rows_total = cfg.max_microbatches * cfg.microbatch_rows
    source = grain.MapDataset.source([features(r) for r in rollouts]).to_iter_dataset()
    packed = grain.experimental.FirstFitPackIterDataset(
        source, length_struct={k: cfg.pack_len for k in FEATURES},
        num_packing_bins=rows_total, shuffle_bins=False, meta_features=FEATURES[1:],
        max_sequences_per_bin=cfg.max_segments)
    rows = list(packed)
    if len(rows) > rows_total:  # cannot happen: see RLConfig.max_microbatches
        raise AssertionError(f"{len(rollouts)} samples packed into {len(rows)} rows, more "
                             f"than the {rows_total} reserved")
    int_features = ("input_ids", "targets")
    arrays = {k: np.zeros((rows_total, cfg.pack_len),
                          np.int32 if k in int_features else np.float32) for k in FEATURES}
    arrays["segment_ids"] = np.zeros((rows_total, cfg.pack_len), np.int32)
    arrays["positions"] = np.zeros((rows_total, cfg.pack_len), np.int32)
    for i, row in enumerate(rows):
        for k in FEATURES:
            arrays[k][i] = row[k]
        arrays["segment_ids"][i] = row["input_ids_segment_ids"]
        arrays["positions"][i] = row["input_ids_positions"]
    shape = (cfg.max_microbatches, cfg.microbatch_rows, cfg.pack_len)
    return {"arrays": {k: v.reshape(shape) for k, v in arrays.items()},
            "microbatches": -(-len(rows) // cfg.microbatch_rows),
            "rollouts": rollouts}


def rl_batches(log: RolloutLog, cfg: RLConfig, *, current_step: Callable[[], int],
               put: Callable[[dict], dict] = lambda a: a, start: int = 0,
               dropped_before: int = 0) -> tuple[grain.IterDataset, DropCounter]:
    """The pipeline as a Grain IterDataset of training batches (see `pack`) whose arrays went
    through `put` (a sharded device_put onto the trainer mesh), prefetched in a thread, and
    the counter of samples the lag filter dropped."""
    dropped = DropCounter(dropped_before)  # a resumed run keeps counting
    ds = RolloutSource(log, start).filter(LagFilter(current_step, cfg.max_lag, dropped))
    ds = ds.batch(cfg.batch_size, drop_remainder=True, batch_fn=list)
    ds = ds.map(lambda rollouts: pack(rollouts, cfg))
    ds = ds.map(lambda b: {**b, "arrays": put(b["arrays"])})
    if cfg.prefetch:
        ds = grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=cfg.prefetch)
    return ds, dropped
