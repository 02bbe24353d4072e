"""RL with generation in other processes: the trainer (this process, through
`jaxrl.commands.job.run` as `jaxrl train` runs it) and two `jaxrl serve` subprocesses serving the
warm-up's checkpoint. One server is SIGKILLed part-way through the run and started again at once; it
rejoins while the run goes on.

Checked: the reward rises as in-process (tests/run/test_rl.py); every group is trained exactly
once and no finished sample is lost (the counters balance); the killed server's groups moved to
the other; the restarted server rejoined with the trainer's weights and served again; every
trained token carries a log-prob and a version of the trainer's weights (none from a server's
own start-up weights). And a tcp push to two such servers: one relays it to the other through a
memfd."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from jaxrl.commands import job
from jaxrl.rollout.fleet import Fleet
from jaxrl.telemetry import rl_metrics
from jaxrl.train.checkpoint import Checkpointer
from serving.fleet.client import RemoteGeneration
from tests.run.test_rl import RL_STEPS, WARMUP, config, quiet, rl_rows, rl_run_dir

pytestmark = pytest.mark.slow

# Server 1 is killed after step KILL_AT and started again at once; step REJOINED_BY waits (in
# the test's hook) until it has rejoined, so the last steps run on both servers again.
KILL_AT, REJOINED_BY = WARMUP + 8, WARMUP + 20
TOKEN = "fleet-test-token"


def start_server(checkpoint, token_file, port=0, join=None):
    """A `jaxrl serve` subprocess (offering itself to the run at `join`); (process, address)
    once it is ready."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxrl.cli", "serve", "--checkpoint", str(checkpoint),
         "--port", str(port), "--slots", "16", "--max-len", "13", "--max-prefill-length", "8",
         "--prefill-chunk", "8", "--page-size", "4", "--update-token-file", str(token_file),
         *(["--join", join] if join else [])],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"})
    output = []
    for line in proc.stdout:
        output.append(line)
        if "ready on" in line:
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep it drained
            return proc, line.split("ready on ")[1].split(": ")[0]
    raise AssertionError("jaxrl serve did not start:\n" + "".join(output)[-3000:])


@pytest.fixture(scope="module")
def warmed(tmp_path_factory):
    """The warm-up's run directory, with the servers' token file in it."""
    warm_dir = tmp_path_factory.mktemp("fleet_warmup")
    job.run(config(warm_dir, "rl.steps=0"), log=quiet)
    (warm_dir / "token").write_text(TOKEN)
    return warm_dir


@pytest.fixture(scope="module")
def fleet_run(warmed, tmp_path_factory):
    warm_dir, token_file = warmed, warmed / "token"
    servers = [start_server(warm_dir / "checkpoints", token_file) for _ in range(2)]
    addresses = [address for _, address in servers]
    run_dir = rl_run_dir(warm_dir / "checkpoints", tmp_path_factory.mktemp("fleet"))
    cfg_overrides = ("rl.mode=async", f"rl.generation.servers={','.join(addresses)}",
                     f"rl.generation.token_file={token_file}", "rl.generation.heartbeat_s=0.5",
                     "rl.generation.heartbeat_timeout_s=10", "rl.max_lag=1000")
    cfg = config(run_dir, *cfg_overrides)
    trained, events, lines = {}, {}, []
    batch_stats = rl_metrics.batch_stats

    def restart():                  # back on its port, in the background
        port = int(addresses[1].rsplit(":", 1)[1])
        servers[1] = start_server(warm_dir / "checkpoints", token_file, port)
        events["restarted"] = True

    restarting = threading.Thread(target=restart, daemon=True)

    def record(rollouts, step):     # once per optimizer step, in the trainer's thread
        trained[step + 1] = list(rollouts)
        if step + 1 == KILL_AT:
            _until_busy(addresses[1])     # killed with work in flight, whatever the timing
            servers[1][0].send_signal(signal.SIGKILL)
            servers[1][0].wait(30)
            restarting.start()
        if step + 1 == REJOINED_BY:
            deadline = time.monotonic() + 300
            while not any(f"{addresses[1]} rejoined" in line for line in lines):
                assert time.monotonic() < deadline, "the restarted server did not rejoin"
                time.sleep(0.2)
        return batch_stats(rollouts, step)

    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(rl_metrics, "batch_stats", record)
            job.run(cfg, log=lines.append)
        after = _versions(addresses)
        # A trainer that resumes from an older checkpoint than the servers' weights (as one
        # that crashed after pushing newer ones): the warm-up's, at WARMUP, for 2 steps.
        resumed_dir = rl_run_dir(warm_dir / "checkpoints", tmp_path_factory.mktemp("resumed"))
        resumed = {}
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(rl_metrics, "batch_stats",
                       lambda rollouts, step: (resumed.setdefault(step + 1, list(rollouts)),
                                               batch_stats(rollouts, step))[1])
            job.run(config(resumed_dir, *cfg_overrides, "rl.steps=2"), log=quiet)
        after_resume = _versions(addresses)
    finally:
        if restarting.is_alive():    # never leave a server behind, even one still starting
            restarting.join(300)
        for proc, _ in servers:
            proc.kill()
            proc.wait(60)
    ckpt = Checkpointer(run_dir / "checkpoints")
    final = ckpt.saved_data(WARMUP + RL_STEPS)
    ckpt.close()
    return {"run_dir": run_dir, "trained": trained, "events": events, "after": after,
            "addresses": addresses, "final": final, "lines": lines, "resumed": resumed,
            "after_resume": after_resume}


