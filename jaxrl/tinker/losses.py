"""The Tinker API's built-in losses, as its documentation defines them: token-wise, summed over
every token of every datum (no normalisation: the caller scales its weights or advantages), on
the log-probabilities of `target_tokens` under the model being trained.

    cross_entropy        -sum(weights * logp)
    importance_sampling  -sum(exp(logp - q) * A)
    ppo                  -sum(min(r * A, clip(r, lo, hi) * A)),  r = exp(logp - q)
    cispo                -sum(sg(clip(r, lo, hi)) * logp * A)

q is the sampler's log-probabilities (`logprobs`), A the `advantages`. ppo's thresholds default
to 0.8 and 1.2, cispo's to 0 and 4 (`loss_fn_config`'s clip_low_threshold, clip_high_threshold).
A custom loss (the SDK's forward_backward_custom) reaches the service as cross_entropy with its
gradient in `weights`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Loss:
    inputs: tuple[str, ...]             # loss_fn_inputs it needs beside target_tokens
    optional: tuple[str, ...] = ()      # ... and may take (missing: ones)
    clip: tuple[float, float] | None = None   # default (clip_low, clip_high) thresholds


LOSSES = {
    "cross_entropy": Loss((), ("weights",)),
    "importance_sampling": Loss(("logprobs", "advantages")),
    "ppo": Loss(("logprobs", "advantages"), clip=(0.8, 1.2)),
    "cispo": Loss(("logprobs", "advantages"), clip=(0.0, 4.0)),
}
# The SDK's other names, which jaxrl does not compute (say so rather than guess a formula).
UNSUPPORTED = ("dro", "gspo", "stable_reinforce")
CONFIG_KEYS = ("clip_low_threshold", "clip_high_threshold")


def check(loss_fn: str, config: dict[str, float], datums) -> Loss:
    """The loss named, with `datums`' inputs checked against it: ValueError naming the datum
    and field for a missing, unknown or mis-sized input."""
    if loss_fn not in LOSSES:
        why = " (not computed by jaxrl)" if loss_fn in UNSUPPORTED else ""
        raise ValueError(f"loss_fn {loss_fn!r}{why}: one of {', '.join(LOSSES)}")
    loss = LOSSES[loss_fn]
    unknown = set(config) - set(CONFIG_KEYS if loss.clip else ())
    if unknown:
        raise ValueError(f"loss_fn_config {sorted(unknown)} for {loss_fn}: it takes "
                         f"{list(CONFIG_KEYS) if loss.clip else 'none'}")
    allowed = {"target_tokens", *loss.inputs, *loss.optional}
    for i, d in enumerate(datums):
        n = len(d.tokens)
        if n == 0:
            raise ValueError(f"datum {i}: model_input has no tokens")
        missing = {"target_tokens", *loss.inputs} - set(d.inputs)
        if missing:
            raise ValueError(f"datum {i}: {loss_fn} needs loss_fn_inputs {sorted(missing)}")
        extra = set(d.inputs) - allowed
        if extra:
            raise ValueError(f"datum {i}: loss_fn_inputs {sorted(extra)} are not inputs of "
                             f"{loss_fn} (it takes {sorted(allowed)})")
        for name, value in d.inputs.items():
            if value.shape != (n,):
                raise ValueError(f"datum {i}: loss_fn_inputs[{name!r}] has shape "
                                 f"{list(value.shape)}; the model input has {n} tokens, so "
                                 f"[{n}]")
            if name != "target_tokens" and not np.all(np.isfinite(value)):
                raise ValueError(f"datum {i}: loss_fn_inputs[{name!r}] is not finite")
    return loss


def thresholds(loss: Loss, config: dict[str, float]) -> tuple[float, float]:
    low, high = loss.clip or (0.0, 0.0)
    return (config.get("clip_low_threshold", low), config.get("clip_high_threshold", high))


def token_losses(loss_fn: str, logp_BT, inputs: dict, clip_low, clip_high):
    """Each token's loss [B, T] (zero where `mask` is), from the target log-probs `logp_BT`
    and the padded `inputs` (weights, logprobs, advantages, mask: [B, T])."""
    mask = inputs["mask"]
    if loss_fn == "cross_entropy":
        return -inputs["weights"] * logp_BT * mask
    adv, q = inputs["advantages"], inputs["logprobs"]
    ratio = jnp.exp(jnp.where(mask > 0, logp_BT - q, 0.0))
    if loss_fn == "importance_sampling":
        return -ratio * adv * mask
    clipped = jnp.clip(ratio, clip_low, clip_high)
    if loss_fn == "ppo":
        return -jnp.minimum(ratio * adv, clipped * adv) * mask
    if loss_fn == "cispo":
        return -jax.lax.stop_gradient(clipped) * logp_BT * adv * mask
    raise ValueError(f"loss_fn {loss_fn!r}")
