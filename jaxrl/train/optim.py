"""The optimizer: optax AdamW, warm-up + cosine schedule, global-norm clipping."""

from __future__ import annotations

import jax
import optax

from jaxrl.optim_config import OptimConfig

# Parameters excluded from weight decay (norm scales and biases), by their last path element.
_NO_DECAY = ("norm", "bias")


def lr_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    decay = cfg.decay_steps or max(total_steps - cfg.warmup_steps, 1)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=cfg.warmup_steps,
        decay_steps=cfg.warmup_steps + decay, end_value=cfg.lr * cfg.min_lr_ratio)


def _decay_mask(params):
    def keep(path, _):
        name = str(getattr(path[-1], "key", path[-1]))
        return not any(tag in name for tag in _NO_DECAY)

    return jax.tree_util.tree_map_with_path(keep, params)


def make_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    schedule = lr_schedule(cfg, total_steps)
    adamw = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                        weight_decay=cfg.weight_decay, mask=_decay_mask)
    if cfg.clip_norm == 0:
        return adamw
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), adamw)
