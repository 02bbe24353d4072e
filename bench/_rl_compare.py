"""Shared by the RL benchmarks (async_vs_sync, long_tail): runs variants of one RL config from
the same warm-up checkpoint, one after the other in one process, and compares them.

A variant is a name and config overrides (e.g. "partial": ["rl.mode=partial"]). Every variant
gets the same config, checkpoint, hardware and sample budget (rl.steps x rl.batch_size).

Time to target: wall time (compilation and held-out evaluation excluded) until the success rate
of the generated samples, averaged over a window of steps, first reaches the target. The success
rate is measured on freshly drawn training problems at the sampling temperature.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from jaxrl.config import load_run_config
from jaxrl.trainer import rl as rl_run
from jaxrl.trainer import warmup

VARIANTS = {
    "sync": ["rl.mode=sync"],
    "partial": ["rl.mode=partial"],
    "async": ["rl.mode=async"],
    "async+longest_first": ["rl.mode=async", "rl.admission=longest_first"],
}


def add_arguments(p, *, config: Path, rl_steps: int, target: float, window: int,
                  variants: list[str]) -> None:
    p.add_argument("--config", default=str(config), help="YAML run config")
    p.add_argument("--rl-steps", type=int, default=rl_steps, help="RL steps per variant")
    p.add_argument("--target", type=float, default=target, help="success rate to reach")
    p.add_argument("--window", type=int, default=window, help="steps averaged for the target")
    p.add_argument("--variants", nargs="+", default=variants, choices=list(VARIANTS),
                   help="what to compare; the first is the baseline of the ratios")
    p.add_argument("--warmup-dir", default=None,
                   help="checkpoint dir holding the warm-up's last step, train.steps "
                        "(None: train the warm-up first)")
    p.add_argument("--save", default=None,
                   help="also write every variant's per-step metrics to this JSON file")
    p.add_argument("overrides", nargs="*", default=[], metavar="section.key=value",
                   help="config overrides for every variant")


def success(rows: list[dict]) -> np.ndarray:
    """Success rate per step; NaN where no sample finished during the step."""
    return np.asarray([np.nan if r.get("success_rate") is None else r["success_rate"]
                       for r in rows])


def time_to_target(rows: list[dict], target: float, window: int) -> float | None:
    rate = success(rows)
    times = np.asarray([r["time_s"] for r in rows])
    for i in range(window, len(rows) + 1):
        window_rate = rate[i - window: i]
        if np.isfinite(window_rate).any() and np.nanmean(window_rate) >= target:
            return float(times[i - 1] - times[0])
    return None


def warm_checkpoint(args, work: Path) -> Path:
    """A directory holding only the warm-up's last checkpoint: trained here unless
    --warmup-dir names one."""
    cfg = load_run_config(args.config, [f"run_dir={work / 'warmup'}", "rl.steps=0",
                                        "train.eval_problems=0", *args.overrides])
    warmup_dir = args.warmup_dir
    if warmup_dir is None:
        warmup.train(cfg, log=lambda m: None, evaluate_at_end=False)
        warmup_dir = cfg.checkpoint_dir
    step = cfg.train.steps
    if not (Path(warmup_dir) / str(step)).is_dir():
        raise SystemExit(f"--warmup-dir {warmup_dir} has no checkpoint of step {step} "
                         f"(train.steps), the warm-up's last")
    base = work / "base"
    shutil.copytree(Path(warmup_dir) / str(step), base / str(step))
    return base


def run_variant(base: Path, work: Path, name: str, args, extra: tuple[str, ...] = ()) -> dict:
    """RL from the warm-up checkpoint `base` with variant `name`'s overrides (VARIANTS, or
    `extra` for a variant of the caller's own)."""
    run_dir = work / name.replace("+", "_")
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.copytree(base, run_dir / "checkpoints")
    cfg = load_run_config(args.config, [
        f"run_dir={run_dir}", f"rl.steps={args.rl_steps}", "train.eval_problems=0",
        "log.progress=false", f"checkpoint.every={10**9}", *args.overrides, *VARIANTS.get(name, ()),
        *extra])
    summary = rl_run.reinforce(cfg, log=lambda m: None)
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    rows = [r for r in rows if "success_rate" in r][1:]  # the first step includes compilation
    return {"variant": name, "samples_per_s": summary["samples_per_s"],
            "seconds": rows[-1]["time_s"] - rows[0]["time_s"],
            "time_to_target_s": time_to_target(rows, args.target, args.window),
            "final_success": float(np.nanmean(success(rows)[-args.window:])),
            "lag_mean": summary["lag_mean"],
            "slots_busy": float(np.mean([r["slots_busy_fraction"] for r in rows])),
            "held_tokens_mean": float(np.mean([r["held_tokens_mean"] for r in rows])),
            "completion_len_p50": float(np.nanmedian(
                [r.get("completion_len_p50") or np.nan for r in rows])),
            "rows": rows}


def report(results: dict[str, dict], save: str | None = None) -> None:
    """The table, then every variant's ratios against the first (the baseline); with `save`,
    every variant's per-step rows to that JSON file as well."""
    if save:
        Path(save).write_text(json.dumps(results))
    print(f"{'variant':<20} {'samples/s':>10} {'seconds':>8} {'to target':>10} "
          f"{'final success':>14} {'lag':>5} {'slots busy':>10} {'held tokens':>11}")
    for r in results.values():
        ttt = f"{r['time_to_target_s']:.1f}" if r["time_to_target_s"] is not None else "never"
        print(f"{r['variant']:<20} {r['samples_per_s']:>10.1f} {r['seconds']:>8.1f} {ttt:>10} "
              f"{r['final_success']:>14.3f} {r['lag_mean']:>5.2f} {r['slots_busy']:>10.2f} "
              f"{r['held_tokens_mean']:>11.0f}")
    base_name, *others = results
    base = results[base_name]
    for name in others:
        r = results[name]
        line = f"{name} vs {base_name}: samples/s {r['samples_per_s'] / base['samples_per_s']:.2f}x"
        mine, theirs = r["time_to_target_s"], base["time_to_target_s"]
        if mine is None or theirs is None:
            line += "; time to target: not reached by both"
        elif min(mine, theirs) == 0:
            line += "; time to target: reached within the first window"
        else:
            line += (f"; time to target {theirs / mine:.2f}x as fast ({mine:.1f} s against "
                     f"{theirs:.1f} s)")
        print(line)
    print(json.dumps({name: {k: v for k, v in r.items() if k != "rows"}
                      for name, r in results.items()}))
