"""What an RL run reports each optimizer step: the trained batch, what was generated since the
last step, where every sample went, the engines' and the weight publisher's counters."""

from __future__ import annotations

import math
import time

import numpy as np

from jaxrl.data.rollouts import Rollout


def batch_stats(rollouts: list[Rollout], step: int) -> tuple[dict, np.ndarray]:
    """Statistics of the samples a step trained on (after the filters), and their lags."""
    rewards = np.asarray([r.reward for r in rollouts])
    lags = np.asarray([step - min(r.versions) for r in rollouts])
    return {"trained_reward": float(rewards.mean()),
            "lag_min": int(lags.min()), "lag_mean": float(lags.mean()),
            "lag_max": int(lags.max()),
            "completion_tokens": float(np.mean([len(r.completion) for r in rollouts]))}, lags


def sample_counts(actor_stats: dict, trained: int, dropped_lag: int) -> dict:
    """Where every sample went, cumulative over the run (a resumed run continues the counts):
    generated = dropped_zero_advantage + dropped_overlong + kept, and
    kept = trained + dropped_lag + what waits in the rollout stream (a checkpoint's `rollouts`,
    when the checkpoint is taken). dropped_agent: episodes an external agent lost, and
    dropped_reward_error: samples whose reward raised or timed out (neither scored, so not
    generated)."""
    return {"samples_generated": actor_stats["scored"], "samples_kept": actor_stats["samples"],
            "samples_trained": trained, "dropped_lag": dropped_lag,
            "dropped_zero_advantage": actor_stats["dropped_zero_advantage"],
            "dropped_overlong": actor_stats["dropped_overlong"],
            "dropped_agent": actor_stats["dropped_agent"],
            "dropped_reward_error": actor_stats["dropped_reward_error"],
            "carried_tokens": actor_stats["carried_tokens"]}


def episode_stats(now: dict, before: dict) -> dict:
    """Multi-turn episodes finished since the last row: turns and tool calls per episode, the
    share of tool calls that failed, and environment tokens per model token. Empty for a
    single-turn task."""
    d = {k: now.get(k, 0) - before.get(k, 0) for k in
         ("episodes", "turns", "tool_calls", "tool_errors", "model_tokens", "env_tokens")}
    if not now.get("episodes"):
        return {}
    per = max(d["episodes"], 1)
    return {"episodes": d["episodes"], "turns_per_episode": d["turns"] / per,
            "tool_calls_per_episode": d["tool_calls"] / per,
            "tool_error_rate": d["tool_errors"] / max(d["tool_calls"], 1),
            "env_tokens_per_model_token": d["env_tokens"] / max(d["model_tokens"], 1)}


