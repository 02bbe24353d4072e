"""configs/long_tail_cpu.yaml trains: `jaxrl train` on the countdown task, scaled down (a 0.1M
model, answers of 8 to 53 tokens instead of 1,619), run as a user runs it: one command, a
supervised warm-up, then async RL, in a process on one CPU device (a tiny model on eight forced
devices spends most of its time in per-device overhead).

The warm-up is cut short on purpose (200 steps: the rule is learnt, not yet reliably), so the
model samples the exact countdown about one time in ten and RL has room to climb."""

import json
import os
from pathlib import Path

import numpy as np
import pytest

from tests.run import one_device

pytestmark = pytest.mark.slow

WARMUP, RL = 200, 12
SCALED_DOWN = [
    "model.num_layers=2", "model.embed_dim=64", "model.mlp_dim=192", "model.num_heads=4",
    "model.num_kv_heads=2", "model.head_dim=16", "model.max_seq_len=80",
    # n in 1..6 countdown steps (answers of 8 to 53 tokens), median 2: the tail is 6x the median.
    "task.max_steps=6", "task.median_steps=2", "task.warmup_max_steps=6",
    f"train.steps={WARMUP}", "train.batch_size=32", "train.seq_len=72", "train.log_every=50",
    "train.eval_problems=64", "optim.lr=3e-3", "optim.warmup_steps=20",
    "checkpoint.every=1000", "log.progress=false",
    f"rl.steps={RL}", "rl.prompts_per_step=16", "rl.group_size=4", "rl.max_prompt_len=20",
    "rl.max_new_tokens=56", "rl.engine.max_concurrent_decodes=64", "rl.pack_len=128",
    "rl.microbatch_rows=8",
    "rl.max_segments=16", "rl.eval_every=12", "rl.filter_overlong=false",
    "rl.optim.lr=1e-3", "rl.optim.warmup_steps=0", "rl.optim.min_lr_ratio=1.0",
]
SEED = int(os.environ.get("JAXRL_LONG_TAIL_SEED", "0"))
K = 4   # steps averaged at each end


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, list[dict]]:
    run_dir = tmp_path_factory.mktemp("long_tail") / "run"
    one_device.train("configs/long_tail_cpu.yaml", [*SCALED_DOWN, f"train.seed={SEED}"],
                     run_dir, running=True)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return run_dir, rows


def success_over(rows: list[dict]) -> float:
    """Success rate of all samples scored over these steps. A step's own rate covers the samples
    that finished since the step before, a handful or thousands (async; zero-advantage groups
    are regenerated), so rates are weighted by those counts."""
    scored = np.asarray([r["scored"] for r in rows])
    solved = np.asarray([r["scored"] * (r["success_rate"] or 0.0) for r in rows])
    return solved.sum() / scored.sum()


def test_success_rate_rises_over_the_long_tail(run, report_table):
    """Success of the samples over the last 4 RL steps against the first 4, and greedy held-out
    accuracy before and after. Measured on this 2-core machine (seeds 0-3, JAXRL_LONG_TAIL_SEED):
    +0.11 to +0.24 (0.00-0.15 -> 0.11-0.35), held-out up in all four. With rl.optim.lr=1e-9 (no
    learning, seed 0): +0.02 and held-out unchanged, so the margin asked, +0.08, separates the
    two."""
    run_dir, rows = run
    rl = [r for r in rows if r.get("phase") == "rl" and "success_rate" in r]
    assert [r["step"] for r in rl] == list(range(WARMUP + 1, WARMUP + RL + 1))
    counts = np.diff([0] + [r["samples_generated"] for r in rl])
    rl = [{**r, "scored": n} for r, n in zip(rl, counts)]
    first, last = success_over(rl[:K]), success_over(rl[-K:])
    evals = [r["eval_accuracy"] for r in rows if "eval_accuracy" in r]
    before, after = evals[0], evals[-1]
    report_table("RL on the long tail (countdown, tiny model): success of the samples, and "
                 "greedy held-out accuracy",
                 ("seed", f"first {K} steps", f"last {K} steps", "held-out before", "after"),
                 (SEED, f"{first:.3f}", f"{last:.3f}", f"{before:.3f}", f"{after:.3f}"))
    assert last > first + 0.08 and last > 1.5 * first, (first, last)
    assert after >= before
    lengths = [r.get("completion_len_max", 0) for r in rl]   # absent: none finished
    assert max(lengths) >= 45, lengths     # the tail was sampled (and trained: no lag filter)
    assert (run_dir / "plots" / "lengths.png").read_bytes()[:4] == b"\x89PNG"
