"""bench/simulate.py with measured op costs (bench/calibrate.py's) on a split of two
accelerators, against closed forms: every sample the same length, no cost per held token."""

import json
import re
import sys
from pathlib import Path

import pytest

# appended, not put first: bench/tinker.py must not hide the installed tinker SDK
sys.path.append(str(Path(__file__).resolve().parents[1] / "bench"))
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


def test_a_packed_step_costs_its_microbatches_and_its_tokens(capsys):
    """Each sample is P + L - 1 = 49 next-token pairs: two to a 100-token row (8 rows, 2
    microbatches of 4), or one per row with max_segments=1 (16 rows, 4 microbatches)."""
    train_us, mb_ms = 400.0, 250.0
    packed = ["--modes", "sync", "--train-us-per-token", str(train_us),
              "--train-ms-per-microbatch", str(mb_ms), "--pack-len", "100",
              "--microbatch-rows", "4"]
    for segments, microbatches in ((2, 2), (1, 4)):
        r = _run(capsys, *packed, "--max-segments", str(segments))["sync"]
        step = (_generate_s() + microbatches * mb_ms / 1e3 + B * (P + L) * train_us / 1e6
                + RELOAD_S)
        assert r["samples_per_s"] == pytest.approx(B / step, rel=1e-6)


def test_dropped_groups_are_generated_again(capsys):
    """One group per batch, dropped half the time: a sync step generates 1 / (1 - 0.5) = 2
    rounds on average (a seeded draw over 200 steps: within 10%)."""
    train_us = 400.0
    flags = ["--modes", "sync", "--train-us-per-token", str(train_us), "--group-size", str(B),
             "--steps", "200"]
    kept = _run(capsys, *flags)["sync"]
    halved = _run(capsys, *flags, "--drop-groups", "0.5")["sync"]
    train = B * (P + L) * train_us / 1e6 + RELOAD_S
    assert kept["samples_per_s"] == pytest.approx(B / (_generate_s() + train), rel=1e-6)
    assert halved["samples_per_s"] == pytest.approx(B / (2 * _generate_s() + train), rel=0.1)


def test_async_contention_slows_both_sides(capsys):
    """Training is the slower side (as in test_async_is_bound_by_its_slower_side); with every
    cost 1.25x, so is the whole run. Host work per sample lengthens the trainer's steps."""
    flags = ["--modes", "async", "--train-us-per-token", "2000"]
    base = _run(capsys, *flags)["async"]
    slowed = _run(capsys, *flags, "--contention", "1.25")["async"]
    assert slowed["samples_per_s"] == pytest.approx(base["samples_per_s"] / 1.25, rel=1e-6)
    hosted = _run(capsys, *flags, "--trainer-host-ms-per-sample", "0.5")["async"]
    assert hosted["samples_per_s"] < base["samples_per_s"] and hosted["trainer_busy"] > 0.95


@pytest.mark.parametrize("flags, message", [
    (["--drop-groups", "1"], r"--drop-groups=1.0 must be in \[0, 1\)"),
    (["--train-ms-per-microbatch", "5"], "needs --pack-len, --microbatch-rows"),
])
def test_bad_settings_are_refused_by_name(flags, message, capsys):
    with pytest.raises(SystemExit):
        simulate.main([*FLAGS, *flags])
    assert re.search(message, capsys.readouterr().err)


def test_a_bounded_actor_holds_the_generator_back(capsys):
    """Training is the slower side: an unbounded generator never stops (its samples pile up,
    older and older); bounded to two batches ahead (jaxrl's actor) it generates a batch per
    train step and idles the rest, at the same trainer-bound rate."""
    flags = ["--modes", "async", "--train-us-per-token", "2000"]
    free = _run(capsys, *flags)["async"]
    bounded = _run(capsys, *flags, "--max-ahead", str(2 * B))["async"]
    train_s = B * (P + L) * 2000e-6
    decode_s = L * DECODE_MS / 1e3         # (generation_busy counts decoding, not prefills)
    assert free["generation_busy"] == pytest.approx(decode_s / _generate_s(), rel=0.02)
    assert bounded["generation_busy"] == pytest.approx(decode_s / train_s, rel=0.1)
    assert bounded["samples_per_s"] == pytest.approx(free["samples_per_s"], rel=0.02)


def test_a_decode_step_costs_the_rows_it_decodes(capsys):
    """Slots for two batches, a batch busy: each step is the 16-row count's (1 ms), not the
    32-row one's."""
    flags = ["--modes", "sync", "--train-us-per-token", "400", "--slots", str(2 * B),
             "--decode-ms-by-rows", json.dumps({"4": 0.5, str(B): 1.0, str(2 * B): 5.0})]
    r = _run(capsys, *flags)["sync"]
    step = (B * P * PREFILL_US / 1e6 + L * 1.0 / 1e3 + B * (P + L) * 400e-6 + RELOAD_S)
    assert r["samples_per_s"] == pytest.approx(B / step, rel=1e-6)


def test_multiplexed_sync_generates_on_the_trainers_accelerator_too(capsys):
    """sync+multiplex: the batch is placed half on each accelerator (as the fleet's router
    places groups by load), so each prefills half of it; the trainer's accelerator then
    trains alone."""
    train_us = 400.0
    r = _run(capsys, "--modes", "sync+multiplex", "--train-us-per-token",
             str(train_us))["sync+multiplex"]
    step = (B // 2) * P * PREFILL_US / 1e6 + L * DECODE_MS / 1e3 \
        + B * (P + L) * train_us / 1e6 + RELOAD_S
    assert r["accelerators_generating"] == 2 and r["accelerators_training"] == 1
    assert r["samples_per_s"] == pytest.approx(B / step, rel=1e-6)
