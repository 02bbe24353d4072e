"""Shared by the RL benchmarks (async_vs_sync, long_tail): runs variants of one RL config from
the same warm-up checkpoint, each with several seeds, one run after the other, and compares
them: mean and spread over the seeds, ratios against the first variant.

A variant is a name and config overrides (e.g. "partial": ["rl.mode=partial"]). Every run gets
the same config, checkpoint, hardware and sample budget (rl.steps x rl.batch_size); seed s sets
train.seed, which draws the problems, so every variant sees the same problems for a seed.

In-process (default), the runs share this process's cores: the engine and the trainer compete
for them. `--pinned` runs each as `jaxrl train` with its generation in a `jaxrl serve` process
of its own (rl.generation.launch=1), the server pinned to `--server-cpus` and the trainer to
the other cores: the two sides on cores of their own, as on two accelerators (partial pauses
the server through its Pause call while the trainer steps).

samples/s: samples trained per second of wall time between the end of the first step (which
includes compilation) and the end of the last. Time to target: wall time over the same span
until the success rate of the generated samples, averaged over a window of steps, first reaches
the target (measured on freshly drawn training problems at the sampling temperature)."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from _machine import wait_until_quiet

from jaxrl.config import load_run_config
from jaxrl.telemetry.metrics import read_metrics

# The demo recipe, found from this file so that the benches run from any directory.
DEMO_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo_cpu.yaml"

VARIANTS = {
    "sync": ["rl.mode=sync"],
    "partial": ["rl.mode=partial"],
    "async": ["rl.mode=async"],
    # StreamRL's length-aware dispatch: predicted-long groups admitted first, by the online
    # predictor or by each problem's reference answer length (the best a predictor could know)
    "async+longest_first": ["rl.mode=async", "rl.admission=longest_first"],
    "async+longest_first_oracle": ["rl.mode=async", "rl.admission=longest_first_oracle"],
    "sync+longest_first": ["rl.mode=sync", "rl.admission=longest_first"],
    "sync+longest_first_oracle": ["rl.mode=sync", "rl.admission=longest_first_oracle"],
    "full": [],                                  # the config as it is: every weight trains
    "lora-r8": ["model.lora.rank=8"],            # rank-8 adapters on every projection
    "int8-rollouts": ["rl.generation.weights=int8"],                 # the engine's weights int8
    "int8-rollouts+icepop": ["rl.generation.weights=int8", "rl.rollout_correction=icepop"],
    "fp8-kv": ["rl.engine.kv_cache_dtype=fp8"],                      # the engine's KV cache fp8
    # speculative decoding of the tail, drafts from each prompt's group and earlier rollouts
    "sync+speculative": ["rl.mode=sync", "rl.engine.speculative=suffix"],
    "async+speculative": ["rl.mode=async", "rl.engine.speculative=suffix"],
    # the trainer's devices generate while it waits for a batch (SeamlessFlow's multiplexing)
    "sync+multiplex": ["rl.mode=sync", "rl.multiplex=true"],
    "partial+multiplex": ["rl.mode=partial", "rl.multiplex=true"],
    "async+multiplex": ["rl.mode=async", "rl.multiplex=true"],
}


def add_arguments(p, *, config: Path, rl_steps: int, target: float, window: int,
                  variants: list[str]) -> None:
    cores = sorted(os.sched_getaffinity(0))
    p.add_argument("--config", default=str(config), help="YAML run config")
    p.add_argument("--rl-steps", type=int, default=rl_steps, help="RL steps per run")
    p.add_argument("--target", type=float, default=target, help="success rate to reach")
    p.add_argument("--window", type=int, default=window, help="steps averaged for the target")
    p.add_argument("--variants", nargs="+", default=variants, choices=list(VARIANTS),
                   help="what to compare; the first is the baseline of the ratios")
    p.add_argument("--seeds", type=int, default=3, help="runs per variant (train.seed 0..N-1)")
    p.add_argument("--pinned", action="store_true",
                   help="trainer and a jaxrl serve process on cores of their own")
    p.add_argument("--server-cpus", default=",".join(map(str, cores[len(cores) // 2:])),
                   help="--pinned: the server's cores (the trainer takes the others)")
    p.add_argument("--busy-limit", type=float, default=0.15,
                   help="refuse to measure while other processes use more of the CPU")
    p.add_argument("--warmup-dir", default=None,
                   help="checkpoint dir holding the warm-up's last step, train.steps "
                        "(None: train the warm-up first)")
    p.add_argument("--save", default=None,
                   help="also write every run's per-step metrics to this JSON file")
    p.add_argument("overrides", nargs="*", default=[], metavar="section.key=value",
                   help="config overrides for every run")


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
        from jaxrl.trainer import warmup

        warmup.train(cfg, log=lambda m: None, evaluate_at_end=False)
        warmup_dir = cfg.checkpoint_dir
    step = cfg.train.steps
    if not (Path(warmup_dir) / str(step)).is_dir():
        raise SystemExit(f"--warmup-dir {warmup_dir} has no checkpoint of step {step} "
                         f"(train.steps), the warm-up's last")
    base = work / "base"
    shutil.copytree(Path(warmup_dir) / str(step), base / str(step))
    return base


def compare_variants(args) -> None:
    """The whole comparison in a scratch directory: the warm-up (or --warmup-dir's), every
    variant with every seed, the report; the directory removed after."""
    work = Path(tempfile.mkdtemp(prefix="jaxrl-bench-"))
    base = warm_checkpoint(args, work)
    report(run_all(base, work, args), args.save)
    shutil.rmtree(work, ignore_errors=True)


def run_variant(base: Path, work: Path, name: str, args, seed: int = 0,
                extra: tuple[str, ...] = (), log=lambda message: None) -> dict:
    """One RL run from the warm-up checkpoint `base` with variant `name`'s overrides (VARIANTS,
    or `extra` for a variant of the caller's own), in this process or (--pinned) as `jaxrl
    train` with a pinned server."""
    run_dir = work / f"{name.replace('+', '_')}_seed{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.copytree(base, run_dir / "checkpoints")
    overrides = [f"run_dir={run_dir}", f"rl.steps={args.rl_steps}", "train.eval_problems=0",
                 "log.progress=false", f"checkpoint.every={10**9}", f"train.seed={seed}",
                 *args.overrides, *VARIANTS.get(name, ()), *extra]
    if getattr(args, "pinned", False):
        overrides += ["rl.generation.launch=1", f"rl.generation.cpus={args.server_cpus}"]
        done = subprocess.run([sys.executable, "-m", "jaxrl.cli", "train", "--config",
                               args.config, *overrides], capture_output=True, text=True,
                              env={**os.environ, "JAX_PLATFORMS": "cpu"})
        if done.returncode:
            print(f"{name} (seed {seed}) failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}",
                  file=sys.stderr)
            last = [line for line in done.stderr.splitlines() if line.strip()]
            raise VariantFailed(last[-1] if last else f"exit status {done.returncode}")
    else:
        from jaxrl.trainer import rl as rl_run

        rl_run.reinforce(load_run_config(args.config, overrides), log=log)
    return summarise(name, seed, [r for r in read_metrics(run_dir) if "reward" in r], args)


def summarise(name: str, seed: int, rows: list[dict], args) -> dict:
    """One run's figures from its RL rows (the first step, which compiles, left out of them;
    kept in `rows`, every step's metrics as the run wrote them)."""
    every, rows = rows, rows[1:]
    seconds = rows[-1]["time_s"] - rows[0]["time_s"]
    get = lambda k: [r[k] for r in rows if r.get(k) is not None]  # noqa: E731
    return {"variant": name, "seed": seed, "seconds": seconds,
            "samples_per_s": (rows[-1]["samples_trained"] - rows[0]["samples_trained"]) / seconds,
            "time_to_target_s": time_to_target(rows, args.target, args.window),
            "first_success": float(np.nanmean(success(rows)[:args.window])),
            "final_success": float(np.nanmean(success(rows)[-args.window:])),
            # the sampler's log-probs against the trainer's, on tokens of the trainer's own
            # weights: the largest gap of each step, averaged, and the mean KL
            "logprob_gap_max": float(np.mean(get("logprob_abs_diff_max") or [np.nan])),
            "logprob_kl": float(np.mean(get("logprob_kl") or [np.nan])),
            "lag_mean": float(np.mean(get("lag_mean") or [np.nan])),
            "slots_busy": float(np.mean(get("slots_busy_fraction") or [np.nan])),
            "held_tokens_mean": float(np.mean(get("held_tokens_mean") or [np.nan])),
            "length_p50": float(np.mean(get("completion_len_p50") or [np.nan])),
            "length_p90": float(np.mean(get("completion_len_p90") or [np.nan])),
            "length_max": float(max(get("completion_len_max") or [np.nan])),
            # the share of the run the trainer computed rather than waited for samples, the
            # mean wait a step (sync: the rollout phase), and speculation's tokens per verify
            "trainer_busy": 1 - sum(get("trainer_wait_s")) / seconds,
            "trainer_wait_s": float(np.mean(get("trainer_wait_s") or [np.nan])),
            "acceptance_length": _acceptance(rows),
            # rl.multiplex: the share of the tokens the trainer's devices generated
            "trainer_generated_share": float(np.mean(get("trainer_generated_share")
                                                     or [np.nan])),
            "rows": every}


def _acceptance(rows: list[dict]) -> float:
    """Tokens a speculating row kept per verify step over the run (NaN: no speculation)."""
    steps = sum(r.get("spec_verify_steps", 0) for r in rows)
    if not steps:
        return float("nan")
    drafted = [r for r in rows if r.get("spec_acceptance_length") is not None]
    return float(np.mean([r["spec_acceptance_length"] for r in drafted]))


class VariantFailed(RuntimeError):
    """A pinned run's `jaxrl train` exited with an error (its last line)."""


def run_all(base: Path, work: Path, args) -> dict[str, list[dict] | str]:
    """Every variant with every seed, seed-major (so the machine's drift touches every variant
    alike), each run after a check that the machine is quiet. A variant whose run fails is
    reported by its error (a string in place of its runs) and not run again; the others go on."""
    names = list(args.variants)
    results: dict[str, list[dict] | str] = {n: [] for n in names}
    for seed in range(args.seeds):
        for name in (n for n in names if not isinstance(results[n], str)):
            wait_until_quiet(args.busy_limit, "bench")
            try:
                r = run_variant(base, work, name, args, seed)
            except Exception as e:       # noqa: BLE001 (reported, and the others still run)
                results[name] = f"{type(e).__name__}: {e}"
                print(f"  {name} seed {seed}: failed ({results[name]})", flush=True)
                continue
            results[name].append(r)
            print(f"  {name} seed {seed}: {r['samples_per_s']:.1f} samples/s, success "
                  f"{r['final_success']:.3f}", flush=True)
    return results


def _mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def aggregate(runs: list[dict]) -> dict:
    """Mean and standard deviation over a variant's seeds; time to target over the seeds that
    reached it (`reached` says how many)."""
    sps = _mean_sd([r["samples_per_s"] for r in runs])
    hit = [r["time_to_target_s"] for r in runs if r["time_to_target_s"] is not None]
    ttt = _mean_sd(hit) if hit else (None, None)
    out = {"samples_per_s": sps[0], "samples_per_s_sd": sps[1], "time_to_target_s": ttt[0],
           "time_to_target_s_sd": ttt[1], "reached": f"{len(hit)}/{len(runs)}",
           "seeds": len(runs)}
    for k in ("first_success", "final_success", "lag_mean", "slots_busy", "held_tokens_mean",
              "length_p50", "length_p90", "logprob_gap_max", "logprob_kl", "trainer_busy",
              "trainer_wait_s", "acceptance_length", "trainer_generated_share"):
        out[k] = statistics.fmean(r[k] for r in runs)
    out["length_max"] = max(r["length_max"] for r in runs)
    return out


def report(results: dict[str, list[dict] | str], save: str | None = None) -> None:
    """The table (means ± standard deviations over the seeds), the realised lengths, then every
    variant's ratios against the first; the last line is one JSON object keyed by variant. A
    failed variant (its error in place of its runs) is a row saying so and `{"failed": error}`
    in the JSON; the ratios are against the first variant that ran."""
    if save:
        Path(save).write_text(json.dumps(results))
    failed = {name: why for name, why in results.items() if isinstance(why, str)}
    agg = {name: aggregate(runs) for name, runs in results.items()
           if name not in failed and runs}
    print(f"{'variant':<20} {'samples/s':>14} {'to target (s)':>16} {'reached':>8} "
          f"{'final success':>14} {'lag':>5} {'slots busy':>10} {'held tokens':>11}")
    for name, a in agg.items():
        ttt = (f"{a['time_to_target_s']:.1f} ± {a['time_to_target_s_sd']:.1f}"
               if a["time_to_target_s"] is not None else "never")
        print(f"{name:<20} {a['samples_per_s']:>7.1f} ± {a['samples_per_s_sd']:<4.1f} "
              f"{ttt:>16} {a['reached']:>8} {a['final_success']:>14.3f} {a['lag_mean']:>5.2f} "
              f"{a['slots_busy']:>10.2f} {a['held_tokens_mean']:>11.0f}")
    for name, why in failed.items():
        print(f"{name:<20} failed: {why}")
    if not agg:
        print(json.dumps({name: {"failed": why} for name, why in failed.items()}))
        return
    print("success over the first and last windows, the sampler/trainer log-prob gap (largest "
          "per step, mean; KL): " + "; ".join(
              f"{n} {a['first_success']:.3f} -> {a['final_success']:.3f}, gap "
              f"{a['logprob_gap_max']:.2e}, KL {a['logprob_kl']:.2e}" for n, a in agg.items()))
    print("the trainer's busy share, its mean wait a step (sync: the rollout phase), and tokens "
          "a speculating row kept per verify step: " + "; ".join(
              f"{n} {a['trainer_busy']:.0%}, {a['trainer_wait_s']:.2f} s"
              + (f", {a['acceptance_length']:.2f}" if a["acceptance_length"] ==
                 a["acceptance_length"] else "")
              + (f", the trainer's devices wrote {a['trainer_generated_share']:.0%} of the "
                 f"tokens" if a["trainer_generated_share"] == a["trainer_generated_share"]
                 else "") for n, a in agg.items()))
    print("realised completion lengths (tokens; per-step percentiles averaged over the run): "
          + "; ".join(f"{n} p50 {a['length_p50']:.0f}, p90 {a['length_p90']:.0f}, max "
                      f"{a['length_max']:.0f}" for n, a in agg.items()))
    base_name, *others = agg
    base = agg[base_name]
    for name in others:
        a = agg[name]
        line = f"{name} vs {base_name}: samples/s {a['samples_per_s'] / base['samples_per_s']:.2f}x"
        mine, theirs = a["time_to_target_s"], base["time_to_target_s"]
        if mine is None or theirs is None:
            line += "; time to target: not reached by both"
        elif min(mine, theirs) == 0:
            line += "; time to target: reached within the first window"
        else:
            line += f"; time to target {theirs / mine:.2f}x as fast ({mine:.1f} s against " \
                    f"{theirs:.1f} s)"
        print(line)
    print(json.dumps({**agg, **{name: {"failed": why} for name, why in failed.items()}}))
