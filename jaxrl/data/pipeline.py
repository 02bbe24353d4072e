"""The trainer's input pipeline: rollout stream -> lag filter -> one step's samples -> packed
microbatches -> device, as Grain transformations with a checkpointable iterator.

A step always trains on exactly `rl.batch_size` samples, so the synchronous baseline trains on
exactly the batch it generated and both modes spend the same samples per step. The samples are
packed first-fit (Grain's `FirstFitPackIterDataset`) into rows of `pack_len` tokens with
segment ids and positions; the rows fill `max_microbatches` microbatches of `microbatch_rows`,
the worst case, and the step skips the empty ones (see `RLConfig.max_microbatches`).
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Callable

import grain
import numpy as np

from jaxrl.data.rollouts import Rollout, RolloutLog, RolloutSource
from jaxrl.rl.config import RLConfig

# Arrays of a packed microbatch, all [rows, pack_len].
# `oldest_version`: for each completion token, the oldest weights version behind it (its own
# and every earlier token's; with in-flight updates a token's context was computed partly by
# older weights); -1 elsewhere. Where it equals the trainer's version the sampler's and the
# trainer's log-probs should agree up to numerics: the train step measures that gap.
FEATURES = ("input_ids", "targets", "loss_mask", "behaviour_logp", "advantages",
            "oldest_version")


def length_bucket(tokens: int) -> int:
    """The power of two at or above a completion's length: samples are counted by this."""
    return 1 << max(tokens - 1, 0).bit_length()


class LagStats:
    """What the lag filter saw and dropped, in samples and tokens per completion-length bucket
    (thread-safe; the loop logs it, a checkpoint keeps it)."""

    KINDS = ("seen_samples", "seen_tokens", "dropped_samples", "dropped_tokens")

    def __init__(self, state: dict | None = None):
        self._lock = threading.Lock()
        self._counts = {k: {int(b): n for b, n in (state or {}).get(k, {}).items()}
                        for k in self.KINDS}

    def add(self, completion_tokens: int, dropped: bool) -> None:
        bucket = length_bucket(completion_tokens)
        with self._lock:
            for kind, n in (("samples", 1), ("tokens", completion_tokens)):
                for what in ("seen",) + (("dropped",) if dropped else ()):
                    counts = self._counts[f"{what}_{kind}"]
                    counts[bucket] = counts.get(bucket, 0) + n

    @property
    def total(self) -> int:
        """Samples dropped so far."""
        with self._lock:
            return sum(self._counts["dropped_samples"].values())

    def fractions(self) -> dict[str, float]:
        """`lag_dropped_{samples,tokens}_le{bucket}`: the share dropped, per length bucket."""
        with self._lock:
            c = self._counts
            return {f"lag_dropped_{kind}_le{b}": c[f"dropped_{kind}"].get(b, 0) / seen
                    for kind in ("samples", "tokens")
                    for b, seen in sorted(c[f"seen_{kind}"].items()) if seen}

    def state(self) -> dict:
        with self._lock:
            return {k: {str(b): n for b, n in v.items()} for k, v in self._counts.items()}


class LagFilter(grain.transforms.Filter):
    """Keeps samples at most `max_lag` optimizer steps behind the trainer's weights (PipelineRL's
    max lag), by the sample's lag as `rl.lag` defines it. Records (completion tokens, dropped)
    of every sample it sees until `take`."""

    def __init__(self, current_step: Callable[[], int], max_lag: int, lag: str = "newest"):
        self.current_step = current_step
        self.max_lag = max_lag
        self.lag = lag
        self._seen: collections.deque[tuple[int, bool]] = collections.deque()

    def filter(self, rollout: Rollout) -> bool:
        keep = sample_lag(rollout.versions, self.current_step(), self.lag) <= self.max_lag
        self._seen.append((len(rollout.completion), not keep))
        return keep

    def take(self) -> list[tuple[int, bool]]:
        """What it saw since the last call."""
        out = []
        while self._seen:
            out.append(self._seen.popleft())
        return out


def sample_lag(versions: list[int], step: int, definition: str) -> float:
    """How many optimizer steps a sample is behind `step`, judged by the version of its oldest
    token, of its newest token, or by the mean over its tokens (token-weighted)."""
    if definition == "oldest":
        return step - min(versions)
    if definition == "newest":
        return step - max(versions)
    if definition == "mean":
        return step - sum(versions) / len(versions)
    raise ValueError(f"lag definition {definition!r} is not one of 'oldest', 'newest', 'mean'")


def features(rollout: Rollout) -> dict[str, np.ndarray]:
    """Next-token arrays of one sample: the loss counts the model's completion tokens only (not
    the prompt, not the environment's tokens of a multi-turn episode)."""
    tokens = np.asarray(rollout.prompt + rollout.completion, np.int32)
    n_prompt = len(rollout.prompt)
    completion = np.zeros(len(tokens) - 1, bool)
    completion[n_prompt - 1:] = True if rollout.trained is None else rollout.trained
    behaviour = np.zeros(len(tokens) - 1, np.float32)
    behaviour[n_prompt - 1:] = rollout.logprobs
    behaviour = np.where(completion, behaviour, 0.0).astype(np.float32)
    oldest = np.full(len(tokens) - 1, -1, np.int32)
    oldest[n_prompt - 1:] = np.minimum.accumulate(np.asarray(rollout.versions, np.int64))
    advantage = np.zeros(len(tokens) - 1, np.float32)
    advantage[n_prompt - 1:] = (rollout.advantage if rollout.token_advantages is None
                                else rollout.token_advantages)
    return {"input_ids": tokens[:-1], "targets": tokens[1:],
            "loss_mask": completion.astype(np.float32), "behaviour_logp": behaviour,
            "advantages": np.where(completion, advantage, 0.0).astype(np.float32),
            "oldest_version": oldest}


