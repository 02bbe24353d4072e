"""`jaxrl bench multiplex` runs its own code path to its table and JSON line at the smallest
size (a tiny countdown model, three RL steps, one seed, pinned): partial rollouts with the
trainer's devices generating while it waits."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_bench_long_tail import TINY

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_partial_with_multiplexing_runs_pinned_to_its_report(tmp_path):
    variants = ["partial+multiplex"]
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "multiplex.py"), "--seeds", "1", "--rl-steps",
         "3", "--window", "1", "--busy-limit", "1.0", "--save", str(tmp_path / "runs.json"),
         *TINY, "--variants", *variants],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    final = json.loads(done.stdout.splitlines()[-1])
    assert set(final) == set(variants) and all(final[v]["samples_per_s"] > 0 for v in variants)
    assert "the trainer's devices wrote" in done.stdout
    rows = json.loads((tmp_path / "runs.json").read_text())["partial+multiplex"][0]["rows"]
    # what the trainer's devices took depends on when the trainer waited: said, not fixed
    # (a sync run's share is: tests/run/test_local_servers.py)
    assert all(0 <= r["trainer_generated_share"] <= 1 for r in rows)
    # the sampler/trainer gap where a step had tokens of the trainer's own weights to compare
    # (a three-step partial run may have none: NaN)
    assert not final["partial+multiplex"]["logprob_gap_max"] >= 1e-5
