"""configs/long_tail_cpu.yaml trains: the countdown recipe, scaled down to a shorter tail and a
shorter warm-up, run through `jaxrl.run.job.run` as `jaxrl train` runs it. Within 16 RL steps
the success rate of the generated samples rises, the tail is generated (answers of hundreds of
tokens), and the output-length distribution is logged per step and plotted."""

from pathlib import Path

import numpy as np
import pytest

from jaxrl.config import load_run_config
from jaxrl.run import job
from jaxrl.run.metrics import read_metrics

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "long_tail_cpu.yaml"
WARMUP, RL_STEPS, K = 300, 16, 5
# Answers of 1 to 40 countdown steps (8 to 359 tokens), median 4 steps; the warm-up sees up
# to 12 steps (107 tokens), so RL meets answers up to 3x longer than any it was taught.
SCALED = ["task.max_steps=40", "task.median_steps=4", "task.warmup_max_steps=12",
          f"train.steps={WARMUP}", "train.seq_len=128", "train.eval_problems=0",
          "checkpoint.every=1000", "log.progress=false",
          f"rl.steps={RL_STEPS}", "rl.prompts_per_step=8", "rl.group_size=8",
          "rl.max_new_tokens=368", "rl.pack_len=400", "rl.slots=32", "rl.microbatch_rows=8",
          "rl.eval_every=0"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("long_tail")
    summary = job.run(load_run_config(CONFIG, [*SCALED, f"run_dir={run_dir}"]),
                      log=lambda _: None)
    rows = [r for r in read_metrics(run_dir) if "success_rate" in r]
    return {"run_dir": run_dir, "summary": summary, "rows": rows}


@pytest.mark.slow
def test_long_tail_success_rises(run, report_table):
    rows = run["rows"]
    assert [r["step"] for r in rows] == list(range(WARMUP + 1, WARMUP + RL_STEPS + 1))
    success = np.asarray([r["success_rate"] for r in rows if r["success_rate"] is not None])
    first, last = success[:K].mean(), success[-K:].mean()
    report_table("RL on the long-tailed countdown (scaled down): success rate",
                 ("steps", f"first {K}", f"last {K}"),
                 (len(rows), f"{first:.3f}", f"{last:.3f}"))
    assert last > first + 0.05, success.round(2).tolist()


@pytest.mark.slow
def test_long_tail_lengths_are_logged_and_plotted(run):
    rows = run["rows"]
    longest = max(r["completion_len_max"] for r in rows if "completion_len_max" in r)
    assert longest >= 200            # the tail is generated, not only the warm-up's lengths
    for r in rows:
        if "completion_len_p50" in r:
            assert r["completion_len_p10"] <= r["completion_len_p50"] <= r["completion_len_p90"] \
                <= r["completion_len_max"]
    png = Path(run["summary"]["rl"]["plots"]["lengths"])
    assert png == run["run_dir"] / "plots" / "lengths.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
