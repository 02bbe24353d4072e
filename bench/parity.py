"""Sampler/trainer log-prob parity in float32 and bfloat16, and what rl.behaviour_logprobs=trainer
changes: the gap, the importance ratios, the step time.

Sync RL (every token is lag 0, so every token counts in the parity metric) from one warm-up
checkpoint, one variant after the other in one process (bench/_rl_compare.py):
- float32: engine and trainer compute in float32;
- bfloat16: both compute in bfloat16 (`model.dtype=bfloat16`; the trainer's master weights stay
  float32, the engine holds bfloat16 weights and a bfloat16 KV cache);
- bfloat16+trainer_mu: the same, with `rl.behaviour_logprobs=trainer`.

    jaxrl bench parity --rl-steps 40
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np

import _rl_compare as compare

DEMO_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo_cpu.yaml"
VARIANTS = {"float32": ["model.dtype=float32"],
            "bfloat16": ["model.dtype=bfloat16"],
            "bfloat16+trainer_mu": ["model.dtype=bfloat16", "rl.behaviour_logprobs=trainer"]}
METRICS = ("logprob_diff_mean", "logprob_abs_diff_max", "logprob_kl", "ratio_min", "ratio_max",
           "ess", "clip_fraction")


def summarize(result: dict) -> dict:
    """Each metric's mean over the steps (abs_diff_max and ratio_max: the max; ratio_min: the
    min), seconds per step and the final success rate."""
    rows = result["rows"]
    out = {}
    for key in METRICS:
        values = np.asarray([r[key] for r in rows if r.get(key) is not None], np.float64)
        out[key] = (values.max() if key.endswith("max") else values.min()
                    if key.endswith("min") else values.mean())
    out["s_per_step"] = result["seconds"] / max(len(rows) - 1, 1)
    out["final_success"] = result["final_success"]
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    compare.add_arguments(p, config=DEMO_CONFIG, rl_steps=40, target=1.0, window=10,
                          variants=["sync"])
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="jaxrl-bench-"))
    base = compare.warm_checkpoint(args, work)
    results = {}
    for name, overrides in VARIANTS.items():
        results[name] = summarize(compare.run_variant(base, work, name, args,
                                                      extra=("rl.mode=sync", *overrides)))
    shutil.rmtree(work, ignore_errors=True)
    print(f"{'variant':<20}" + "".join(f"{k:>22}" for k in (*METRICS, "s_per_step",
                                                            "final_success")))
    for name, r in results.items():
        print(f"{name:<20}" + "".join(f"{v:>22.3g}" for v in r.values()))
    f32, bf16, trainer = (results[k]["s_per_step"] for k in VARIANTS)
    print(f"step time: bfloat16 {bf16 / f32:.2f}x float32; trainer mu {trainer / bf16:.2f}x "
          f"engine mu (bfloat16)")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
