"""MetricsLogger's three sinks and the plots, read back from the files they write."""

import importlib
import json
import math
import struct
import sys
import threading
import time
import zlib
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from tensorboardX.proto import event_pb2

from jaxrl.errors import UserError
from jaxrl.telemetry import metrics
from jaxrl.telemetry.metrics import METRICS_FILE, MetricsLogger, read_metrics
from jaxrl.telemetry.plots import (
    figure_lag_histogram,
    figure_lengths,
    figure_reward_curves,
    lag_histogram,
    reward_curves,
    save_run_plots,
)
from jaxrl.telemetry.rl_metrics import length_quantiles

pytestmark = pytest.mark.slow


def _crc32c(data: bytes) -> int:
    """Bitwise CRC-32C (Castagnoli, reflected polynomial 0x82F63B78): slow, but independent of
    the table-driven one tensorboardX writes with."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def _masked_crc(data: bytes) -> int:
    # TFRecord masks its CRCs so that a CRC of data holding CRCs stays well distributed.
    crc = _crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _read_events(run_dir: Path) -> list:
    """Every Event in the run's TensorBoard files, parsed from the TFRecord framing:
    8-byte length, 4-byte masked CRC of it, data, 4-byte masked CRC of the data."""
    files = sorted((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert files, "no TensorBoard event file written"
    events = []
    for path in files:
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            header = data[pos: pos + 8]
            (length,) = struct.unpack("<Q", header)
            (header_crc,) = struct.unpack("<I", data[pos + 8: pos + 12])
            body = data[pos + 12: pos + 12 + length]
            (body_crc,) = struct.unpack("<I", data[pos + 12 + length: pos + 16 + length])
            assert header_crc == _masked_crc(header) and body_crc == _masked_crc(body)
            events.append(event_pb2.Event.FromString(body))
            pos += 16 + length
    return events


def _scalars(events) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for event in events:
        for value in event.summary.value:
            if value.HasField("simple_value"):
                out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG signature"
    assert data[12:16] == b"IHDR", "first PNG chunk is not IHDR"
    return struct.unpack(">II", data[16:24])


def test_jsonl_rows_round_trip_with_nonfinite_as_null(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        logger.log(1, {"loss": 0.5, "reward": np.float32(0.25)})
        logger.log(2, {"loss": float("nan"), "reward/max": float("inf"), "lr": -float("inf")})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == read_metrics(tmp_path)  # strict JSON, no NaN
    assert "NaN" not in lines[1] and "Infinity" not in lines[1]
    assert read_metrics(tmp_path) == [
        {"step": 1, "loss": 0.5, "reward": 0.25},
        {"step": 2, "loss": None, "reward/max": None, "lr": None},
    ]


def test_jsonl_is_flushed_per_call(tmp_path):
    logger = MetricsLogger(tmp_path, tensorboard=False)
    logger.log(7, {"loss": 1.0})
    assert read_metrics(tmp_path) == [{"step": 7, "loss": 1.0}]
    logger.close()


def test_tensorboard_events_hold_the_scalars(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        for step in range(3):
            logger.log(step, {"train/loss": 1.0 / (step + 1), "reward": step * 0.5})
    scalars = _scalars(_read_events(tmp_path))
    assert set(scalars) == {"train/loss", "reward"}
    assert [s for s, _ in scalars["train/loss"]] == [0, 1, 2]
    np.testing.assert_allclose([v for _, v in scalars["train/loss"]], [1.0, 0.5, 1 / 3],
                               rtol=1e-6)  # simple_value is a float32
    assert scalars["reward"] == [(0, 0.0), (1, 0.5), (2, 1.0)]


def test_nan_scalar_reaches_tensorboard_as_nan(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        logger.log(0, {"loss": float("nan")})
    [(step, value)] = _scalars(_read_events(tmp_path))["loss"]
    assert step == 0 and math.isnan(value)


def test_histogram_is_written(tmp_path):
    lags = [0, 1, 1, 2, 2, 2, 5]
    with MetricsLogger(tmp_path) as logger:
        logger.histogram(3, "rollout/lag", lags)
        logger.histogram(4, "rollout/lag", [])  # a step with no samples writes nothing
    histos = [(e.step, v.histo) for e in _read_events(tmp_path) for v in e.summary.value
              if v.tag == "rollout/lag" and v.HasField("histo")]
    assert len(histos) == 1
    step, histo = histos[0]
    assert step == 3
    assert (histo.num, histo.min, histo.max, histo.sum) == (7, 0, 5, sum(lags))
    assert sum(histo.bucket) == 7


def test_tensorboard_is_refused_torch_on_its_own_thread_only(tmp_path, monkeypatch):
    """tensorboardX is imported beside the run's start with torch refused (a second of
    import it does not need): only its thread is refused, never another thread's import."""
    (tmp_path / "refused_mod.py").write_text("VALUE = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "refused_mod", raising=False)
    finder = metrics._Refuse("refused_mod")
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
    with pytest.raises(ImportError, match="refused_mod is not imported on this thread"):
        import refused_mod  # noqa: F401
    other = {}
    thread = threading.Thread(target=lambda: other.update(
        value=importlib.import_module("refused_mod").VALUE))
    thread.start()
    thread.join()
    assert other == {"value": 3}


def test_tensorboard_that_cannot_open_fails_the_first_row(tmp_path):
    (tmp_path / "tensorboard").write_text("a file where the event directory goes")
    logger = MetricsLogger(tmp_path)
    with pytest.raises(OSError):
        logger.log(0, {"loss": 1.0})
    logger.close()


def test_resume_appends_to_the_same_run(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        logger.log(1, {"loss": 1.0})
    with MetricsLogger(tmp_path) as logger:
        logger.log(2, {"loss": 2.0})
    assert read_metrics(tmp_path) == [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 2.0}]
    assert _scalars(_read_events(tmp_path))["loss"] == [(1, 1.0), (2, 2.0)]


def test_resume_drops_a_row_cut_short_by_a_killed_run(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "lo')
    assert read_metrics(tmp_path) == [{"step": 1, "loss": 1.0}]
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        logger.log(2, {"loss": 2.0})
    assert read_metrics(tmp_path) == [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 2.0}]


def test_a_phase_that_restarts_logs_its_rows_once(tmp_path):
    """RL killed before its first checkpoint: the restart evaluates again at the warm-up's last
    step, and the row of the first attempt (and its later steps) must not stay beside it."""
    with MetricsLogger(tmp_path, tensorboard=False, phase="warm-up") as logger:
        logger.log(10, {"loss": 0.5})
    for _ in range(3):   # three restarts, none reached an RL checkpoint
        with MetricsLogger(tmp_path, tensorboard=False, resume_step=10, phase="rl",
                           phase_restarts=True) as logger:
            logger.log(10, {"eval_accuracy": 0.25})
            logger.log(11, {"reward": 0.5})
    with MetricsLogger(tmp_path, tensorboard=False, resume_step=11, phase="rl") as logger:
        logger.log(12, {"reward": 0.75})   # resumed from an RL checkpoint at 11: rows kept
    assert read_metrics(tmp_path) == [
        {"step": 10, "loss": 0.5, "phase": "warm-up"},
        {"step": 10, "eval_accuracy": 0.25, "phase": "rl"},
        {"step": 11, "reward": 0.5, "phase": "rl"},
        {"step": 12, "reward": 0.75, "phase": "rl"}]


def test_read_metrics_of_a_directory_without_metrics_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="metrics.jsonl"):
        read_metrics(tmp_path)


