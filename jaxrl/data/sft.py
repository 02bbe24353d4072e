"""Supervised warm-up batches: prompt + reference answer + EOS, loss on the answer tokens only.

A Grain `MapDataset` keyed by example index: batch `k` is a pure function of (seed, k), so a
resumed run sees exactly the batches the uninterrupted run would have seen.
"""

from __future__ import annotations

import grain
import numpy as np

from jaxrl.models.tokenizer import Tokenizer, prompt_ids
from jaxrl.rl.tasks.base import Task


def encode_example(task: Task, tokenizer: Tokenizer, rng: np.random.Generator,
                   seq_len: int) -> dict[str, np.ndarray]:
    problem = task.warmup_sample(rng)
    prompt = prompt_ids(tokenizer, problem.prompt)
    answer = tokenizer.encode(problem.answer) + [tokenizer.eos_id]
    tokens = prompt + answer
    if len(tokens) > seq_len + 1:
        raise ValueError(f"example {problem.prompt + problem.answer!r} needs "
                         f"{len(tokens) - 1} tokens; train.seq_len={seq_len} is too short")
    ids = np.full(seq_len + 1, tokenizer.pad_id, np.int32)
    ids[: len(tokens)] = tokens
    mask = np.zeros(seq_len + 1, np.float32)
    mask[len(prompt): len(tokens)] = 1.0  # predict every answer token and the EOS
    return {"input_ids": ids[:-1], "targets": ids[1:], "loss_mask": mask[1:]}


def sft_dataset(task: Task, tokenizer: Tokenizer, *, batch_size: int, seq_len: int,
                seed: int, rows=None) -> grain.MapDataset:
    """`dataset[k]` is global batch k: arrays `[batch_size, seq_len]`, example k*batch_size + i
    in row i. `rows`: only those rows of each batch, in that order (one process's share of the
    global batch: the others are never built)."""
    rows = np.arange(batch_size) if rows is None else np.asarray(rows).ravel()

    def make(index: int):
        return encode_example(task, tokenizer, np.random.default_rng((seed, index)), seq_len)

    def batch(k: int):
        examples = [make(k * batch_size + int(r)) for r in rows]
        return {key: np.stack([e[key] for e in examples]) for key in examples[0]}

    return grain.MapDataset.range(2**62).map(batch)
