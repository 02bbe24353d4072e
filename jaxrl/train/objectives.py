"""What a train step minimises, per microbatch: `(loss_sum, weight, stats)`.

The step sums loss_sum, weight and stats over microbatches (stats named `*_min` / `*_max` are
combined with min / max) and minimises sum(loss_sum) / sum(weight), so gradient accumulation
is exact. `summarize` turns the combined stats into the metrics a user reads.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxrl.rl.losses import effective_sample_size, policy_loss


def token_logp(model, mb, temperature: float = 1.0, stack_fn=None):
    """(log-prob of each target token [B, T], entropy of each next-token distribution [B, T],
    logits) under softmax(logits / temperature), the distribution the engine samples from.
    `stack_fn`: how the layer stack runs (a remat policy or a pipeline schedule, sharding/)."""
    logits_BTV = model.logits(model.hidden(mb["input_ids"], mb.get("positions"),
                                           mb.get("segment_ids"), stack_fn))
    logp_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32) / temperature, axis=-1)
    logp_BT = jnp.take_along_axis(logp_BTV, mb["targets"][..., None], axis=-1)[..., 0]
    entropy_BT = -jnp.sum(jnp.exp(logp_BTV) * logp_BTV, axis=-1)
    return logp_BT, entropy_BT, logits_BTV


@dataclasses.dataclass(frozen=True)
class SupervisedLoss:
    """Mean negative log-likelihood of the masked target tokens."""

    def __call__(self, model, mb, ref_model=None, stack_fn=None):
        logp_BT, _, logits_BTV = token_logp(model, mb, stack_fn=stack_fn)
        mask_BT = mb["loss_mask"].astype(jnp.float32)
        correct_BT = (jnp.argmax(logits_BTV, axis=-1) == mb["targets"]).astype(jnp.float32)
        tokens = jnp.sum(mask_BT)
        return -jnp.sum(logp_BT * mask_BT), tokens, {
            "tokens": tokens, "correct": jnp.sum(correct_BT * mask_BT)}

    def summarize(self, stats):
        tokens = jnp.maximum(stats["tokens"], 1.0)
        return {"tokens": stats["tokens"], "token_accuracy": stats["correct"] / tokens}


@dataclasses.dataclass(frozen=True)
class PolicyGradientLoss:
    """A policy loss of jaxrl.rl.losses on packed rollouts (keys of jaxrl.data.pipeline)."""

    kind: str = "tis"
    temperature: float = 1.0
    tis_cap: float = 2.0
    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_coef: float = 0.0
    max_segments: int = 16

    def __call__(self, model, mb, ref_model=None, stack_fn=None):
        logp_BT, entropy_BT, _ = token_logp(model, mb, self.temperature, stack_fn)
        ref_logp_BT = None
        if ref_model is not None:
            ref_logp_BT = jax.lax.stop_gradient(token_logp(ref_model, mb, self.temperature)[0])
        loss_sum, weight, stats = policy_loss(
            logp_BT, mb["behaviour_logp"], mb["advantages"], mb["loss_mask"],
            mb["segment_ids"], kind=self.kind, clip_low=self.clip_low,
            clip_high=self.clip_high, tis_cap=self.tis_cap, ref_logp_BT=ref_logp_BT,
            kl_coef=self.kl_coef, max_segments=self.max_segments)
        mask_BT = mb["loss_mask"].astype(jnp.float32)
        stats = {**stats, "entropy_sum": jnp.sum(jax.lax.stop_gradient(entropy_BT) * mask_BT)}
        return loss_sum, weight, stats

    def summarize(self, stats):
        tokens = jnp.maximum(stats["tokens"], 1.0)
        return {"trained_tokens": stats["tokens"],
                "ratio_mean": stats["ratio_sum"] / tokens,
                "ratio_min": stats["ratio_min"], "ratio_max": stats["ratio_max"],
                "clip_fraction": stats["clipped"] / tokens,
                "ess": effective_sample_size(stats["ratio_sum"], stats["ratio_sq_sum"],
                                             stats["tokens"]),
                "kl_new_old": stats["kl_new_old_sum"] / tokens,
                "kl_ref": stats["kl_ref_sum"] / tokens,
                "entropy": stats["entropy_sum"] / tokens}