# The engine's speculative-decoding counters (serving/core/speculation.py).
SPECULATION = ("spec_decode_verify_steps", "spec_decode_num_drafts",
               "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


def speculation_stats(delta: dict) -> dict:
    """Speculative decoding since the last row: verify steps, draft and accepted tokens, and
    the mean acceptance length (tokens a verify step kept a row); nothing when none ran."""
    drafts = delta["spec_decode_num_drafts"]
    if not delta["spec_decode_verify_steps"]:
        return {}
    return {"spec_verify_steps": delta["spec_decode_verify_steps"],
            "spec_draft_tokens": delta["spec_decode_num_draft_tokens"],
            "spec_accepted_tokens": delta["spec_decode_num_accepted_tokens"],
            "spec_acceptance_length":
                1 + delta["spec_decode_num_accepted_tokens"] / max(drafts, 1)}


def length_quantiles(lengths: list[int]) -> dict:
    """The output-length distribution of the samples generated during a step (before filters):
    completion_len_{p10,p50,p90,max}; none when no group finished during the step."""
    if not lengths:
        return {}
    p10, p50, p90 = np.percentile(lengths, [10, 50, 90])
    return {"completion_len_p10": float(p10), "completion_len_p50": float(p50),
            "completion_len_p90": float(p90), "completion_len_max": float(max(lengths))}


def rate(rows: list[dict], batch_size: int) -> float:
    """Samples per second over the rows, the first step (compilation) excluded."""
    if len(rows) < 2:
        return 0.0
    return batch_size * (len(rows) - 1) / max(rows[-1]["time_s"] - rows[0]["time_s"], 1e-9)


class StepMetrics:
    """Builds each step's row from counter deltas since the previous row."""

    def __init__(self, batch_size: int, actor, fleet, publisher, lag_stats, trained: int,
                 now: float):
        self.batch_size = batch_size
        self.actor, self.fleet, self.publisher, self.lag_stats = actor, fleet, publisher, lag_stats
        self.trained = trained
        # Servers listed, or joining later (an elastic fleet may start empty).
        self.remote = publisher.elastic or any(m.remote for m in fleet.members)
        self._engine, self._actor, self._t = fleet.metrics(), actor.stats.copy(), now

    def row(self, step: int, batch: dict, train_metrics: dict, *, now: float, wait_s: float,
            step_s: float, update: dict) -> tuple[dict, np.ndarray, list[int]]:
        """(row, the batch's lags, the lengths generated since the last row) after optimizer
        step `step` trained on `batch`."""
        stats, lags = batch_stats(batch["rollouts"], step - 1)
        self.trained += len(batch["rollouts"])
        dt = max(now - self._t, 1e-9)
        # One snapshot for this row's deltas and the next row's baseline: the collectors keep
        # counting while the row is built, and a count made in between must land in a row.
        engine, actor_now = self.fleet.metrics(), self.actor.stats.copy()
        # Reward and success of everything generated since the last step, before filters.
        # NaN (logged as null) when nothing finished since the last step.
        scored = actor_now["scored"] - self._actor["scored"]
        stats["reward"] = ((actor_now["reward_sum"] - self._actor["reward_sum"]) / scored
                           if scored else math.nan)
        stats["success_rate"] = ((actor_now["solved"] - self._actor["solved"]) / scored
                                 if scored else math.nan)
        delta = {k: engine.get(k, 0) - self._engine.get(k, 0)
                 for k in ("generated_tokens", "busy_slot_steps", "slot_steps", "held_tokens",
                           "trainer_generated_tokens", *SPECULATION)}
        row = {**train_metrics, **stats, "time_s": now, "samples_per_s": self.batch_size / dt,
               # the process's CPU seconds so far (all threads) and the wall-clock time
               "process_cpu_s": time.process_time(), "unix_time": time.time(),
               "generated_tokens_per_s": delta["generated_tokens"] / dt,
               "trainer_wait_s": wait_s, "step_s": step_s, **update,
               "slots_busy_fraction": delta["busy_slot_steps"] / max(delta["slot_steps"], 1),
               **self.lag_stats.fractions(),
               **sample_counts(actor_now, self.trained, self.lag_stats.total),
               "microbatches": batch["microbatches"]}
        row["trained_tokens_per_s"] = row["trained_tokens"] / dt
        row["held_tokens_mean"] = delta["held_tokens"] / max(delta["busy_slot_steps"], 1)
        row.update(speculation_stats(delta))
        if any(m.trains for m in self.fleet.members):     # rl.multiplex
            row["trainer_generated_share"] = (delta["trainer_generated_tokens"]
                                              / max(delta["generated_tokens"], 1))
            row["groups_withdrawn"] = engine["groups_withdrawn"]
        if self.remote:
            push = self.publisher.metrics()
            row.update({k: engine[k] for k in ("members_ready", "slots_ready", "groups_moved",
                                               "members_set_aside")},
                       **{k: push[k] for k in ("pushes", "push_timeouts", "push_failures",
                                               "push_relay_retries", "push_bytes",
                                               "push_bytes_per_s", "update_pause_ms_max")})
        row.update(episode_stats(actor_now, self._actor))
        lengths = self.actor.take_lengths()
        row.update(length_quantiles(lengths))
        self._engine, self._actor, self._t = engine, actor_now, now
        return row, lags, lengths
