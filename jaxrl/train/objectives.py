"""What a train step minimises, per microbatch: `(loss_sum, weight, stats)`.

The step sums loss_sum, weight and stats over microbatches (stats named `*_min` / `*_max` are
combined with min / max) and minimises sum(loss_sum) / sum(weight), so gradient accumulation
is exact. `summarize` turns the combined stats into the metrics a user reads.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxrl.models.context_attention import context_size
from jaxrl.models.layers import soft_cap
from jaxrl.models.moe import load_balancing_loss
from jaxrl.rl.losses import LossSettings, effective_sample_size, policy_loss


def token_logp(model, mb, temperature: float = 1.0, stack_fn=None, chunk: int = 512):
    """(log-prob of each target token [B, T], entropy of each next-token distribution [B, T],
    whether the target is the argmax [B, T]) under softmax(logits / temperature), the
    distribution the engine samples from. `stack_fn`: how the layer stack runs (a remat policy
    or a pipeline schedule, sharding/). Logits exist `chunk` positions at a time (see
    `chunked_token_stats`); chunk=0: all at once. The model routes with its own routers."""
    x_BTD = model.hidden(mb["input_ids"], mb.get("positions"), mb.get("segment_ids"), stack_fn)
    return chunked_token_stats(x_BTD, model.head(), mb["targets"], temperature, chunk,
                               model.cfg.final_softcap)


def routed_token_logp(model, mb, temperature: float = 1.0, stack_fn=None, chunk: int = 512,
                      replay: bool = False):
    """`token_logp` and what a MoE model's routing adds (else {}): where the batch holds the
    engine's routing (`routes` [B, T, L, K]), `mismatch`, whether each token's experts differ
    from it per layer [L, B, T]; with model.router_aux_loss_coef, `load_balancing`, the
    microbatch's load-balancing loss. `replay`: the layers run the engine's experts instead of
    their routers' choice."""
    cfg = model.cfg
    routes = mb.get("routes") if cfg.num_experts else None
    if routes is None and not cfg.router_aux_loss_coef:
        return (*token_logp(model, mb, temperature, stack_fn, chunk), {})
    x_BTD, aux_L = model.hidden_aux(mb["input_ids"], mb.get("positions"), mb.get("segment_ids"),
                                    stack_fn, routes, replay)
    out = {"mismatch": aux_L["mismatch"]} if "mismatch" in aux_L else {}
    if cfg.router_aux_loss_coef:
        out["load_balancing"] = load_balancing_loss(aux_L)
    return (*chunked_token_stats(x_BTD, model.head(), mb["targets"], temperature, chunk,
                                 cfg.final_softcap), out)


def with_load_balancing(model, loss_sum, weight, stats: dict, routing: dict):
    """The load-balancing loss added to the microbatch's loss sum (weighted like its other
    tokens: the step divides the sum by the total weight) and to its stats."""
    if "load_balancing" not in routing:
        return loss_sum, stats
    lb = routing["load_balancing"]
    return (loss_sum + model.cfg.router_aux_loss_coef * lb * weight,
            {**stats, "router_aux_sum": jax.lax.stop_gradient(lb) * weight,
             "router_aux_weight": weight})


def summarize_load_balancing(stats) -> dict:
    if "router_aux_sum" not in stats:
        return {}
    return {"router_aux_loss": stats["router_aux_sum"]
            / jnp.maximum(stats["router_aux_weight"], 1e-9)}