def test_wandb_missing_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    with pytest.raises(UserError, match=r"pip install wandb.*log\.wandb=false"):
        MetricsLogger(tmp_path / "run", wandb="jaxrl")


def _wandb_records(path: Path) -> list:
    """The Records of a `.wandb` file, parsed from its LevelDB-log framing: a 7-byte header
    (":W&B", magic 0xBEE1, version 0), then 32 KiB blocks of chunks, each a 7-byte header
    (CRC-32 seeded with the chunk type, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    block, head = 32768, 7
    data = path.read_bytes()
    assert data[:head] == b":W&B" + struct.pack("<HB", 0xBEE1, 0), "not a .wandb file"
    records, pos, pending = [], head, b""
    while pos < len(data):
        if block - pos % block < head:  # too little room for a chunk header: zero padding
            pos += block - pos % block
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos: pos + head])
        body = data[pos + head: pos + head + length]
        assert len(body) == length and crc == zlib.crc32(body, zlib.crc32(bytes([kind])))
        pending, pos = pending + body, pos + head + length
        if kind in (1, 4):
            records.append(wandb_internal_pb2.Record.FromString(pending))
            pending = b""
    assert not pending, "the file ends inside a record"
    return records


def _finished_wandb_records(path: Path, timeout_s: float = 20.0) -> list:
    """The Records once the exit record is on disk. run.finish() returns when wandb-core has
    handled the exit; the core closes (flushes) the file just after, in its own time, since its
    finish notice is fire-and-forget. Without the exit record, the parse after `timeout_s` fails."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            records = _wandb_records(path)
        except AssertionError:  # read in the middle of a write
            records = []
        if any(r.HasField("exit") for r in records):
            return records
        time.sleep(0.02)
    return _wandb_records(path)


