"""The GPU campaign's long-tail section (bench/gpu.py --sections long_tail): the long-tail task
(configs/long_tail_cpu.yaml: countdown answers of 8 to 1,619 tokens, log-normal, every sample as
long as its answer) at a campaign model shape, RL in sync, partial and async mode with the
trainer and the engine on this one device (colocated, in this process), from one short warm-up,
one run after the other; and beside each measurement, bench/simulate.py's prediction for the
same job from costs measured here (bench/calibrate.py's: the engine's decode and prefill on this
device, the train step fitted from the sync run's steps, the task's own length distribution).

Sync and partial are simulated on one accelerator, as they run. The simulator has no colocated
async mode, so async gets a range: two accelerators, one generating and one training, at half
speed throughout (`contention` 2: the device shared at every step, the low end) and at full
speed (two devices: the high end, also the prediction for the split placement). A colocated
run's trainer idles while it waits for samples, so the measurement should land in between."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shutil
import tempfile
import time
from pathlib import Path

LONG_TAIL_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "long_tail_cpu.yaml"
MODES = ("sync", "partial", "async")
# --smoke: answers cut at 48 tokens, 4 prompts a step (the script itself, on CPU).
SMOKE = ["rl.max_new_tokens=48", "rl.pack_len=80", "rl.prompts_per_step=4",
         "rl.engine.max_concurrent_decodes=16"]


def shape_overrides(cfg) -> list[str]:
    """Config overrides that give the run's model a campaign shape (the task's vocabulary)."""
    return [f"model.embed_dim={cfg.embed_dim}", f"model.num_layers={cfg.num_layers}",
            f"model.num_heads={cfg.num_heads}", f"model.num_kv_heads={cfg.num_kv_heads}",
            f"model.head_dim={cfg.head_dim}", f"model.mlp_dim={cfg.mlp_dim}",
            "model.dtype=bfloat16"]


def long_tail(model_cfg, steps: int, extra: list[str] = ()) -> dict:
    """Measured samples/s of each mode and the simulator's prediction; `extra`: overrides."""
    import _rl_compare as compare  # the RL stack (gRPC, Grain): only for this section

    args = argparse.Namespace(config=str(LONG_TAIL_CONFIG), rl_steps=steps, target=1.0,
                              window=2, warmup_dir=None,
                              overrides=[*shape_overrides(model_cfg), "train.steps=2",
                                         # an untrained model earns one reward across a group:
                                         # this measures the system, not learning
                                         "rl.filter_zero_advantage=false", *extra])
    work = Path(tempfile.mkdtemp(prefix="jaxrl-gpu-long-tail-"))
    t0, runs = time.perf_counter(), {}
    try:
        base = compare.warm_checkpoint(args, work)
        for mode in MODES:
            runs[mode] = compare.run_variant(base, work, mode, args,
                                             log=lambda m: print(f"long_tail {mode}: {m}",
                                                                 flush=True))
            print(f"long_tail: {mode} {runs[mode]['samples_per_s']:.1f} samples/s "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
        predicted = predict(args, [work / "sync_seed0"], steps)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    sync = runs["sync"]["samples_per_s"]
    ranges = {"sync": ("sync", "sync"), "partial": ("partial", "partial"),
              "async": ("async_shared", "async_two_devices")}
    return {mode: {"samples_per_s": r["samples_per_s"], "vs_sync": r["samples_per_s"] / sync,
                   "predicted_vs_sync": [predicted[k] / predicted["sync"] for k in ranges[mode]],
                   "predicted_samples_per_s": [predicted[k] for k in ranges[mode]],
                   "held_tokens_mean": r.get("held_tokens_mean"), "seconds": r["seconds"]}
            for mode, r in runs.items()}


def predict(args, sync_runs: list[Path], steps: int) -> dict:
    """bench/simulate.py's samples/s for sync, partial and async's two ends, from costs
    measured on this device."""
    import calibrate
    import simulate
    from flax import nnx

    from jaxrl.config import load_run_config
    from jaxrl.models import Transformer, split_params
    from jaxrl.recipe import model_config
    from jaxrl.rollout.actor import ahead_bound
    from jaxrl.rollout.generation import engine_config
    from serving.runner.engine import Engine

    cfg = load_run_config(args.config, args.overrides)
    model_cfg = model_config(cfg)
    engine = Engine(model_cfg, engine_config(cfg, model_cfg))
    params = engine.prepare_params(split_params(Transformer(model_cfg, rngs=nnx.Rngs(0)))[1])
    work = calibrate.workload(cfg, model_cfg, 4000)
    decode = calibrate.decode_costs(engine, params, [64, 256, 1024])
    costs = {**{k: v for k, v in decode.items() if k != "points"},
             "prefill_us_per_token": calibrate.prefill_us_per_token(engine, params),
             **calibrate.run_costs(sync_runs, work["prompt_len"], cfg.rl.batch_size), **work,
             "slots": cfg.rl.engine.max_concurrent_decodes, "batch": cfg.rl.batch_size,
             "group_size": cfg.rl.group_size,
             "pack_len": cfg.rl.pack_len, "microbatch_rows": cfg.rl.microbatch_rows,
             "max_segments": cfg.rl.max_segments, "max_lag": cfg.rl.max_lag,
             "max_ahead": ahead_bound(cfg.rl.batch_size, cfg.rl.engine.max_concurrent_decodes)}
    costs.pop("train_steps", None)
    path = Path(tempfile.mkdtemp(prefix="jaxrl-calibration-")) / "costs.json"
    path.write_text(json.dumps(costs))
    two = ["--accelerators", "2", "--gen-fraction", "0.5", "--modes", "async"]
    runs = {"sync": ["--accelerators", "1", "--modes", "sync"],
            "partial": ["--accelerators", "1", "--modes", "partial"],
            "async_shared": [*two, "--contention", "2"], "async_two_devices": two}
    out = {}
    for mode, flags in runs.items():
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            simulate.main(["--calibration", str(path), "--steps", str(steps), *flags])
        out[mode] = json.loads(printed.getvalue().strip().splitlines()[-1])[0]["samples_per_s"]
    shutil.rmtree(path.parent, ignore_errors=True)
    return out
