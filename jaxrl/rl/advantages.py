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


def turn_advantages(turn_rewards: list[list[float]], *, discount: float = 1.0,
                    normalize_std: bool = False, eps: float = 1e-6) -> list[np.ndarray]:
    """Per-turn advantages of one group's multi-turn episodes (`rl.turn_advantage=per_turn`):
    `turn_rewards[i][t]` is the reward episode i got for its turn t. Turn t's advantage is
    A_it = G_it - b_it, with G_it = sum over k >= t of discount^(k - t) r_ik, its return from
    that turn on, and b_it the mean of G_jt over the group's other episodes j that reached
    turn t (a per-turn leave-one-out baseline); where no other episode did, the leave-one-out
    mean of the others' whole returns G_j0. A turn is credited with what follows it, not with
    the rewards of the turns before. `normalize_std` divides by the std of the group's whole
    returns. Returns one float32 array of turn advantages per episode."""
    n = len(turn_rewards)
    if n < 2:
        raise ValueError(f"a leave-one-out baseline needs n >= 2 episodes per group, got {n}")
    returns = []
    for rewards in turn_rewards:
        g, out = 0.0, []
        for r in reversed(rewards):
            g = float(r) + discount * g
            out.append(g)
        returns.append(out[::-1])
    whole = np.asarray([g[0] if g else 0.0 for g in returns])
    scale = whole.std() + eps if normalize_std else 1.0
    out = []
    for i, g_i in enumerate(returns):
        adv = []
        for t, g in enumerate(g_i):
            others = [g_j[t] for j, g_j in enumerate(returns) if j != i and len(g_j) > t]
            baseline = np.mean(others) if others else np.delete(whole, i).mean()
            adv.append((g - baseline) / scale)
        out.append(np.asarray(adv, np.float32))
    return out


def keep_group(rewards_N) -> bool:
    """False when every sample of the group scored the same: all advantages are zero, so the
    group carries no learning signal and only dilutes the batch (DAPO's dynamic sampling)."""
    r_N = np.asarray(rewards_N)
    return bool(r_N.size and np.any(r_N != r_N.flat[0]))
