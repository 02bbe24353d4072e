"""What the actor says about the samples its filters drop before the trainer: the counters
behind each filter, the report of which filters dropped how many (with what to change), and
the error that stops a run whose filters let nothing through for rl.filter_wait_s."""

from __future__ import annotations

from jaxrl.errors import UserError
from jaxrl.rl.config import RLConfig


class FilterStall(UserError):
    """The filters dropped every sample for rl.filter_wait_s; the message names them."""


# The counters of samples dropped before the trainer, and the setting behind each.
FILTERS = {"dropped_overlong": "rl.filter_overlong",
           "dropped_zero_advantage": "rl.filter_zero_advantage",
           "dropped_reward_error": "the reward's failures",
           "dropped_agent": "the agents' lost episodes"}


def filter_drops(now: dict, before: dict) -> dict[str, int]:
    """Samples each filter dropped between two snapshots of the actor's counters."""
    return {k: now.get(k, 0) - before.get(k, 0) for k in FILTERS}


def generated_samples(stats: dict) -> int:
    """Samples that reached the filters: scored, or lost to the reward or the agents."""
    return stats.get("scored", 0) + stats.get("dropped_reward_error", 0) + \
        stats.get("dropped_agent", 0)


def describe_drops(now: dict, before: dict, cfg: RLConfig) -> str:
    """Which filters dropped how many samples between two snapshots of the actor's counters,
    the largest first, with what to change for each; "" when none dropped any."""
    advice = {
        "dropped_overlong": f"samples cut at rl.max_new_tokens={cfg.max_new_tokens}: raise it, "
                            f"or train on them with rl.filter_overlong=false",
        "dropped_zero_advantage": "groups whose rewards were all equal: a denser reward, a "
                                  "larger rl.group_size, or rl.filter_zero_advantage=false",
        "dropped_reward_error": "the reward raised or timed out (see its reports above)",
        "dropped_agent": "episodes the agent programs lost (see their stderr)"}
    generated = generated_samples(now) - generated_samples(before)
    dropped = filter_drops(now, before)
    parts = [f"{n} of {generated} samples by {FILTERS[k]} ({advice[k]})"
             for k, n in sorted(dropped.items(), key=lambda kv: -kv[1]) if n]
    return "dropped " + "; ".join(parts) if parts else ""
