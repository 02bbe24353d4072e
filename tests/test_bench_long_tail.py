"""`jaxrl bench long_tail --pinned` runs its own code path to its table and JSON line at the
smallest size (a tiny countdown model, three RL steps, one seed), with the variants whose
launched server must hold something other than the trainer's weights (int8 rollouts, an fp8 KV
cache, speculative decoding; LoRA adapters: tests/run/test_local_servers.py). A variant that fails is a row with its
error, and the others are still reported."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# appended, not put first: bench/tinker.py must not hide the installed tinker SDK
sys.path.append(str(ROOT / "bench"))
import _rl_compare as compare  # noqa: E402

TINY = ["model.num_layers=1", "model.embed_dim=32", "model.mlp_dim=64", "model.num_heads=2",
        "model.num_kv_heads=1", "model.head_dim=16", "model.max_seq_len=80",
        "task.max_steps=6", "task.median_steps=2", "task.warmup_max_steps=6",
        "train.steps=2", "train.batch_size=4", "train.seq_len=72", "train.log_every=1",
        "rl.prompts_per_step=2", "rl.group_size=2", "rl.max_prompt_len=20",
        "rl.max_new_tokens=56", "rl.engine.max_concurrent_decodes=4", "rl.pack_len=128",
        "rl.microbatch_rows=4",
        "rl.max_segments=8", "rl.eval_every=100",
        # Two warm-up steps teach nothing: every group would score zero and be drawn again.
        "rl.filter_zero_advantage=false"]


@pytest.mark.slow
def test_every_variant_a_launched_server_must_hold_runs_pinned_to_its_report(tmp_path):
    variants = ["int8-rollouts", "fp8-kv", "sync+speculative"]
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "long_tail.py"), "--pinned", "--seeds", "1",
         "--rl-steps", "3", "--window", "1", "--busy-limit", "1.0", "--save",
         str(tmp_path / "runs.json"), *TINY, "--variants", *variants],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    table = done.stdout.splitlines()
    for name in variants:
        assert any(line.startswith(f"{name} ") for line in table), name
    final = json.loads(table[-1])
    assert set(final) == set(variants)
    assert not any("failed" in v for v in final.values()), final
    assert all(final[v]["samples_per_s"] > 0 for v in variants)
    # the launched server speculated (the RL rows carry its counters), the behaviour
    # log-probs as exact as without
    rows = json.loads((tmp_path / "runs.json").read_text())["sync+speculative"][0]["rows"]
    assert sum(r.get("spec_verify_steps", 0) for r in rows) > 0
    assert final["sync+speculative"]["logprob_gap_max"] < 1e-5


def test_a_failed_variant_is_reported_by_its_error_and_the_others_still_are(capsys):
    rows = [{"time_s": t, "samples_trained": 8 * t, "success_rate": 0.5} for t in range(4)]
    run = compare.summarise("sync", 0, rows, type("Args", (), {"target": 0.9, "window": 1}))
    compare.report({"sync": [run], "int8-rollouts": "VariantFailed: jaxrl train: error: boom"})
    out = capsys.readouterr().out.splitlines()
    assert any(line.startswith("sync ") for line in out)
    assert any(line.startswith("int8-rollouts") and "failed: VariantFailed: jaxrl train: "
               "error: boom" in line for line in out)
    final = json.loads(out[-1])
    assert final["int8-rollouts"] == {"failed": "VariantFailed: jaxrl train: error: boom"}
    assert final["sync"]["samples_per_s"] == pytest.approx(8.0)
