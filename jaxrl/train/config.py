"""Configuration of the train step and checkpoints (the optimizer: jaxrl/optim_config.py)."""

from __future__ import annotations

import dataclasses
from typing import Literal


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The training loop."""

    steps: int = 600              # optimizer steps of supervised warm-up; 0: none (RL only)
    batch_size: int = 64          # global sequences per optimizer step
    microbatches: int = 1         # gradient accumulation: the batch is split into this many
    seq_len: int = 16             # tokens per sequence
    seed: int = 0                 # parameter init, data order and sampling
    log_every: int = 50           # steps between log lines (metrics.jsonl gets every step)
    eval_problems: int = 200      # held-out problems scored at the end
    # Stop the warm-up early once greedy accuracy on `check_problems` training problems (the same
    # ones at each check, never held-out ones) reaches this; checked every `check_every` steps.
    # RL still begins at step `steps`: the weights at the stop are saved as that step. 0: off.
    stop_at_accuracy: float = 0.0
    check_every: int = 100
    check_problems: int = 200
    # Activation memory of the train step (sharding/offload.py): none | full | minimal |
    # offload (q/k/v, attention output and MLP input to pinned host memory).
    remat: Literal["none", "full", "minimal", "offload"] = "none"
    # Keep the optimizer state (AdamW's two moments) in pinned host memory between steps and
    # bring it to the device only for the update (MaxText's optimizer offload).
    offload_optimizer: bool = False
    # Positions whose float32 logits exist at once in the loss (token log-probs, entropy): the
    # full [rows, T, vocab] block is never built (jaxrl/train/objectives.py). 0: all at once.
    logits_chunk: int = 512

    def __post_init__(self):
        if self.steps < 0:
            raise ValueError(f"train.steps={self.steps} must be >= 0")
        for name in ("batch_size", "microbatches", "seq_len", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name}={getattr(self, name)} must be >= 1")
        if self.batch_size % self.microbatches:
            raise ValueError(f"train.microbatches={self.microbatches} does not divide "
                             f"train.batch_size={self.batch_size}")
        if self.eval_problems < 0:
            raise ValueError(f"train.eval_problems={self.eval_problems} must be >= 0")
        if not 0.0 <= self.stop_at_accuracy <= 1.0:
            raise ValueError(f"train.stop_at_accuracy={self.stop_at_accuracy} must be in [0, 1] "
                             f"(0: train all train.steps)")
        for name in ("check_every", "check_problems"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name}={getattr(self, name)} must be >= 1")
        if self.logits_chunk < 0:
            raise ValueError(f"train.logits_chunk={self.logits_chunk} must be >= 0 (0: "
                             f"unchunked)")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints (CheckpointManager layout: <dir>/<step>/{params,opt_state,...})."""

    dir: str = ""                 # "" means <run_dir>/checkpoints
    every: int = 200              # steps between saves (the last step is always saved)
    keep: int = 3                 # keep the newest N checkpoints
    async_save: bool = True       # write in the background while training continues
    resume: bool = True           # continue from the newest checkpoint in dir if there is one

    def __post_init__(self):
        if self.every < 1 or self.keep < 1:
            raise ValueError(f"checkpoint.every={self.every} and checkpoint.keep={self.keep} "
                             f"must be >= 1")
