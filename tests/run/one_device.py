"""`jaxrl train` as a user runs it, in its own process on one CPU device: a model this small on
the suite's eight forced CPU devices spends most of its time in per-device overhead (3-5x)."""

import os
import subprocess
import sys
from pathlib import Path

from tests.xla import xla_flags

ROOT = Path(__file__).resolve().parents[2]


def train(config: str, overrides: list[str], run_dir: Path, running: bool = False) -> None:
    """Runs `jaxrl train --config ROOT/config *overrides run_dir=run_dir`; fails the test,
    showing the end of its output, unless it exits 0. `running`: with tests/xla.py's RUNNING
    flags, for a run whose time goes to its steps more than to compiling them."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(1, running)}
    done = subprocess.run([sys.executable, "-m", "jaxrl.cli", "train", "--config",
                           str(ROOT / config), *overrides, f"run_dir={run_dir}"],
                          env=env, cwd=run_dir.parent, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
