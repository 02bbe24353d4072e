"""The real commands, as a user runs them, on a tiny budget."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model.embed_dim=32", "model.num_layers=2", "model.mlp_dim=64", "train.steps=6",
        "train.batch_size=16", "train.log_every=3", "train.eval_problems=16",
        "checkpoint.every=3", "rl.steps=2", "rl.prompts_per_step=2", "rl.group_size=4",
        "rl.slots=8", "rl.microbatch_rows=8", "log.progress=false"]


def _jaxrl(*args, cwd):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    return subprocess.run([sys.executable, "-m", "jaxrl.cli", *args], capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=600)


@pytest.mark.slow
def test_train_then_eval(tmp_path):
    out = _jaxrl("train", "--config", str(ROOT / "configs/demo_cpu.yaml"), *TINY,
                 f"run_dir={tmp_path / 'run'}", "mesh.fsdp=4", "mesh.tensor=2", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "mesh {'data': 1, 'stage': 1, 'fsdp': 4, 'tensor': 2}" in out.stdout
    assert "RL (async, colocated, loss tis): steps 6..8" in out.stdout
    assert "held-out accuracy" in out.stdout and "before RL" in out.stdout
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["3", "6", "8"]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert {"reward", "lag_mean", "ess", "entropy", "update_pause_ms"} <= set(rows[-2])
    assert (tmp_path / "run" / "plots" / "reward.png").stat().st_size > 0

    out = _jaxrl("eval", "--checkpoint", str(tmp_path / "run" / "checkpoints"),
                 "--problems", "8", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("step 8: held-out accuracy")


@pytest.mark.parametrize("args, message", [
    (["train", "train.stepz=1"], "unknown config key 'train.stepz'"),
    (["train", "--config", "nope.yaml"], "config file 'nope.yaml' does not exist"),
    (["eval", "--checkpoint", "nowhere"], "no checkpoint directory at"),
])
def test_errors_are_one_line_and_exit_2(tmp_path, args, message):
    out = _jaxrl(*args, cwd=tmp_path)
    assert out.returncode == 2
    assert message in out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr


def test_bad_checkpoint_dir_overwrites_nothing(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "thesis.tex").write_text("precious")
    out = _jaxrl("train", *TINY, f"checkpoint.dir={tmp_path / 'ckpt'}",
                 f"run_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert out.returncode == 2
    assert "refusing to use" in out.stderr and "thesis.tex" in out.stderr
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["thesis.tex"]
    assert not (tmp_path / "run").exists()


def test_help_lists_options_with_defaults(tmp_path):
    out = _jaxrl("eval", "--help", cwd=tmp_path)
    assert out.returncode == 0
    assert "--problems PROBLEMS" in out.stdout and "(default: 200)" in out.stdout


@pytest.mark.slow
def test_serve_answers_and_stops_on_sigterm(tmp_path):
    import signal

    import grpc

    from serving.proto import jetstream_pb2 as js
    from serving.proto import jetstream_pb2_grpc as js_grpc

    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen([sys.executable, "-m", "jaxrl.cli", "serve", "--port", "0",
                             "--checkpoint", str(tmp_path / "none"), "--slots", "4"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=tmp_path)
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if "ready on" in line:
                break
        assert any("freshly initialised" in s for s in seen), seen
        address = line.split("ready on ")[1].split(": ")[0]
        with grpc.insecure_channel(address) as ch:
            stub = js_grpc.OrchestratorStub(ch)
            assert stub.HealthCheck(js.HealthCheckRequest(), timeout=30).is_live
            out = list(stub.Decode(js.DecodeRequest(
                max_tokens=3, text_content=js.DecodeRequest.TextContent(text="12+34=")),
                timeout=60))
            assert 0 < len(out) <= 3
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr[-2000:]
    assert "jaxrl serve: stopped" in stdout
