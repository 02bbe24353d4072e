"""The optimizer's configuration, shared by the warm-up (train.*) and RL (rl.optim.*): its own
module so that jaxrl/rl does not import jaxrl/train."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warm-up, cosine decay and global-norm clipping."""

    lr: float = 3e-3              # peak learning rate
    warmup_steps: int = 50        # linear warm-up from 0 to lr
    decay_steps: int = 0          # cosine decay length after warm-up; 0: until train.steps
    min_lr_ratio: float = 0.1     # final lr = lr * min_lr_ratio
    weight_decay: float = 0.01    # decoupled, on matrices only (not norms or biases)
    b1: float = 0.9               # AdamW's first-moment decay
    b2: float = 0.95              # AdamW's second-moment decay
    eps: float = 1e-8             # AdamW's denominator epsilon
    clip_norm: float = 1.0        # global gradient-norm clip; 0 disables

    def __post_init__(self):
        if self.lr <= 0:
            raise ValueError(f"optim.lr={self.lr} must be > 0")
        if self.warmup_steps < 0 or self.decay_steps < 0:
            raise ValueError(f"optim.warmup_steps={self.warmup_steps} and optim.decay_steps="
                             f"{self.decay_steps} must be >= 0")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"optim.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        if self.clip_norm < 0:
            raise ValueError(f"optim.clip_norm={self.clip_norm} must be >= 0")
