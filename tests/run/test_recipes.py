"""The recipes in configs/: each loads, and the Qwen2.5 GSM8K recipe runs end to end on CPU,
shrunk, from a tiny random Qwen2 checkpoint written with transformers."""

import json
import re
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jaxrl.commands import job
from jaxrl.config import load_run_config
from jaxrl.models import from_hf, split_params
from jaxrl.telemetry.metrics import read_metrics
from jaxrl.train.checkpoint import Checkpointer
from tests.tiny_hf import tiny_qwen

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
QWEN_RECIPE = ROOT / "configs" / "qwen2_5_0_5b_gsm8k.yaml"
GSM8K = ROOT / "tests" / "data" / "gsm8k_tiny.jsonl"
STEP_KEYS = ("reward", "lag_mean", "ess", "kl_new_old", "entropy", "trained_tokens_per_s",
             "trainer_wait_s", "update_pause_ms", "slots_busy_fraction")


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_config_loads(path):
    load_run_config(path)


def test_qwen_gsm8k_recipe_runs_end_to_end(tmp_path):
    rows = [json.loads(line) for line in GSM8K.read_text().splitlines() if line.strip()]
    eval_path = tmp_path / "test.jsonl"
    eval_path.write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    template = load_run_config(QWEN_RECIPE).task.prompt_template
    hf = tmp_path / "qwen"
    hf.mkdir()
    tiny_qwen(hf, [template.format(question=r["question"]) + r["answer"] for r in rows])

    run_dir = tmp_path / "run"
    cfg = load_run_config(QWEN_RECIPE, [
        f"hf_path={hf}", f"task.train_path={GSM8K}", f"task.eval_path={eval_path}",
        f"run_dir={run_dir}", "log.progress=false",
        # Shrunk to CPU: float32, 8 simulated devices, a few short samples.
        "model.dtype=float32", "train.eval_problems=2",
        "rl.steps=2", "rl.prompts_per_step=2", "rl.engine.max_concurrent_decodes=16",
        "rl.max_prompt_len=128",
        "rl.max_new_tokens=8", "rl.pack_len=272", "rl.microbatch_rows=8",
        # A random model answers nothing right and rarely stops: keep its samples anyway.
        "rl.filter_zero_advantage=false", "rl.filter_overlong=false",
    ])
    assert cfg.task.name == "math" and cfg.rl.loss == "tis" and cfg.rl.mode == "async"
    lines = []
    summary = job.run(cfg, log=lines.append)

    # No warm-up: RL starts from the Hugging Face weights.
    assert summary["warmup"] is None and summary["rl"]["rl_steps"] == 2
    assert f"RL starts from {hf} (no warm-up)" in lines
    ckpt = Checkpointer(run_dir / "checkpoints")
    assert ckpt.all_steps() == [2] and ckpt.saved_data(2) is not None
    ckpt.close()
    # Two AdamW steps at lr <= 1e-6 move no weight by more than ~2e-6 from the HF weights.
    manager = ocp.CheckpointManager(run_dir / "checkpoints")
    trained = manager.restore(2, args=ocp.args.Composite(params=ocp.args.StandardRestore())).params
    manager.close()
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-5),
                 trained, split_params(from_hf(hf))[1])
    assert summary["rl"]["checkpoint"] == str(run_dir.absolute() / "checkpoints" / "2")
    assert summary["rl"]["eval_before"] is not None and "eval_after" in summary["rl"]

    metrics = read_metrics(run_dir)
    assert not [r for r in metrics if "token_accuracy" in r]
    rl_rows = [r for r in metrics if "reward" in r]
    assert [r["step"] for r in rl_rows] == [1, 2]
    for row in rl_rows:
        # Every key on every step; a value may be null only for `reward`, on a step where no
        # sample finished since the one before (async: the actor had run ahead).
        missing = [k for k in STEP_KEYS if k not in row or (row[k] is None and k != "reward")]
        assert not missing, f"step {row['step']} lacks {missing}"
        assert row["trained_tokens"] > 0 and 0 <= row["slots_busy_fraction"] <= 1
    assert rl_rows[0]["reward"] is not None
    assert any(re.match(r"RL \(async, colocated, loss tis\)", line) for line in lines)

    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    for name in ("reward", "lag", "lengths"):
        png = Path(summary["rl"]["plots"][name])
        assert png == run_dir / "plots" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
