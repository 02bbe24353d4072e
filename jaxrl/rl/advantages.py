"""Group-relative advantages, computed on the host from the rewards of each prompt's n samples."""

from __future__ import annotations

import numpy as np


def group_advantages(rewards_GN: np.ndarray, *, normalize_std: bool = False,
                     eps: float = 1e-6) -> np.ndarray:
    """Leave-one-out advantages A_i = r_i - mean_{j != i} r_j within each group (row), float32.

    The leave-one-out baseline (RLOO; Ahmadian et al. 2024, "Back to Basics") is independent of
    r_i, so the estimator stays unbiased. `normalize_std` divides each group by the population
    std of its rewards (GRPO's scaling); Dr. GRPO (Liu et al. 2025) shows this weights groups by
    their difficulty and biases the gradient, so it is off by default.
    """
    r_GN = np.asarray(rewards_GN, dtype=np.float64)
    if r_GN.ndim != 2:
        raise ValueError(f"rewards must be [groups, n], got shape {r_GN.shape}")
    n = r_GN.shape[1]
    if n < 2:
        raise ValueError(f"a leave-one-out baseline needs n >= 2 samples per group, got n={n}")
    baseline_GN = (r_GN.sum(axis=1, keepdims=True) - r_GN) / (n - 1)
    adv_GN = r_GN - baseline_GN
    if normalize_std:
        adv_GN = adv_GN / (r_GN.std(axis=1, keepdims=True) + eps)
    return adv_GN.astype(np.float32)


def keep_group(rewards_N) -> bool:
    """False when every sample of the group scored the same: all advantages are zero, so the
    group carries no learning signal and only dilutes the batch (DAPO's dynamic sampling)."""
    r_N = np.asarray(rewards_N)
    return bool(r_N.size and np.any(r_N != r_N.flat[0]))