def _item(item) -> tuple[str, object]:
    return item.key or "/".join(item.nested_key), json.loads(item.value_json)


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """W&B in offline mode with every directory it writes in tmp_path: no network, no ~/."""
    import wandb  # noqa: F401  (in the test extra: a missing wandb fails here, never skips)

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR",
                "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))


def test_wandb_offline_run_holds_the_history(tmp_path, wandb_offline):
    run_dir = tmp_path / "run"
    with MetricsLogger(run_dir, wandb="jaxrl-test",
                       config={"train": {"lr": 1e-3}}) as logger:
        logger.log(1, {"loss": 0.5, "kl": float("nan")})
        logger.log(2, {"loss": 0.25})
        logger.histogram(2, "lag", [0, 1, 1])
    [offline] = (run_dir / "wandb").glob("offline-run-*")
    [path] = offline.glob("run-*.wandb")
    records = _finished_wandb_records(path)
    kinds = [r.WhichOneof("record_type") for r in records]

    [run] = [r.run for r in records if r.HasField("run")]
    assert run.project == "jaxrl-test"
    config = dict(_item(u) for u in run.config.update)
    assert config["train"] == {"lr": 1e-3}

    history = {}
    for r in records:
        if r.HasField("history"):
            items = dict(_item(i) for i in r.history.item)
            assert r.history.step.num == items["_step"]
            history[r.history.step.num] = {k: v for k, v in items.items()
                                           if not k.startswith("_")}
    assert sorted(history) == [1, 2]
    assert history[1]["loss"] == 0.5 and math.isnan(history[1]["kl"])
    assert history[2]["loss"] == 0.25
    assert history[2]["lag/_type"] == "histogram" and sum(history[2]["lag/values"]) == 3
    assert (history[2]["lag/bins"][0], history[2]["lag/bins"][-1]) == (0, 1)
    assert kinds.count("exit") == 1 and kinds.index("exit") > max(
        k for k, kind in enumerate(kinds) if kind == "history")  # close() finished the run
    assert read_metrics(run_dir)[-1] == {"step": 2, "loss": 0.25}  # the other sinks still write


