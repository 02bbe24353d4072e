"""What a crash can leave behind, and bad places to run: metrics rows are on disk before the
checkpoint that covers them is written; a checkpoint that cannot be read is set aside and the
one before it used; a run directory with a file in the way is one line."""

import pytest

from jaxrl.commands import job
from jaxrl.config import load_run_config
from jaxrl.errors import UserError
from jaxrl.telemetry.metrics import read_metrics
from jaxrl.trainer import warmup

pytestmark = pytest.mark.slow

TINY = ["model.num_layers=1", "model.embed_dim=32", "model.mlp_dim=64", "model.num_heads=2",
        "model.num_kv_heads=1", "model.head_dim=16", "model.max_seq_len=16",
        "train.batch_size=8", "train.seq_len=12", "train.eval_problems=0", "log.progress=false",
        "rl.steps=0"]


def test_rows_reach_disk_before_the_checkpoint_that_covers_them(tmp_path, monkeypatch):
    """log_every (printing) is longer than checkpoint.every: every save still finds each step up
    to its own on disk."""
    on_disk_at_save = {}
    save = warmup.Checkpointer.save

    def record(self, state, *args, **kwargs):
        on_disk_at_save[int(state["step"])] = [r["step"] for r in read_metrics(tmp_path)]
        return save(self, state, *args, **kwargs)

    monkeypatch.setattr(warmup.Checkpointer, "save", record)
    warmup.train(load_run_config(None, [*TINY, f"run_dir={tmp_path}", "train.steps=7",
                                        "train.log_every=100", "checkpoint.every=3"]),
                 log=lambda _: None)
    assert on_disk_at_save == {3: [1, 2, 3], 6: [1, 2, 3, 4, 5, 6],
                               7: [1, 2, 3, 4, 5, 6, 7]}


def test_a_checkpoint_that_cannot_be_read_is_set_aside_and_the_one_before_used(tmp_path):
    cfg = lambda steps: load_run_config(None, [  # noqa: E731
        *TINY, f"run_dir={tmp_path}", f"train.steps={steps}", "checkpoint.every=3",
        "checkpoint.resume=true"])
    warmup.train(cfg(6), log=lambda _: None)
    step6 = tmp_path / "checkpoints" / "6"
    # Writes cut short by a crash or a full disk: every array data file of the parameters (OCDBT
    # keeps them under d/ folders, per process and merged) loses its second half.
    files = [p for p in (step6 / "params").rglob("*") if p.is_file() and p.parent.name == "d"]
    assert files
    for path in files:
        with path.open("r+b") as f:
            f.truncate(path.stat().st_size // 2)
    lines = []
    summary = warmup.train(cfg(9), log=lines.append)
    bad = tmp_path / "checkpoints.bad" / "6"
    assert any(line.startswith(f"checkpoint step 6 in {tmp_path / 'checkpoints'} cannot be "
                               f"restored") and f"moved to {bad}" in line for line in lines), lines
    assert f"resumed from {tmp_path / 'checkpoints'}/3" in lines
    assert (bad / "params").is_dir()        # set aside, not deleted
    assert summary["steps"] == 9
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 10))   # steps 4-6 logged once, again


@pytest.mark.parametrize("where", ["run_dir", "parent"])
def test_a_run_dir_with_a_file_in_the_way_is_one_line(tmp_path, where):
    blocker = tmp_path / "blocker"
    blocker.write_text("not a directory")
    run_dir = blocker if where == "run_dir" else blocker / "run"
    with pytest.raises(UserError, match=rf"run_dir '{run_dir}' cannot be used: '{blocker}' is a "
                                        r"file, not a directory"):
        job.run(load_run_config(None, [*TINY, f"run_dir={run_dir}", "train.steps=1"]),
                log=lambda _: None)