def _until_busy(address, timeout: float = 120.0) -> None:
    """Returns once the server at `address` holds a request (queued or decoding): an actor
    that ran ahead of the trainer may leave both servers idle for a moment."""
    remote = RemoteGeneration(address, rpc_timeout_s=30)
    try:
        deadline = time.monotonic() + timeout
        while True:
            m = remote.metrics()
            if m["queued"] or m["held_tokens"]:
                return
            assert time.monotonic() < deadline, f"{address} held no request for {timeout} s"
            time.sleep(0.002)
    finally:
        remote.close()


def _versions(addresses) -> dict:
    """Each server's metrics (its version, requests done)."""
    out = {}
    for address in addresses:
        remote = RemoteGeneration(address, rpc_timeout_s=30)
        out[address] = remote.metrics()
        remote.close()
    return out


@pytest.mark.learning
def test_reward_rises_with_remote_generation(fleet_run, report_table):
    """The same margin as in-process (tests/run/test_rl.py: +0.05 over 8 steps each end). The
    samples' lag depends on the threads' and processes' timing, so this is in the learning
    tier (`make test-learning`), not gated by CI: it has failed 2 times in about 15 runs."""
    rows = rl_rows(fleet_run["run_dir"])
    assert [r["step"] for r in rows] == list(range(WARMUP + 1, WARMUP + RL_STEPS + 1))
    rewards = np.asarray([r["reward"] for r in rows if r["reward"] is not None])
    first, last = rewards[:8].mean(), rewards[-8:].mean()
    report_table("RL on arithmetic (tiny model): mean reward of the first and last steps",
                 ("run", "steps", "first 8", "last 8"),
                 ("2 jaxrl serve, one killed", len(rows), f"{first:.3f}", f"{last:.3f}"))
    # It failed 2 times in about 15 runs (a flat reward over all 30 steps) and passed in the
    # next 6 with the same code; what a failure needs to be told from noise is said with it.
    assert last > first + 0.05, [
        {k: r.get(k) if not isinstance(r.get(k), float) else round(r[k], 3)
         for k in ("step", "reward", "lag_mean", "lag_max", "kl_new_old", "members_ready",
                   "dropped_lag", "entropy")} for r in rows]


def test_every_group_is_trained_once_and_nothing_finished_is_lost(fleet_run):
    per_group = {}
    for step, rollouts in fleet_run["trained"].items():
        for r in rollouts:
            per_group.setdefault(r.group, []).append(step)
    counts = {g: len(steps) for g, steps in per_group.items()}
    assert max(counts.values()) == 8, counts             # never a sample twice
    # Every group trained whole, but the one the last batch cut (its rest waits on the log).
    assert sum(c != 8 for c in counts.values()) <= 1, counts
    # The final checkpoint's counters, all taken at one instant: every sample kept was trained
    # or waits in the stream it saved.
    final = fleet_run["final"]
    assert rl_rows(fleet_run["run_dir"])[-1]["dropped_lag"] == 0
    assert final["stats"]["samples"] == final["trained"] + len(final["rollouts"])
    assert final["trained"] == sum(counts.values())


