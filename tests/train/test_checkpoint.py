"""Checkpoints: bit-identical resume, restore with plain Orbax, and paths that must be refused."""

import json
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from jaxrl.config import load_run_config
from jaxrl.train.checkpoint import CheckpointError
from jaxrl.trainer.warmup import restore_for_eval, train

pytestmark = pytest.mark.slow

TINY = ["model.embed_dim=32", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
        "model.head_dim=8", "model.mlp_dim=64", "model.max_seq_len=32", "train.batch_size=8",
        "train.seq_len=12", "train.eval_problems=0", "train.log_every=1", "checkpoint.every=2"]


def _train(tmp_path, name, *extra):
    keys = {e.split("=")[0] for e in extra}
    base = [o for o in TINY if o.split("=")[0] not in keys]
    cfg = load_run_config(None, base + [f"run_dir={tmp_path / name}", *extra])
    return train(cfg, log=lambda _: None)


def _metrics(tmp_path, name):
    lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    return {row["step"]: row for row in map(json.loads, lines)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """'straight': 4 steps in one go. 'resumed': 2 steps, stopped, then resumed to 4."""
    tmp = tmp_path_factory.mktemp("runs")
    _train(tmp, "straight", "train.steps=4")
    _train(tmp, "resumed", "train.steps=2")
    _train(tmp, "resumed", "train.steps=4")
    return tmp


def test_resumed_run_is_bit_identical(runs):
    straight, resumed = _metrics(runs, "straight"), _metrics(runs, "resumed")
    assert sorted(resumed) == [1, 2, 3, 4]
    for step in (3, 4):
        assert resumed[step]["loss"] == straight[step]["loss"]
        assert resumed[step]["grad_norm"] == straight[step]["grad_norm"]
    a, _, _, _ = restore_for_eval(runs / "straight" / "checkpoints")
    b, _, _, _ = restore_for_eval(runs / "resumed" / "checkpoints")
    for x, y in zip(jax.tree.leaves(jax.device_get(a.embed[...])),
                    jax.tree.leaves(jax.device_get(b.embed[...]))):
        np.testing.assert_array_equal(x, y)


def test_plain_orbax_restores_params(runs, tmp_path):
    """A user with orbax alone (no jaxrl import) gets the parameters back."""
    directory = runs / "straight" / "checkpoints"
    model, _, _, step = restore_for_eval(directory)
    np.save(tmp_path / "expected.npy", np.asarray(model.layers.q_proj[...]))
    script = textwrap.dedent(f"""
        import sys
        import numpy as np
        import orbax.checkpoint as ocp
        manager = ocp.CheckpointManager({str(directory)!r})
        step = manager.latest_step()
        restored = manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(), config=ocp.args.JsonRestore()))
        q = np.asarray(restored.params["layers"]["q_proj"])
        assert step == {step}, step
        assert restored.config["train"]["steps"] == 4
        assert not any(m.startswith(("jaxrl", "sharding", "serving")) for m in sys.modules)
        np.testing.assert_array_equal(q, np.load({str(tmp_path / "expected.npy")!r}))
        print("ok", sorted(restored.params))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ok ['embed', 'final_norm', 'layers', 'lm_head']" in out.stdout


def test_keeps_last_n(tmp_path):
    _train(tmp_path, "keep", "train.steps=8", "checkpoint.keep=2", "checkpoint.async_save=false")
    steps = sorted(int(p.name) for p in (tmp_path / "keep" / "checkpoints").iterdir())
    assert steps == [6, 8]


def test_refuses_directory_with_other_files(tmp_path):
    ckpt = tmp_path / "mine"
    ckpt.mkdir()
    (ckpt / "notes.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="refusing to use .* holds other files .*notes.txt"):
        _train(tmp_path, "x", "train.steps=2", f"checkpoint.dir={ckpt}")
    assert [p.name for p in ckpt.iterdir()] == ["notes.txt"]
    assert (ckpt / "notes.txt").read_text() == "keep me"


def test_refuses_file_as_directory(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="is a file"):
        _train(tmp_path, "x", "train.steps=2", f"checkpoint.dir={tmp_path / 'file'}")


def test_does_not_overwrite_without_resume(runs):
    before = sorted(p.name for p in (runs / "straight" / "checkpoints").iterdir())
    with pytest.raises(CheckpointError, match="already holds checkpoints up to step 4"):
        _train(runs, "straight", "train.steps=6", "checkpoint.resume=false")
    assert sorted(p.name for p in (runs / "straight" / "checkpoints").iterdir()) == before


def test_refuses_checkpoint_of_another_model(runs):
    before = (runs / "straight" / "metrics.jsonl").read_text()
    with pytest.raises(CheckpointError, match=r"another model: model.mlp_dim=64 there, 96"):
        _train(runs, "straight", "train.steps=6", "model.mlp_dim=96")
    assert (runs / "straight" / "metrics.jsonl").read_text() == before


def test_missing_checkpoint_for_eval(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint directory at"):
        restore_for_eval(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        restore_for_eval(tmp_path / "empty")


@pytest.mark.multi_device
def test_pipelined_run_with_host_optimizer_state_resumes_and_matches_the_plain_run(tmp_path):
    """The trainer picks the pipeline and optimizer offload from the config: a 1f1b run over
    (stage 2 x fsdp 4) with the optimizer state in host memory, stopped, resumed with
    V-Half (whose state keeps the layer stack in pipeline order, sharding/layer_order.py),
    stopped again, and resumed with zero-bubble's split backward, logs the losses of a plain
    run on the same data: each checkpoint holds the canonical order, whatever the schedule."""
    four = "model.num_layers=4"        # V-Half on 2 stages: 4 chunks
    _train(tmp_path, "plain", "train.steps=4", "train.batch_size=16", four)
    # The stages keep layer inputs (remat=full): the RL runs through pipelines keep residuals.
    layout = ["train.batch_size=16", "sharding.pipeline.stages=2", four,
              "sharding.pipeline.microbatches=4", "train.offload_optimizer=true",
              "train.remat=full"]
    _train(tmp_path, "piped", "train.steps=2", *layout, "sharding.pipeline.schedule=1f1b")
    _train(tmp_path, "piped", "train.steps=3", *layout, "sharding.pipeline.schedule=v-half")
    _train(tmp_path, "piped", "train.steps=4", *layout, "sharding.pipeline.schedule=zb-h1")
    plain, piped = _metrics(tmp_path, "plain"), _metrics(tmp_path, "piped")
    assert sorted(piped) == [1, 2, 3, 4]
    for step in plain:
        assert piped[step]["loss"] == pytest.approx(plain[step]["loss"], rel=1e-5)
        assert piped[step]["grad_norm"] == pytest.approx(plain[step]["grad_norm"], rel=1e-4)


def test_warmup_logs_to_tensorboard_once_per_step_across_a_resume(runs):
    from tests.run.test_metrics import _read_events, _scalars

    for name in ("straight", "resumed"):
        loss = _scalars(_read_events(runs / name))["loss"]
        # Every step once, resumed run included, with the loss metrics.jsonl holds.
        by_step = dict(loss)
        assert sorted(by_step) == [1, 2, 3, 4]
        jsonl = _metrics(runs, name)
        for step, value in by_step.items():
            assert value == pytest.approx(jsonl[step]["loss"], rel=1e-6)
