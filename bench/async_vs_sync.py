"""Async (PipelineRL) against sync RL: samples/s and time to a target success rate.

Async (in-flight weight updates) and sync (conventional) RL with the same config, the same
warm-up checkpoint, the same hardware and the same sample budget, run one after the other in
one process. Prints the samples/s ratio and the time-to-target ratio.

Time to target: wall time (compilation and held-out evaluation excluded) until the success
rate of the generated samples, averaged over a window of steps, first reaches --target. The
success rate is measured on freshly drawn training problems at the sampling temperature.

    jaxrl bench async_vs_sync --config configs/demo_cpu.yaml --rl-steps 400 --target 0.35
    (or: .venv/bin/python bench/async_vs_sync.py ...)
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np

from jaxrl.config import load_run_config
from jaxrl.run import rl as rl_run
from jaxrl.run import warmup

# The demo recipe, found from this file so that the bench runs from any directory.
DEMO_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo_cpu.yaml"


def _success(rows: list[dict]) -> np.ndarray:
    """Success rate per step; NaN where no sample finished during the step."""
    return np.asarray([np.nan if r["success_rate"] is None else r["success_rate"] for r in rows])


def time_to_target(rows: list[dict], target: float, window: int) -> float | None:
    success = _success(rows)
    times = np.asarray([r["time_s"] for r in rows])
    for i in range(window, len(rows) + 1):
        if np.nanmean(success[i - window: i]) >= target:
            return float(times[i - 1] - times[0])
    return None


def run_mode(base: Path, work: Path, mode: str, args) -> dict:
    run_dir = work / mode
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.copytree(base, run_dir / "checkpoints")
    cfg = load_run_config(args.config, [
        f"run_dir={run_dir}", f"rl.mode={mode}", f"rl.steps={args.rl_steps}",
        "train.eval_problems=0", "log.progress=false", f"checkpoint.every={10**9}",
        *args.overrides])
    summary = rl_run.reinforce(cfg, log=lambda m: None)
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    rows = [r for r in rows if "success_rate" in r][1:]  # the first step includes compilation
    return {"mode": mode, "samples_per_s": summary["samples_per_s"],
            "seconds": rows[-1]["time_s"] - rows[0]["time_s"],
            "time_to_target_s": time_to_target(rows, args.target, args.window),
            "final_success": float(np.nanmean(_success(rows)[-args.window:])),
            "lag_mean": summary["lag_mean"],
            "slots_busy": float(np.mean([r["slots_busy_fraction"] for r in rows]))}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", default=str(DEMO_CONFIG), help="YAML run config")
    p.add_argument("--rl-steps", type=int, default=400, help="RL steps per mode")
    p.add_argument("--target", type=float, default=0.35, help="success rate to reach")
    p.add_argument("--window", type=int, default=20, help="steps averaged for the target")
    p.add_argument("--warmup-dir", default=None,
                   help="checkpoint dir holding the warm-up's last step, train.steps "
                        "(default: %(default)s, train the warm-up first)")
    p.add_argument("overrides", nargs="*", default=[], metavar="section.key=value",
                   help="config overrides for both modes")
    args = p.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="jaxrl-bench-"))
    cfg = load_run_config(args.config, [f"run_dir={work / 'warmup'}", "rl.steps=0",
                                        "train.eval_problems=0", *args.overrides])
    if args.warmup_dir is None:
        warmup.train(cfg, log=lambda m: None, evaluate_at_end=False)
        args.warmup_dir = cfg.checkpoint_dir
    base, step = work / "base", cfg.train.steps
    if not (Path(args.warmup_dir) / str(step)).is_dir():
        raise SystemExit(f"--warmup-dir {args.warmup_dir} has no checkpoint of step {step} "
                         f"(train.steps), the warm-up's last")
    shutil.copytree(Path(args.warmup_dir) / str(step), base / str(step))

    results = {mode: run_mode(base, work, mode, args) for mode in ("sync", "async")}
    print(f"{'mode':<6} {'samples/s':>10} {'seconds':>8} {'to target':>10} {'final success':>14}"
          f" {'lag':>5} {'slots busy':>10}")
    for r in results.values():
        ttt = f"{r['time_to_target_s']:.1f}" if r["time_to_target_s"] is not None else "never"
        print(f"{r['mode']:<6} {r['samples_per_s']:>10.0f} {r['seconds']:>8.1f} {ttt:>10} "
              f"{r['final_success']:>14.3f} {r['lag_mean']:>5.2f} {r['slots_busy']:>10.2f}")
    a, s = results["async"], results["sync"]
    print(f"samples/s ratio async/sync: {a['samples_per_s'] / s['samples_per_s']:.2f}x")
    a_ttt, s_ttt = a["time_to_target_s"], s["time_to_target_s"]
    if a_ttt is None or s_ttt is None:
        print("time-to-target ratio: target not reached by both modes")
    elif min(a_ttt, s_ttt) == 0:
        print("time-to-target ratio: none, a mode reached the target in its first window")
    else:
        print(f"time-to-target ratio sync/async: {s_ttt / a_ttt:.2f}x")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
