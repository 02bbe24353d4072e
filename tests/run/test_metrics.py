"""MetricsLogger's three sinks and the plots, read back from the files they write."""

import json
import math
import struct
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from tensorboardX.proto import event_pb2

from jaxrl.errors import UserError
from jaxrl.run.metrics import MetricsLogger, read_metrics
from jaxrl.run.plots import (figure_lag_histogram, figure_reward_curves, lag_histogram,
                             reward_curves, save_run_plots)


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


def test_read_metrics_of_a_directory_without_metrics_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="metrics.jsonl"):
        read_metrics(tmp_path)


def test_wandb_missing_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    with pytest.raises(UserError, match=r"pip install wandb.*log\.wandb=false"):
        MetricsLogger(tmp_path / "run", wandb=True)


def test_wandb_offline_run(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb", reason="wandb is not installed; the offline run needs it")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    with MetricsLogger(tmp_path, wandb=True, config={"lr": 1e-3}) as logger:
        logger.log(1, {"loss": 0.5})
        logger.histogram(1, "lag", [0, 1, 1])
        assert wandb.run.config["lr"] == 1e-3
    assert list((tmp_path / "wandb").glob("offline-run-*"))


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
                     "lag": tmp_path / "plots" / "lag.png"}
    for path in paths.values():
        assert path.stat().st_size > 0 and _png_size(path) == (640, 400)
