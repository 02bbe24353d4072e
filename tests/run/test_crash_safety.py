"""What a crash can leave behind: metrics rows are on disk before the checkpoint that covers
them is written, so a kill after a checkpoint loses no row of it."""

from jaxrl.config import load_run_config
from jaxrl.run import warmup
from jaxrl.run.metrics import read_metrics

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
