"""Policy-gradient losses on packed rows of sampled completions.

Letters: B rows, T tokens per row, K packed sequences (segments) per row.

Every token was sampled by the serving engine under weights that may lag the learner's; mu is
the log-prob the engine reported for it and pi the learner's, so r = exp(logp - mu) = pi / mu
corrects for that lag. Each loss returns `(loss_sum, weight, stats)` for one microbatch; the
caller sums all three over microbatches (taking MIN_STATS with min and MAX_STATS with max) and
optimises sum(loss_sum) / sum(weight), so the accumulated gradient equals the one-shot one.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

LOSSES = ("tis", "ppo", "gspo")
CORRECTIONS = ("none", "icepop", "seq_mis", "geo_mis")
MIN_STATS = ("ratio_min",)   # combined across microbatches with min; +inf when no tokens
MAX_STATS = ("ratio_max",)   # combined with max; -inf when no tokens
# Every other stat is a sum: tokens, ratio_sum, ratio_sq_sum, clipped, kl_new_old_sum, kl_ref_sum.


@dataclasses.dataclass(frozen=True)
class LossSettings:
    """Which policy loss and its constants (rl.loss, rl.clip_low / clip_high, rl.tis_cap,
    rl.kl_coef; `max_segments`: the most sequences a packed row holds, static).

    kind:
      "tis"  truncated importance-sampled REINFORCE, PipelineRL's default: per token
             -logp * A * sg(min(r, tis_cap)); weight = counted tokens.
      "ppo"  PPO-clip (Schulman et al. 2017) with mu as the old policy: per token
             -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A); weight = counted tokens.
      "gspo" GSPO (Zheng et al. 2025): the same clip on the sequence ratio
             s = exp(mean of logp - mu over the sequence's counted tokens); weight = sequences.
    With a reference's log-probs and `kl_coef > 0`, kl_coef * k3(pi || ref) is added per token
    (for gspo, its mean per sequence). Segment ids are 1..max_segments within a row, 0 is
    padding; a sequence whose id exceeds `max_segments` is left out of the gspo loss.

    correction (rl.rollout_correction), a mask on top of any kind, for tokens whose ratio
    r = pi/mu says the sampler and the learner disagree too much to learn from (numerics of
    another engine, low-precision rollout weights, or a lag the trust region cannot bridge):
      "none"     every counted token learns;
      "icepop"   IcePop (Ling team, Ring-1T): a token learns only if
                 correction_low <= r <= correction_high; outside it, its gradient is zero;
      "seq_mis"  sequence-level masked importance sampling (verl's sequence rejection): a
                 sequence learns only if its product of ratios is within the bounds;
      "geo_mis"  the same on the geometric mean of its ratios (length-independent).
    A masked token leaves the loss and its weight (the others' mean is unchanged by it), and
    is counted in the `corrected` stat."""

    kind: str
    clip_low: float = 0.2
    clip_high: float = 0.2
    tis_cap: float = 2.0
    kl_coef: float = 0.0
    max_segments: int = 64
    correction: str = "none"
    correction_low: float = 0.5
    correction_high: float = 5.0

    def __post_init__(self):
        if self.kind not in LOSSES:
            raise ValueError(f"unknown policy loss kind {self.kind!r}; expected one of {LOSSES}")
        if self.correction not in CORRECTIONS:
            raise ValueError(f"unknown rollout correction {self.correction!r}; expected one of "
                             f"{CORRECTIONS}")
        if not 0 <= self.correction_low < 1 < self.correction_high:
            raise ValueError(f"rollout correction bounds [{self.correction_low}, "
                             f"{self.correction_high}] must satisfy 0 <= low < 1 < high")


def policy_loss(logp_BT, behaviour_logp_BT, advantages_BT, mask_BT, segment_ids_BT,
                settings: LossSettings, ref_logp_BT=None):
    """(loss_sum, weight, stats) of one microbatch by `settings`; differentiable in `logp_BT`
    only. `ref_logp_BT`: the reference model's log-probs (the KL term)."""
    kind, kl_coef = settings.kind, settings.kl_coef
    f32 = jnp.float32
    counted_BT = mask_BT > 0
    sampled_log_ratio_BT = jax.lax.stop_gradient(
        jnp.where(counted_BT, logp_BT.astype(f32) - behaviour_logp_BT.astype(f32), 0.0))
    valid_BT = counted_BT & correction_mask(sampled_log_ratio_BT, counted_BT, segment_ids_BT,
                                            settings)
    count_BT = valid_BT.astype(f32)

    # Padding may hold anything (-inf, garbage): zero it before any arithmetic, so that neither
    # the value nor the gradient picks up a NaN from a token that does not count.
    def counted(x_BT):
        return jnp.where(valid_BT, x_BT.astype(f32), 0.0)

    def masked_sum(x_BT):
        return jnp.sum(jnp.where(valid_BT, x_BT, 0.0))

    logp_BT = counted(logp_BT)
    mu_BT = jax.lax.stop_gradient(counted(behaviour_logp_BT))
    adv_BT = counted(advantages_BT)
    log_ratio_BT = logp_BT - mu_BT
    ratio_BT = jnp.exp(log_ratio_BT)
    kl_ref_BT = None
    if ref_logp_BT is not None:
        # k3 (Schulman, "Approximating KL divergence"): unbiased for KL(pi || ref), always >= 0.
        ref_minus_logp_BT = counted(ref_logp_BT) - logp_BT
        kl_ref_BT = jnp.exp(ref_minus_logp_BT) - ref_minus_logp_BT - 1.0
    kl_loss_BT = kl_coef * kl_ref_BT if kl_ref_BT is not None and kl_coef > 0 else None

    if kind == "gspo":
        loss_sum, weight, clipped_BT = _sequence_clip_sums(
            log_ratio_BT, adv_BT, kl_loss_BT, valid_BT, segment_ids_BT,
            settings.clip_low, settings.clip_high, settings.max_segments)
    else:
        if kind == "tis":
            # A surrogate: its value is not the objective, its gradient -A min(r, cap) is.
            is_weight_BT = jax.lax.stop_gradient(jnp.minimum(ratio_BT, settings.tis_cap))
            loss_BT = -logp_BT * adv_BT * is_weight_BT
            clipped_BT = ratio_BT > settings.tis_cap
        else:
            clip = (settings.clip_low, settings.clip_high)
            loss_BT = -_clipped_objective(ratio_BT, adv_BT, *clip)
            clipped_BT = _clip_active(ratio_BT, adv_BT, *clip)
        if kl_loss_BT is not None:
            loss_BT = loss_BT + kl_loss_BT
        loss_sum = masked_sum(loss_BT)
        weight = jnp.sum(count_BT)

    stats = _stats(counted_BT, sampled_log_ratio_BT, clipped_BT & valid_BT, kl_ref_BT)
    stats["corrected"] = jnp.sum((counted_BT & ~valid_BT).astype(f32))
    return loss_sum, weight, stats


def correction_mask(log_ratio_BT, valid_BT, segment_ids_BT, settings: LossSettings):
    """Which tokens the rollout correction keeps (`settings.correction`), from each token's
    log-ratio log(pi/mu) (no gradient flows through the decision)."""
    if settings.correction == "none":
        return jnp.ones_like(valid_BT)
    log_r_BT = jax.lax.stop_gradient(log_ratio_BT)
    low = jnp.log(jnp.maximum(settings.correction_low, 1e-30))
    high = jnp.log(settings.correction_high)
    if settings.correction == "icepop":
        measured_BT = log_r_BT
    else:
        ids_K = jnp.arange(1, settings.max_segments + 1)
        onehot_BTK = ((segment_ids_BT[..., None] == ids_K)
                      & valid_BT[..., None]).astype(jnp.float32)
        sum_BK = jnp.einsum("bt,btk->bk", log_r_BT, onehot_BTK)
        if settings.correction == "geo_mis":
            sum_BK = sum_BK / jnp.maximum(jnp.sum(onehot_BTK, axis=1), 1.0)
        measured_BT = jnp.einsum("btk,bk->bt", onehot_BTK, sum_BK)
    return (measured_BT >= low) & (measured_BT <= high)


def _stats(valid_BT, log_ratio_BT, clipped_BT, kl_ref_BT) -> dict:
    """The microbatch's sums over its counted tokens (and the ratio's min and max)."""
    def masked_sum(x_BT):
        return jnp.sum(jnp.where(valid_BT, x_BT, 0.0))

    log_r_BT = jax.lax.stop_gradient(log_ratio_BT)
    r_BT = jnp.exp(log_r_BT)
    return {
        "tokens": jnp.sum(valid_BT.astype(jnp.float32)),
        "ratio_sum": masked_sum(r_BT),
        "ratio_sq_sum": masked_sum(r_BT * r_BT),
        "ratio_min": jnp.min(jnp.where(valid_BT, r_BT, jnp.inf)),
        "ratio_max": jnp.max(jnp.where(valid_BT, r_BT, -jnp.inf)),
        "clipped": masked_sum(clipped_BT.astype(jnp.float32)),
        # k3 for KL(mu || pi) from mu's own samples: r - 1 - log r.
        "kl_new_old_sum": masked_sum(r_BT - 1.0 - log_r_BT),
        "kl_ref_sum": (jnp.zeros((), jnp.float32) if kl_ref_BT is None
                       else masked_sum(jax.lax.stop_gradient(kl_ref_BT))),
    }


def effective_sample_size(ratio_sum, ratio_sq_sum, tokens):
    """Kish's effective sample size of the importance weights as a fraction of the tokens,
    (sum r)^2 / (N sum r^2): 1 when on-policy, near 1/N when one token dominates."""
    return ratio_sum ** 2 / jnp.maximum(tokens * ratio_sq_sum, 1e-30)


def _sequence_clip_sums(log_ratio_BT, adv_BT, kl_loss_BT, valid_BT, segment_ids_BT,
                        clip_low, clip_high, max_segments):
    """GSPO's (loss_sum, sequences, clipped_BT): the PPO clip on each sequence's length-normalised
    ratio, so every token of a sequence shares one ratio and one clipping decision."""
    ids_K = jnp.arange(1, max_segments + 1)
    onehot_BTK = ((segment_ids_BT[..., None] == ids_K) & valid_BT[..., None]).astype(jnp.float32)
    n_BK = jnp.sum(onehot_BTK, axis=1)
    has_BK = n_BK > 0

    def per_seq(x_BT):   # mean over each sequence's counted tokens
        return jnp.einsum("bt,btk->bk", x_BT, onehot_BTK) / jnp.maximum(n_BK, 1.0)

    seq_ratio_BK = jnp.exp(per_seq(log_ratio_BT))
    seq_adv_BK = per_seq(adv_BT)   # A is constant over a sequence; the mean just reads it
    loss_BK = -_clipped_objective(seq_ratio_BK, seq_adv_BK, clip_low, clip_high)
    if kl_loss_BT is not None:
        loss_BK = loss_BK + per_seq(kl_loss_BT)
    loss_sum = jnp.sum(jnp.where(has_BK, loss_BK, 0.0))
    clipped_BK = _clip_active(seq_ratio_BK, seq_adv_BK, clip_low, clip_high) & has_BK
    clipped_BT = jnp.einsum("btk,bk->bt", onehot_BTK, clipped_BK.astype(jnp.float32)) > 0
    return loss_sum, jnp.sum(has_BK.astype(jnp.float32)), clipped_BT


def _clipped_objective(ratio, adv, clip_low, clip_high):
    return jnp.minimum(ratio * adv, jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv)


def _clip_active(ratio, adv, clip_low, clip_high):
    """Where the clipped term wins the min, so the sample's gradient is zero."""
    return ((adv > 0) & (ratio > 1.0 + clip_high)) | ((adv < 0) & (ratio < 1.0 - clip_low))