def test_the_killed_server_s_work_moved_and_it_rejoined(fleet_run):
    rows = {r["step"]: r for r in rl_rows(fleet_run["run_dir"])}
    assert rows[KILL_AT - 1]["members_ready"] == 2
    assert min(r["members_ready"] for s, r in rows.items() if s > KILL_AT) == 1
    assert all(rows[s]["members_ready"] == 2 for s in range(REJOINED_BY, WARMUP + RL_STEPS + 1))
    assert rows[WARMUP + RL_STEPS]["members_set_aside"] >= 1
    assert rows[WARMUP + RL_STEPS]["groups_moved"] >= 1
    assert any("set aside" in line for line in fleet_run["lines"])
    assert any(f"{fleet_run['addresses'][1]} rejoined" in line for line in fleet_run["lines"])
    restarted = fleet_run["after"][fleet_run["addresses"][1]]
    assert fleet_run["events"]["restarted"]
    assert restarted["version"] >= REJOINED_BY and restarted["requests_done"] > 0


def test_two_jaxrl_serve_processes_relay_a_tcp_push_by_memfd(warmed):
    """A push over tcp to two `jaxrl serve` processes on this host forms a chain: the second
    pulls the weights from the first by mapping its memfd (a descriptor passed between the two
    processes) rather than reading them through a socket, and serves from that mapping,
    read-only; both then serve the version."""
    from jaxrl.models import split_params
    from jaxrl.rollout.fleet import Member
    from jaxrl.rollout.publisher import WeightPublisher
    from jaxrl.trainer.warmup import restore_for_eval

    model = restore_for_eval(warmed / "checkpoints")[0]
    servers = [start_server(warmed / "checkpoints", warmed / "token") for _ in range(2)]
    remotes = [RemoteGeneration(address, token=TOKEN, transfer="tcp") for _, address in servers]
    try:
        fleet = Fleet([Member(r.address, r, 16, remote=True, last_metrics=r.metrics())
                       for r in remotes], eos_id=None, heartbeat_s=3600, warn=lambda _: None)
        publisher = WeightPublisher(fleet, deadline_s=120, warn=lambda _: None)
        publisher.publish(split_params(model)[1], 100)
        assert len(publisher.wait(100)) == 2
        publisher.close()
        fleet.close()
        served = [r.metrics() for r in remotes]
        maps = [Path(f"/proc/{proc.pid}/maps").read_text() for proc, _ in servers]
    finally:
        for r in remotes:
            r.close()
        for proc, _ in servers:
            proc.kill()
            proc.wait(60)
    assert [m["version"] for m in served] == [100, 100]
    assert sorted((m["bulk_sends"], m["bulk_mapped_sends"]) for m in served) == [(0, 0), (1, 1)]
    # The server downstream maps the relay's weights read-only and shared ("r--s"); the relay
    # maps its own slab writable.
    weights = [{line.split()[1] for line in m.splitlines() if "memfd:jaxrl-weights" in line}
               for m in maps]
    relay = [m["bulk_sends"] for m in served].index(1)
    assert "rw-s" in weights[relay] and "r--s" in weights[1 - relay], weights


def test_every_trained_token_has_the_trainer_s_log_prob_and_version(fleet_run):
    for step, rollouts in fleet_run["trained"].items():
        for r in rollouts:
            assert len(r.completion) == len(r.logprobs) == len(r.versions) > 0
            assert all(np.isfinite(r.logprobs)) and max(r.logprobs) <= 0
            assert WARMUP <= min(r.versions) and max(r.versions) < step
            assert r.versions == sorted(r.versions)


def test_a_trainer_resumed_from_older_weights_brings_every_server_back(fleet_run):
    """The servers serve step WARMUP + RL_STEPS's weights; a trainer resumed from the warm-up's
    checkpoint (step WARMUP) pushes its own first, marked `resume`: each server goes back to
    them, and every sample trained carries only the resumed trainer's versions."""
    before = {a: m["version"] for a, m in fleet_run["after"].items()}
    assert min(before.values()) >= WARMUP + 20
    assert sorted(fleet_run["resumed"]) == [WARMUP + 1, WARMUP + 2]
    for step, rollouts in fleet_run["resumed"].items():
        assert all(WARMUP <= min(r.versions) and max(r.versions) < step for r in rollouts)
    after = {a: m["version"] for a, m in fleet_run["after_resume"].items()}
    assert all(WARMUP <= v <= WARMUP + 2 for v in after.values()), (before, after)