def chunked_token_stats(x_BTD, head_DV, targets_BT, temperature: float = 1.0, chunk: int = 512,
                        softcap: float | None = None):
    """Per-token (log-prob of the target, entropy, target == argmax) from final hidden states,
    without a [B, T, V] float32 tensor: a scan over equal chunks of at most `chunk` positions
    (as few as that allows, so little is padded) whose body is rematerialised, so the forward
    keeps one chunk's logits at a time and the backward recomputes each chunk's from its hidden
    states (Liger's fused linear cross-entropy, in plain JAX). At 8k tokens and a 152k
    vocabulary that is the difference between 5 GB of logits per row and 0.3 GB per chunk of
    512. `softcap`: the model's final-logit soft-cap
    (Gemma 2), applied before the temperature as the engine does."""
    b, t, d = x_BTD.shape
    # Under context parallelism (rows split over K devices) each device chunks its own part:
    # a chunk's positions stay on their device instead of being gathered to one.
    k = context_size()
    local = t // k
    n = 1 if chunk <= 0 else -(-local // chunk)
    c = -(-local // n)    # n even chunks of at most `chunk`: 529 positions are 2 x 265, not 2 x 512
    pad = n * c - local

    def chunked(a_BT):     # [B, T, ...] -> [N, B, K, C, ...]
        a = a_BT.reshape(b, k, local, *a_BT.shape[2:])
        a = jnp.pad(a, ((0, 0), (0, 0), (0, pad)) + ((0, 0),) * (a.ndim - 3))
        return jnp.moveaxis(a.reshape(b, k, n, c, *a.shape[3:]), 2, 0)

    @jax.checkpoint
    def stats(x_BKCD, targets_BKC):
        logits_BKCV = soft_cap(jnp.einsum("bkcd,dv->bkcv", x_BKCD, head_DV,
                                          preferred_element_type=jnp.float32),
                               softcap) / temperature
        logz_BKC = jax.nn.logsumexp(logits_BKCV, axis=-1)
        target_BKC = jnp.take_along_axis(logits_BKCV, targets_BKC[..., None], axis=-1)[..., 0]
        probs_BKCV = jnp.exp(logits_BKCV - logz_BKC[..., None])
        entropy_BKC = logz_BKC - jnp.sum(probs_BKCV * logits_BKCV, axis=-1)
        correct_BKC = jnp.argmax(logits_BKCV, axis=-1) == targets_BKC
        return target_BKC - logz_BKC, entropy_BKC, correct_BKC

    _, (logp_NBKC, entropy_NBKC, correct_NBKC) = jax.lax.scan(
        lambda carry, xs: (carry, stats(*xs)), None, (chunked(x_BTD), chunked(targets_BT)))

    def unchunk(a_NBKC):
        return jnp.moveaxis(a_NBKC, 0, 2).reshape(b, k, n * c)[:, :, :local].reshape(b, t)

    return unchunk(logp_NBKC), unchunk(entropy_NBKC), unchunk(correct_NBKC)


@dataclasses.dataclass(frozen=True)
class SupervisedLoss:
    """Mean negative log-likelihood of the masked target tokens."""

    logits_chunk: int = 512   # positions whose logits exist at once (token_logp); 0: all
    behaviour: str = "engine"  # trainer: mu of lag-0 tokens is the trainer's own log-prob

    def __call__(self, model, mb, ref_model=None, stack_fn=None):
        logp_BT, _, correct_BT, routing = routed_token_logp(model, mb, stack_fn=stack_fn,
                                                            chunk=self.logits_chunk)
        mask_BT = mb["loss_mask"].astype(jnp.float32)
        correct_BT = correct_BT.astype(jnp.float32)
        tokens = jnp.sum(mask_BT)
        loss_sum, stats = with_load_balancing(model, -jnp.sum(logp_BT * mask_BT), tokens, {
            "tokens": tokens, "correct": jnp.sum(correct_BT * mask_BT)}, routing)
        return loss_sum, tokens, stats

    def summarize(self, stats):
        tokens = jnp.maximum(stats["tokens"], 1.0)
        return {"tokens": stats["tokens"], "token_accuracy": stats["correct"] / tokens,
                **summarize_load_balancing(stats)}


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
    logits_chunk: int = 512   # positions whose logits exist at once (token_logp); 0: all
    behaviour: str = "engine"  # trainer: mu of lag-0 tokens is the trainer's own log-prob
    moe_routing: str = "own"   # replay: a MoE model runs the engine's experts (rl.moe_routing)
    correction: str = "none"   # rl.rollout_correction (jaxrl/rl/losses.py)
    correction_low: float = 0.5
    correction_high: float = 5.0

    def __call__(self, model, mb, ref_model=None, stack_fn=None):
        logp_BT, entropy_BT, _, routing = routed_token_logp(
            model, mb, self.temperature, stack_fn, self.logits_chunk,
            replay=self.moe_routing == "replay")
        ref_logp_BT = mb.get("ref_logp")          # computed by a pipeline's R ops
        if ref_logp_BT is None and ref_model is not None:
            ref_logp_BT = self.reference_logp(ref_model, mb)
        behaviour_BT = mb["behaviour_logp"]
        if self.behaviour == "trainer" and "on_policy" in mb:
            behaviour_BT = jnp.where(mb["on_policy"] > 0, jax.lax.stop_gradient(logp_BT),
                                     behaviour_BT)
        settings = LossSettings(self.kind, self.clip_low, self.clip_high, self.tis_cap,
                                self.kl_coef, self.max_segments, self.correction,
                                self.correction_low, self.correction_high)
        loss_sum, weight, stats = policy_loss(logp_BT, behaviour_BT, mb["advantages"],
                                              mb["loss_mask"], mb["segment_ids"], settings,
                                              ref_logp_BT)
        mask_BT = mb["loss_mask"].astype(jnp.float32)
        stats = {**stats, "entropy_sum": jnp.sum(jax.lax.stop_gradient(entropy_BT) * mask_BT)}
        if "on_policy" in mb:
            stats.update(logprob_parity(jax.lax.stop_gradient(logp_BT), mb["behaviour_logp"],
                                        mb["on_policy"]))
            if "mismatch" in routing:
                stats.update(routing_parity(routing["mismatch"], mb["routes"], mb["on_policy"]))
        loss_sum, stats = with_load_balancing(model, loss_sum, weight, stats, routing)
        return loss_sum, weight, stats

    def reference_logp(self, ref_model, mb, stack_fn=None):
        """The frozen reference model's log-prob of each target token [B, T] (the KL term's
        anchor); `stack_fn` as in `token_logp`."""
        return jax.lax.stop_gradient(token_logp(ref_model, mb, self.temperature, stack_fn,
                                                self.logits_chunk)[0])

    def summarize(self, stats):
        tokens = jnp.maximum(stats["tokens"], 1.0)
        return {"trained_tokens": stats["tokens"],
                "ratio_mean": stats["ratio_sum"] / tokens,
                "ratio_min": stats["ratio_min"], "ratio_max": stats["ratio_max"],
                "clip_fraction": stats["clipped"] / tokens,
                "corrected_fraction": stats["corrected"] / tokens,
                "ess": effective_sample_size(stats["ratio_sum"], stats["ratio_sq_sum"],
                                             stats["tokens"]),
                "kl_new_old": stats["kl_new_old_sum"] / tokens,
                "kl_ref": stats["kl_ref_sum"] / tokens,
                "entropy": stats["entropy_sum"] / tokens,
                **summarize_parity(stats), **summarize_routing(stats),
                **summarize_load_balancing(stats)}


def logprob_parity(logp_BT, behaviour_BT, on_policy_BT) -> dict:
    """Sums (and the largest gap) of the trainer's log-prob minus the sampler's over the tokens
    whose whole context (prompt, earlier tokens, the token itself) the weights the trainer holds
    computed (`on_policy`, lag 0), where the two should agree up to numerics (dtypes, cached
    against full attention, kernels). A token sampled after an in-flight update is left out:
    its earlier keys and values came from older weights, a real difference, not numerics."""
    d_BT = (logp_BT - behaviour_BT) * on_policy_BT
    counted = on_policy_BT > 0
    # k3 estimate of KL(sampler || trainer) per token: r - 1 - log r, r = pi / mu; >= 0.
    k3_BT = jnp.where(counted, jnp.expm1(d_BT) - d_BT, 0.0)
    return {"parity_tokens": jnp.sum(on_policy_BT), "parity_diff_sum": jnp.sum(d_BT),
            "parity_kl_sum": jnp.sum(k3_BT),
            "parity_abs_diff_max": jnp.max(jnp.where(counted, jnp.abs(d_BT), -jnp.inf))}


def routing_parity(mismatch_LBT, routes_BTLK, on_policy_BT) -> dict:
    """Counts, over the lag-0 tokens whose engine routing is known, of tokens where any layer's
    set of experts differs between engine and trainer, and of (token, layer) choices that do."""
    counted_BT = (on_policy_BT > 0) & jnp.all(routes_BTLK >= 0, axis=(-2, -1))
    layers = mismatch_LBT.shape[0]
    any_BT = jnp.any(mismatch_LBT, axis=0) & counted_BT
    choices_BT = jnp.sum(mismatch_LBT, axis=0) * counted_BT
    return {"routing_tokens": jnp.sum(counted_BT).astype(jnp.float32),
            "routing_choices": jnp.sum(counted_BT).astype(jnp.float32) * layers,
            "routing_mismatch_sum": jnp.sum(any_BT).astype(jnp.float32),
            "routing_choice_mismatch_sum": jnp.sum(choices_BT).astype(jnp.float32)}


def summarize_routing(stats) -> dict:
    """router_mismatch: the share of lag-0 tokens whose experts differ in any layer;
    router_choice_mismatch: the share of (token, layer) choices that differ (NaN, logged as
    null, when no such token)."""
    if "routing_tokens" not in stats:
        return {}
    n, some = stats["routing_tokens"], stats["routing_tokens"] > 0
    return {"router_mismatch": jnp.where(
                some, stats["routing_mismatch_sum"] / jnp.maximum(n, 1.0), jnp.nan),
            "router_choice_mismatch": jnp.where(
                some, stats["routing_choice_mismatch_sum"]
                / jnp.maximum(stats["routing_choices"], 1.0), jnp.nan)}


def summarize_parity(stats) -> dict:
    """The per-step parity metrics (NaN, logged as null, when no token had lag 0)."""
    if "parity_tokens" not in stats:
        return {}
    n = stats["parity_tokens"]
    some = n > 0
    mean = lambda key: jnp.where(some, stats[key] / jnp.maximum(n, 1.0), jnp.nan)  # noqa: E731
    return {"logprob_parity_tokens": n, "logprob_diff_mean": mean("parity_diff_sum"),
            "logprob_abs_diff_max": jnp.where(some, stats["parity_abs_diff_max"], jnp.nan),
            "logprob_kl": mean("parity_kl_sum")}
