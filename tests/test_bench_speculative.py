"""`jaxrl bench speculative` runs its own code path to its JSON line at the smallest size: a
tiny countdown model, one row, a few tokens, speculation off against the suffix drafter."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_bench_long_tail import TINY

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_engine_section_runs_to_its_json_line():
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "speculative.py"), "--drafters", "suffix",
         "--rows", "1", "--tokens", "16", "--rounds", "1", *TINY],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    final = json.loads(done.stdout.splitlines()[-1])
    row = final["engine"]["1"]
    assert set(row) == {"off_pass1", "off_pass2", "suffix_pass1", "suffix_pass2"}
    assert all(r["tokens_per_s"] > 0 for r in row.values())
    assert row["off_pass2"]["verify_steps"] == 0