# The elastic run: one server from the start, two more join after step JOIN_AT and leave
# (SIGTERM: they say Leave) after step LEAVE_AT, with the run going on.
ELASTIC_STEPS, JOIN_AT, LEAVE_AT = 12, WARMUP + 3, WARMUP + 7


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def elastic_run(warmed, tmp_path_factory):
    """rl.generation.join with no server listed: servers offer themselves (`jaxrl serve
    --join`), two join mid-run and leave again while it goes on."""
    checkpoint, token_file = warmed / "checkpoints", warmed / "token"
    door = f"127.0.0.1:{_free_port()}"
    servers = [start_server(checkpoint, token_file, join=door)]
    run_dir = rl_run_dir(checkpoint, tmp_path_factory.mktemp("elastic"))
    cfg = config(run_dir, "rl.mode=async", f"rl.generation.join={door}",
                 f"rl.generation.token_file={token_file}", "rl.generation.heartbeat_s=0.5",
                 "rl.max_lag=1000", f"rl.steps={ELASTIC_STEPS}")
    trained, lines, batch_stats = {}, [], rl_metrics.batch_stats
    ready, advanced = set(), Fleet.advanced

    def record_ready(fleet, member, version):     # the fleet makes a member ready in there
        advanced(fleet, member, version)
        ready.add(member.name)

    def record(rollouts, step):     # once per optimizer step, in the trainer's thread
        trained[step + 1] = list(rollouts)
        if step + 1 == JOIN_AT:
            servers.extend(start_server(checkpoint, token_file, join=door) for _ in range(2))
        if step + 1 == LEAVE_AT - 1:   # this step's row (read after this hook) shows all three
            deadline = time.monotonic() + 300
            while len(ready) < 3:
                assert time.monotonic() < deadline, "the servers did not join"
                time.sleep(0.2)
        if step + 1 == LEAVE_AT:
            for proc, _ in servers[1:]:
                proc.send_signal(signal.SIGTERM)
            for proc, _ in servers[1:]:
                proc.wait(120)
        return batch_stats(rollouts, step)

    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(rl_metrics, "batch_stats", record)
            mp.setattr(Fleet, "advanced", record_ready)
            job.run(cfg, log=lines.append)
    finally:
        for proc, _ in servers:
            proc.kill()
            proc.wait(60)
    ckpt = Checkpointer(run_dir / "checkpoints")
    final = ckpt.saved_data(WARMUP + ELASTIC_STEPS)
    ckpt.close()
    return {"run_dir": run_dir, "trained": trained, "lines": lines, "final": final}


def test_servers_join_and_leave_mid_run_and_nothing_is_lost_or_repeated(elastic_run):
    lines = elastic_run["lines"]
    # three joins; a member set aside under load and back says "rejoined at version", not this
    assert sum(" joined (" in line for line in lines) == 3, lines
    assert sum(" left (" in line for line in lines) == 2
    rows = {r["step"]: r for r in rl_rows(elastic_run["run_dir"])}
    assert sorted(rows) == list(range(WARMUP + 1, WARMUP + ELASTIC_STEPS + 1))
    assert rows[LEAVE_AT - 1]["members_ready"] == 3
    assert rows[WARMUP + ELASTIC_STEPS]["members_ready"] == 1
    # The work in flight follows the slots present (the actor's bound is read every turn).
    assert rows[WARMUP + 1]["slots_ready"] == 16
    assert rows[LEAVE_AT - 1]["slots_ready"] == 48
    assert rows[WARMUP + ELASTIC_STEPS]["slots_ready"] == 16
    per_group = {}
    for step, rollouts in elastic_run["trained"].items():
        for r in rollouts:
            per_group.setdefault(r.group, []).append(step)
            assert WARMUP <= min(r.versions) and max(r.versions) < step
    counts = {g: len(steps) for g, steps in per_group.items()}
    assert max(counts.values()) == 8, counts             # never a sample twice
    assert sum(c != 8 for c in counts.values()) <= 1, counts
    final = elastic_run["final"]
    assert final["stats"]["samples"] == final["trained"] + len(final["rollouts"])
    assert final["trained"] == sum(counts.values())
