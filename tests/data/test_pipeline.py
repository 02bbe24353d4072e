"""The trainer's input pipeline (jaxrl/data/pipeline.py) and the rollout stream under it
(jaxrl/data/rollouts.py). Packed arrays are checked by rebuilding every sample from them; a
resumed pipeline is checked against the uninterrupted one."""

import collections
import contextlib
import dataclasses
import json
import threading
import time

import numpy as np
import pytest

from jaxrl.data.pipeline import LagFilter, LagStats, pack, rl_batches
from jaxrl.data.rollouts import Rollout, RolloutLog, RolloutSource, source_position
from jaxrl.rl.config import RLConfig
from serving.runner.engine_config import EngineConfig
from tests.serving.common import until

CFG = RLConfig(prompts_per_step=2, group_size=4, engine=EngineConfig(max_concurrent_decodes=4),
               pack_len=32, microbatch_rows=2, max_prompt_len=10, max_new_tokens=6, prefetch=0)
BOS = 1


def make_rollout(rng, i: int, n_prompt: int, n_completion: int,
                 versions: list[int] | None = None) -> Rollout:
    """Sample `i`, recognisable by its first completion token (1000 + i)."""
    completion = [1000 + i] + rng.integers(2, 500, n_completion - 1).tolist()
    return Rollout(prompt=[BOS] + rng.integers(2, 500, n_prompt - 1).tolist(),
                   completion=completion,
                   logprobs=(-rng.uniform(0.01, 5.0, n_completion)).tolist(),
                   versions=versions if versions is not None else [0] * n_completion,
                   reward=float(rng.integers(0, 2)), advantage=float(rng.normal()),
                   group=i // 4, finish="eos")


def random_rollouts(n: int, cfg: RLConfig = CFG, seed: int = 0, first: int = 0) -> list[Rollout]:
    rng = np.random.default_rng(seed)
    return [make_rollout(rng, first + i, int(rng.integers(1, cfg.max_prompt_len + 1)),
                         int(rng.integers(1, cfg.max_new_tokens + 1))) for i in range(n)]


@contextlib.contextmanager
def batches_of(log: RolloutLog, cfg: RLConfig, start: int = 0, current_step=lambda: 0):
    """An iterator over `rl_batches`, shut down as the trainer does: log first (a prefetch
    thread may wait on it), then the iterator."""
    dataset, dropped = rl_batches(log, cfg, current_step=current_step, start=start)
    it = iter(dataset)
    try:
        yield it, dropped
    finally:
        log.close()
        it.close()


# --- 1. packing --------------------------------------------------------------------------------

def unpack(batch: dict, cfg: RLConfig) -> list[dict]:
    """Every sample in a packed batch, rebuilt from its arrays alone; checks along the way that
    segments are contiguous, positions restart at 0 and padding carries nothing."""
    a = {k: np.asarray(v).reshape(-1, cfg.pack_len) for k, v in batch["arrays"].items()}
    pad = a["segment_ids"] == 0
    for k in ("loss_mask", "behaviour_logp", "advantages"):
        assert not a[k][pad].any(), f"padding tokens carry {k}"
    samples = []
    for row in range(a["segment_ids"].shape[0]):
        seg = a["segment_ids"][row]
        assert len(set(seg[seg > 0].tolist())) <= cfg.max_segments
        for s in sorted(set(seg[seg > 0].tolist())):
            idx = np.flatnonzero(seg == s)
            assert np.array_equal(idx, np.arange(idx[0], idx[-1] + 1)), "segment not contiguous"
            np.testing.assert_array_equal(a["positions"][row, idx], np.arange(len(idx)))
            inputs, targets = a["input_ids"][row, idx], a["targets"][row, idx]
            np.testing.assert_array_equal(targets[:-1], inputs[1:])  # targets = next tokens
            samples.append({"tokens": tuple(inputs.tolist()) + (int(targets[-1]),),
                            **{k: a[k][row, idx] for k in
                               ("loss_mask", "behaviour_logp", "advantages")}})
    return samples


def check_packed(batch: dict, rollouts: list[Rollout], cfg: RLConfig) -> None:
    samples = unpack(batch, cfg)
    assert collections.Counter(s["tokens"] for s in samples) == \
        collections.Counter(tuple(r.prompt + r.completion) for r in rollouts)
    by_tokens = {tuple(r.prompt + r.completion): r for r in rollouts}
    for s in samples:
        r = by_tokens[s["tokens"]]
        # Input position j predicts token j + 1: a completion token when j + 1 >= len(prompt).
        on = np.array([j + 1 >= len(r.prompt) for j in range(len(s["tokens"]) - 1)])
        assert on.sum() == len(r.completion)
        np.testing.assert_array_equal(s["loss_mask"], on.astype(np.float32))
        np.testing.assert_array_equal(s["behaviour_logp"][on], np.float32(r.logprobs))
        np.testing.assert_array_equal(s["behaviour_logp"][~on], 0)
        np.testing.assert_array_equal(s["advantages"][on], np.float32(r.advantage))
        np.testing.assert_array_equal(s["advantages"][~on], 0)
    seg = np.asarray(batch["arrays"]["segment_ids"])
    assert seg.shape == (cfg.max_microbatches, cfg.microbatch_rows, cfg.pack_len)
    used = [bool(seg[m].any()) for m in range(cfg.max_microbatches)]
    assert batch["microbatches"] == sum(used)
    assert all(used[:batch["microbatches"]]), "the step runs the first `microbatches` only"


@pytest.mark.parametrize("cfg", [CFG, dataclasses.replace(CFG, max_segments=1)],
                         ids=["segments16", "segments1"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pack_rebuilds_variable_length_samples(cfg, seed):
    rollouts = random_rollouts(cfg.batch_size, cfg, seed)
    check_packed(pack(rollouts, cfg), rollouts, cfg)


@pytest.mark.parametrize("cfg", [CFG, dataclasses.replace(CFG, max_segments=1),
                                 dataclasses.replace(CFG, pack_len=16)],
                         ids=["segments16", "segments1", "one_per_row"])
def test_pack_worst_case_fits(cfg):
    """Every sample max_prompt_len + max_new_tokens long: the reserved microbatches suffice."""
    rng = np.random.default_rng(0)
    rollouts = [make_rollout(rng, i, cfg.max_prompt_len, cfg.max_new_tokens)
                for i in range(cfg.batch_size)]
    batch = pack(rollouts, cfg)
    check_packed(batch, rollouts, cfg)
    assert batch["microbatches"] == cfg.max_microbatches


def test_pack_shortest_samples():
    rng = np.random.default_rng(0)
    rollouts = [make_rollout(rng, i, 1, 1) for i in range(CFG.batch_size)]  # BOS + 1 token
    batch = pack(rollouts, CFG)
    check_packed(batch, rollouts, CFG)
    assert batch["microbatches"] == 1


def test_pack_gives_the_same_rows_whatever_order_the_samples_finished_in():
    """The threads' timing orders the log; the packed rows (and so the step's float sums) must
    not follow it, or a sync run would not repeat for its seed. The batch's rollouts keep the
    log's order (the metrics and the resume read it)."""
    rollouts = random_rollouts(CFG.batch_size, CFG, seed=3)
    want = pack(rollouts, CFG)
    for seed in range(3):
        arrived = [rollouts[i] for i in np.random.default_rng(seed).permutation(len(rollouts))]
        got = pack(arrived, CFG)
        assert got["rollouts"] == arrived and got["microbatches"] == want["microbatches"]
        for k, v in want["arrays"].items():
            np.testing.assert_array_equal(got["arrays"][k], v, err_msg=k)


def test_pack_lays_routing_out_with_the_tokens():
    """A MoE engine's routing ([tokens - 1, L, K] per rollout) lands at the packed position of
    the token it routed: every value names its rollout and position, and the input token there
    is that rollout's token at that position; padding and rollouts without routing get -1."""
    rollouts = random_rollouts(CFG.batch_size, CFG, seed=3)
    for i, r in enumerate(rollouts[1:], 1):      # the first has none
        fed = len(r.prompt) + len(r.completion) - 1
        r.routes = (np.arange(fed)[:, None, None] + 1000 * i + np.zeros((1, 2, 3), int)
                    ).astype(np.int32)
    batch = pack(rollouts, CFG)
    check_packed(batch, rollouts, CFG)
    routes = np.asarray(batch["arrays"]["routes"]).reshape(-1, CFG.pack_len, 2, 3)
    ids = np.asarray(batch["arrays"]["input_ids"]).reshape(-1, CFG.pack_len)
    assert (routes == routes[..., :1, :1]).all()           # one value per token
    value = routes[..., 0, 0]
    seen = collections.Counter()
    for row, t in zip(*np.nonzero(value >= 0)):
        i, position = divmod(int(value[row, t]), 1000)
        r = rollouts[i]
        assert ids[row, t] == (r.prompt + r.completion)[position]
        seen[i] += 1
    assert seen == {i: len(r.prompt) + len(r.completion) - 1
                    for i, r in enumerate(rollouts) if i}
    back = Rollout.from_json(json.loads(json.dumps(rollouts[1].to_json())))
    np.testing.assert_array_equal(back.routes, rollouts[1].routes)
    with pytest.raises(ValueError, match="routing of 2 tokens"):
        dataclasses.replace(rollouts[1], routes=rollouts[1].routes[:2])


# --- 2. lag filter -----------------------------------------------------------------------------

@pytest.mark.parametrize("lag, kept", [("oldest", [True, True, False, False, False]),
                                       ("newest", [True, True, False, True, True]),
                                       ("mean", [True, True, False, True, False])])
def test_lag_filter_by_each_definition(lag, kept):
    lag_filter = LagFilter(lambda: 5, max_lag=2, lag=lag)
    rng = np.random.default_rng(0)
    samples = [make_rollout(rng, 0, 2, 1, versions=[3]),            # lag 2 by any measure
               make_rollout(rng, 1, 2, 2, versions=[5, 4]),
               make_rollout(rng, 2, 2, 1, versions=[2]),            # lag 3 by any measure
               make_rollout(rng, 3, 2, 3, versions=[5, 2, 5]),      # oldest 3, mean 1, newest 0
               make_rollout(rng, 4, 2, 5, versions=[1, 1, 1, 1, 5])]  # oldest 4, mean 3.2
    assert [lag_filter.filter(r) for r in samples] == kept
    assert lag_filter.take() == [(len(r.completion), not k) for r, k in zip(samples, kept)]
    assert lag_filter.take() == []


def test_lag_stats_per_length_bucket_survive_a_checkpoint():
    stats = LagStats()
    for tokens, dropped in ((3, False), (4, True), (100, True), (120, False), (900, True)):
        stats.add(tokens, dropped)
    fractions = LagStats(stats.state()).fractions()
    assert fractions == {"lag_dropped_samples_le4": 0.5, "lag_dropped_samples_le128": 0.5,
                         "lag_dropped_samples_le1024": 1.0, "lag_dropped_tokens_le4": 4 / 7,
                         "lag_dropped_tokens_le128": 100 / 220, "lag_dropped_tokens_le1024": 1.0}


def test_pipeline_drops_stale_samples_and_keeps_order():
    rng = np.random.default_rng(0)
    cfg = dataclasses.replace(CFG, max_lag=2, lag="oldest", prefetch=2)
    rollouts, kept = [], []
    for i in range(8 * cfg.batch_size):
        n = int(rng.integers(1, cfg.max_new_tokens + 1))
        oldest = int(rng.integers(0, 6))  # the weights changed mid-sample: versions ascend
        versions = sorted(rng.integers(oldest, min(oldest + 2, 5) + 1, n - 1).tolist())
        versions = [oldest] + versions
        r = make_rollout(rng, i, int(rng.integers(1, cfg.max_prompt_len + 1)), n, versions)
        rollouts.append(r)
        if min(versions) >= 3:
            kept.append(r)
    n_batches = len(kept) // cfg.batch_size
    assert n_batches >= 2 and len(kept) < len(rollouts)
    log = RolloutLog()
    log.append(rollouts)
    log.close()
    def dropped_before(batches_taken):
        """Stale samples before the last one the first `batches_taken` batches hold."""
        last = kept[batches_taken * cfg.batch_size - 1]
        return sum(r not in kept for r in rollouts[:rollouts.index(last)])

    seen = []               # one entry per sample the filter has judged (it asks the step)

    def step():
        seen.append(1)
        return 5

    with batches_of(log, cfg, current_step=step) as (it, dropped):
        batches = [next(it)]
        # The prefetch thread runs ahead: wait until it has filtered every sample of the
        # batches it holds beyond the one taken.
        ahead = min(1 + cfg.prefetch, n_batches)
        last = kept[ahead * cfg.batch_size - 1]
        until(lambda: len(seen) > rollouts.index(last), what="the prefetch running ahead")
        # Drops are counted with the batch that took them: none from batches not taken yet.
        assert dropped.total == dropped_before(1)
        batches += list(it)
    assert [r for b in batches for r in b["rollouts"]] == kept[:n_batches * cfg.batch_size]
    assert dropped.total == dropped_before(n_batches)


# --- 3. batching -------------------------------------------------------------------------------

@pytest.mark.parametrize("prefetch", [0, 2])
def test_batches_hold_batch_size_samples_in_log_order(prefetch):
    cfg = dataclasses.replace(CFG, prefetch=prefetch)
    rollouts = random_rollouts(4 * cfg.batch_size + 3, cfg)
    log = RolloutLog()
    log.append(rollouts)
    log.close()
    with batches_of(log, cfg) as (it, _):
        batches = list(it)
    assert len(batches) == 4  # the 3 left over do not make a step
    for k, b in enumerate(batches):
        assert b["rollouts"] == rollouts[k * cfg.batch_size:(k + 1) * cfg.batch_size]
        check_packed(b, b["rollouts"], cfg)


# --- 4. resume ---------------------------------------------------------------------------------

class WatchedLog(RolloutLog):
    """A log that records the furthest position read, to see a prefetch thread run ahead."""

    furthest = -1

    def get(self, position, timeout=None):
        self.furthest = max(self.furthest, position)
        return super().get(position, timeout)


def assert_same_batches(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g["rollouts"] == w["rollouts"]
        assert g["microbatches"] == w["microbatches"]
        for k in w["arrays"]:
            np.testing.assert_array_equal(g["arrays"][k], w["arrays"][k], err_msg=k)


def checkpoint(it, log: RolloutLog) -> dict:
    """What rl.py saves (through JSON, as the checkpoint's data does)."""
    state = it.get_state()
    position = source_position(state)
    return json.loads(json.dumps({"position": position, "iterator": state,
                                  "rollouts": [r.to_json() for r in log.tail(position)]}))


@pytest.mark.parametrize("release", [False, True], ids=["kept", "released"])
@pytest.mark.parametrize("prefetch", [0, 2])
def test_resume_continues_the_same_stream(prefetch, release):
    cfg = dataclasses.replace(CFG, prefetch=prefetch)
    b = cfg.batch_size
    rollouts = random_rollouts(8 * b, cfg)
    before, after = rollouts[:5 * b + 3], rollouts[5 * b + 3:]  # what existed at the interrupt

    log = RolloutLog()
    log.append(rollouts)
    with batches_of(log, cfg) as (it, _):
        want = [next(it) for _ in range(8)]

    log = WatchedLog()
    log.append(before)
    with batches_of(log, cfg) as (it, _):
        consumed = [next(it) for _ in range(2)]
        if release:  # rl.py: checkpoint, release the trained part, keep training
            log.release(source_position(it.get_state()))
            with pytest.raises(IndexError, match="released"):
                log.get(0)
            consumed.append(next(it))
        if prefetch:  # let the prefetch thread fill its buffer, ahead of the trainer
            ahead = (len(consumed) + prefetch) * b - 1
            deadline = time.monotonic() + 10
            while log.furthest < ahead and time.monotonic() < deadline:
                time.sleep(0.005)
            assert log.furthest >= ahead
        data = checkpoint(it, log)
    assert_same_batches(consumed, want[:len(consumed)])
    assert data["position"] == len(consumed) * b  # consumed, not prefetched
    assert len(data["rollouts"]) == len(before) - data["position"]

    resumed = RolloutLog(data["position"], [Rollout.from_json(r) for r in data["rollouts"]])
    resumed.append(after)  # the resumed actor goes on generating
    with batches_of(resumed, cfg, start=data["position"]) as (it, _):
        it.set_state(data["iterator"])
        got = [next(it) for _ in range(8 - len(consumed))]
    assert_same_batches(got, want[len(consumed):])


# --- 5. the rollout log ------------------------------------------------------------------------

def test_get_blocks_until_appended():
    log = RolloutLog()
    r = random_rollouts(1)[0]
    out = []
    reader = threading.Thread(target=lambda: out.append(log.get(0)))
    reader.start()
    reader.join(timeout=0.1)
    assert reader.is_alive() and not out
    log.append([r])
    reader.join(timeout=5)
    assert out == [r]
    with pytest.raises(TimeoutError):
        log.get(1, timeout=0.01)


def test_close_ends_iteration():
    rollouts = random_rollouts(3)
    log = RolloutLog()
    log.append(rollouts[:2])
    got = []
    reader = threading.Thread(target=lambda: got.extend(RolloutSource(log)))
    reader.start()
    log.append(rollouts[2:])
    reader.join(timeout=0.1)
    assert reader.is_alive()  # waits for a fourth rollout
    log.close()
    reader.join(timeout=5)
    assert not reader.is_alive() and got == rollouts


def test_released_positions_raise():
    rollouts = random_rollouts(5)
    log = RolloutLog()
    log.append(rollouts)
    log.release(3)
    assert log.end == 5 and log.tail(0) == rollouts[3:] and log.get(3) == rollouts[3]
    with pytest.raises(IndexError, match=r"rollout 2 was released \(the log starts at 3\)"):
        log.get(2)
    log.release(99)  # beyond the end: forgets what exists, keeps positions
    assert log.end == 5 and log.tail(5) == []
    resumed = RolloutLog(10, rollouts[:2])
    assert resumed.end == 12 and resumed.get(11) == rollouts[1]
    with pytest.raises(IndexError, match="released"):
        next(iter(RolloutSource(resumed, start=9)))


def test_rollout_json_round_trip():
    r = random_rollouts(1)[0]
    r.versions = [3] * len(r.completion)
    back = Rollout.from_json(json.loads(json.dumps(r.to_json())))
    assert back == r and back is not r


def test_environment_tokens_of_an_episode_carry_no_loss():
    """A multi-turn episode: model turn, environment answer, model turn. Only the model's
    tokens are in the loss mask, with the advantage and their behaviour log-probs."""
    from jaxrl.data.pipeline import features

    trained = [True, True, False, False, False, True, True]
    episode = Rollout(prompt=[BOS, 5, 6], completion=[10, 11, 20, 21, 22, 12, 13],
                      logprobs=[-0.5, -0.6, -9.0, -9.0, -9.0, -0.7, -0.8], versions=[3] * 7,
                      reward=1.0, advantage=0.25, group=0, finish="eos", trained=trained)
    f = features(episode)
    # position p predicts token p + 1: the completion starts at prompt length - 1
    assert f["loss_mask"].tolist() == [0, 0] + [float(t) for t in trained]
    assert f["advantages"].tolist() == [0, 0] + [0.25 if t else 0.0 for t in trained]
    assert f["behaviour_logp"].tolist() == pytest.approx(
        [0, 0, -0.5, -0.6, 0, 0, 0, -0.7, -0.8])
    assert Rollout.from_json(json.loads(json.dumps(episode.to_json()))) == episode
    with pytest.raises(ValueError, match="7 completion tokens but 7 logprobs, 7 versions, 6 "
                                         "trained flags"):
        dataclasses.replace(episode, trained=trained[:-1])
