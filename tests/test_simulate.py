"""bench/simulate.py with measured op costs (bench/calibrate.py's) on a split of two
accelerators, against closed forms: every sample the same length, no cost per held token."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import simulate  # noqa: E402

# One generator and one trainer; a step's batch fits the generator's slots.
B, L, P, STEPS = 16, 40, 10, 30
DECODE_MS, PREFILL_US, RELOAD_S = 2.0, 50.0, 0.3
FLAGS = ["--accelerators", "2", "--gen-fraction", "0.5", "--split", "--slots", str(B),
         "--batch", str(B), "--prompt-len", str(P), "--lengths", str(L), "--steps", str(STEPS),
         "--decode-ms", str(DECODE_MS), "--decode-us-per-held", "0",
         "--prefill-us-per-token", str(PREFILL_US), "--reload-s", str(RELOAD_S),
         "--swap-ms", "0"]


def _run(capsys, *extra: str) -> dict:
    simulate.main([*FLAGS, *extra])
    return {r["mode"]: r for r in json.loads(capsys.readouterr().out.splitlines()[-1])}


def _generate_s() -> float:
    """A batch admitted at once (its prefills one after the other), then L decode steps."""
    return B * P * PREFILL_US / 1e6 + L * DECODE_MS / 1e3


def test_split_sync_idles_each_side_in_turn(capsys):
    train_us = 400.0
    r = _run(capsys, "--modes", "sync", "--train-us-per-token", str(train_us))["sync"]
    step = _generate_s() + B * (P + L) * train_us / 1e6 + RELOAD_S
    assert r["accelerators_generating"] == r["accelerators_training"] == 1
    assert r["samples_per_s"] == pytest.approx(B / step, rel=1e-6)


def test_async_is_bound_by_its_slower_side(capsys):
    # Training is the slower side: after the first batch, the trainer never waits.
    train_us = 2000.0
    r = _run(capsys, "--modes", "async", "--train-us-per-token", str(train_us))["async"]
    train_s = B * (P + L) * train_us / 1e6
    assert train_s > _generate_s()
    assert r["samples_per_s"] == pytest.approx(STEPS * B / (_generate_s() + STEPS * train_s),
                                               rel=1e-6)
    assert r["trainer_busy"] > 0.95


def test_a_calibration_file_sets_the_defaults_and_flags_win(tmp_path, capsys):
    path = tmp_path / "costs.json"
    path.write_text('{"decode_ms": 2.0, "train_us_per_token": 400.0, "lengths": [40], '
                    '"unknown_key": 1}')
    flags = list(FLAGS)
    i = flags.index("--decode-ms")
    del flags[i:i + 2]
    simulate.main([*flags, "--calibration", str(path), "--modes", "sync"])
    from_file = json.loads(capsys.readouterr().out.splitlines()[-1])[0]
    simulate.main([*flags, "--calibration", str(path), "--modes", "sync",
                   "--train-us-per-token", "800"])
    overridden = json.loads(capsys.readouterr().out.splitlines()[-1])[0]
    step = _generate_s() + B * (P + L) * 400e-6 + RELOAD_S
    assert from_file["samples_per_s"] == pytest.approx(B / step, rel=1e-6)
    assert overridden["samples_per_s"] < from_file["samples_per_s"]


def test_partial_keeps_fewer_slots_than_a_batch_full(capsys):
    """Half a batch of slots: partial refills each slot as it frees (it used to wait for
    samples it never admitted, for ever); with every sample the same length it then runs
    two full rounds of decoding a step, as sync does."""
    flags = ["--slots", str(B // 2), "--train-us-per-token", "400", "--modes", "sync", "partial"]
    r = _run(capsys, *flags)
    assert r["partial"]["samples_per_s"] == pytest.approx(r["sync"]["samples_per_s"], rel=0.05)