def test_wandb_that_cannot_start_is_a_clear_error_and_writes_nothing(tmp_path, wandb_offline,
                                                                      monkeypatch):
    import wandb

    def refuse(**kwargs):
        raise wandb.errors.UsageError("No API key configured.")

    monkeypatch.setattr(wandb, "init", refuse)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / METRICS_FILE).write_text('{"step": 1, "loss": 1.0}\n{"step": 2')
    with pytest.raises(UserError, match=r"No API key configured.*wandb login.*WANDB_MODE"):
        MetricsLogger(tmp_path / "run", wandb="jaxrl", resume_step=0)
    assert (tmp_path / "run" / METRICS_FILE).read_text() == '{"step": 1, "loss": 1.0}\n{"step": 2'
    assert not (tmp_path / "run" / "tensorboard").exists()


def test_reward_curves_png(tmp_path):
    curves = {"async": ([0, 1, 2], [0.1, 0.4, 0.8]), "sync": ([0, 2, 4], [0.1, 0.3, 0.6])}
    path = reward_curves(curves, tmp_path / "out" / "reward.png", title="arithmetic")
    assert path == tmp_path / "out" / "reward.png"
    assert path.stat().st_size > 0
    assert _png_size(path) == (640, 400)


def test_figure_reward_curves_draws_one_line_per_label():
    curves = {"async": ([0, 1, 2], [0.1, 0.4, 0.8]), "sync": ([0, 2], [0.2, 0.3])}
    ax = figure_reward_curves(curves, xlabel="step").axes[0]
    lines = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
             for line in ax.get_lines()}
    assert lines == {k: (list(x), list(y)) for k, (x, y) in curves.items()}
    assert ax.get_xlabel() == "step" and ax.get_ylabel() == "reward"


def test_lag_histogram_has_one_bar_per_integer_lag(tmp_path):
    lags = [0, 1, 1, 3, 3, 3]
    bars = figure_lag_histogram(lags).axes[0].patches
    counts = Counter(lags)
    assert [round(b.get_x() + b.get_width() / 2) for b in bars] == [0, 1, 2, 3]
    assert [b.get_height() for b in bars] == [counts[lag] for lag in range(4)]
    path = lag_histogram(lags, tmp_path / "lag.png", title="lag")
    assert _png_size(path) == (640, 400)


def test_lag_histogram_with_no_samples(tmp_path):
    assert _png_size(lag_histogram([], tmp_path / "lag.png")) == (640, 400)


def test_save_run_plots_from_logged_rows(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        logger.log(0, {"loss": 1.0})  # no reward: skipped
        for step in range(1, 4):
            logger.log(step, {"time_s": step * 2.0, "reward": step / 4})
    paths = save_run_plots(tmp_path, read_metrics(tmp_path), lags=[0, 1, 1, 2])
    assert paths == {"reward": tmp_path / "plots" / "reward.png",
                     "lag": tmp_path / "plots" / "lag.png",
                     "lengths": tmp_path / "plots" / "lengths.png"}
    for path in paths.values():
        assert path.stat().st_size > 0 and _png_size(path) == (640, 400)


def test_length_figure_draws_each_steps_quantiles_of_the_samples():
    lengths = {1: [8, 9, 10, 40, 1600], 3: [8, 8, 12, 30]}   # step 2: no group finished
    rows = [{"step": 1, **length_quantiles(lengths[1])}, {"step": 2},
            {"step": 3, **length_quantiles(lengths[3])}]
    ax = figure_lengths(rows).axes[0]
    median, longest = ax.lines
    assert list(median.get_xdata()) == [1, 3]
    assert list(median.get_ydata()) == [np.median(lengths[1]), np.median(lengths[3])]
    assert list(longest.get_ydata()) == [1600, 30]
    band = ax.collections[0].get_paths()[0].vertices
    assert band[:, 1].min() == pytest.approx(np.percentile(lengths[3], 10))
    assert band[:, 1].max() == pytest.approx(np.percentile(lengths[1], 90))
    assert ax.get_yscale() == "log"
    assert length_quantiles([]) == {}