def pack(rollouts: list[Rollout], cfg: RLConfig) -> dict[str, Any]:
    """One step's samples as `{"arrays": {name: [M, R, T]}, "microbatches": used M,
    "rollouts": ...}`, packed first-fit into M * R rows of `pack_len` tokens. Where the samples
    carry a mixture-of-experts engine's routing, `arrays["routes"]` is [M, R, T, L, K] (-1
    where unknown)."""
    rows_total = cfg.max_microbatches * cfg.microbatch_rows
    # Packed in an order fixed by the samples themselves, not the order they finished in (which
    # follows the threads' timing): the same samples (a sync step's, for a seed) give the same
    # rows, so the same float sums in the step, from run to run.
    ordered = sorted(rollouts, key=_canonical)
    # `sample`: which rollout of `ordered` (1-based; 0 is padding) each packed token came from.
    packed_features = FEATURES + ("sample",)
    source = grain.MapDataset.source([
        {**features(r), "sample": np.full(len(r.prompt) + len(r.completion) - 1, i + 1,
                                          np.int32)}
        for i, r in enumerate(ordered)]).to_iter_dataset()
    packed = grain.experimental.FirstFitPackIterDataset(
        source, length_struct={k: cfg.pack_len for k in packed_features},
        num_packing_bins=rows_total, shuffle_bins=False, meta_features=packed_features[1:],
        max_sequences_per_bin=cfg.max_segments)
    rows = list(packed)
    if len(rows) > rows_total:  # cannot happen: see RLConfig.max_microbatches
        raise AssertionError(f"{len(rollouts)} samples packed into {len(rows)} rows, more "
                             f"than the {rows_total} reserved")
    int_features = ("input_ids", "targets", "oldest_version")
    arrays = {k: np.zeros((rows_total, cfg.pack_len),
                          np.int32 if k in int_features else np.float32) for k in FEATURES}
    arrays["segment_ids"] = np.zeros((rows_total, cfg.pack_len), np.int32)
    arrays["positions"] = np.zeros((rows_total, cfg.pack_len), np.int32)
    for i, row in enumerate(rows):
        for k in FEATURES:
            arrays[k][i] = row[k]
        arrays["segment_ids"][i] = row["input_ids_segment_ids"]
        arrays["positions"][i] = row["input_ids_positions"]
    routes = _packed_routes(ordered, rows, rows_total, cfg.pack_len)
    if routes is not None:
        arrays["routes"] = routes
    shape = (cfg.max_microbatches, cfg.microbatch_rows, cfg.pack_len)
    return {"arrays": {k: v.reshape(shape + v.shape[2:]) for k, v in arrays.items()},
            "microbatches": -(-len(rows) // cfg.microbatch_rows),
            "rollouts": rollouts}


def _canonical(rollout: Rollout) -> tuple:
    return (rollout.group, rollout.prompt, rollout.completion, rollout.logprobs,
            rollout.versions, rollout.advantage)


def _packed_routes(rollouts: list[Rollout], rows: list[dict], rows_total: int, pack_len: int
                   ) -> np.ndarray | None:
    """The rollouts' routing ([tokens - 1, L, K] each) laid out as their tokens were packed:
    [rows_total, pack_len, L, K], -1 where unknown. None when no rollout has any."""
    known = [r.routes for r in rollouts if r.routes is not None]
    if not known:
        return None
    out = np.full((rows_total, pack_len, *known[0].shape[1:]), -1, np.int32)
    for i, row in enumerate(rows):
        sample, position = row["sample"], row["input_ids_positions"]
        for s in np.unique(sample[sample > 0]):
            routes = rollouts[s - 1].routes
            if routes is not None:
                at = np.nonzero(sample == s)[0]
                out[i, at] = routes[position[at]]
    return out


def rl_batches(log: RolloutLog, cfg: RLConfig, *, current_step: Callable[[], int],
               put: Callable[[dict], dict] = lambda a: a, start: int = 0,
               lag_state: dict | None = None) -> tuple[grain.IterDataset, LagStats]:
    """The pipeline as a Grain IterDataset of training batches (see `pack`) whose arrays went
    through `put` (a sharded device_put onto the trainer mesh), prefetched in a thread, and
    the lag filter's statistics."""
    stats = LagStats(lag_state)  # a resumed run keeps counting
    lag_filter = LagFilter(current_step, cfg.max_lag, cfg.lag)
    ds = RolloutSource(log, start).filter(lag_filter)
    ds = ds.batch(cfg.batch_size, drop_remainder=True, batch_fn=list)
    # The samples the filter saw while this batch was gathered go with it (batching and packing
    # run in order, in one thread) ...
    ds = ds.map(lambda rollouts: {**pack(rollouts, cfg), "lag_seen": lag_filter.take()})
    ds = ds.map(lambda b: {**b, "arrays": put(b["arrays"])})
    if cfg.prefetch:
        ds = grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=cfg.prefetch)
    # ... and are counted when the trainer takes it (this map runs in the caller's thread), so
    # the counts always match the stream position a checkpoint saves: none from prefetched
    # batches, none counted twice after a resume.
    return ds.map(lambda b: _counted(b, stats)), stats


def _counted(batch: dict, stats: LagStats) -> dict:
    for tokens, dropped in batch["lag_seen"]:
        stats.add(tokens, dropped)
    return batch
