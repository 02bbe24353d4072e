"""rl.generation.launch: `jaxrl train` starts its own `jaxrl serve` process, pinned to the cores
of rl.generation.cpus, pins itself to the others before JAX starts, trains on what the server
generates, and stops the server with the run. The core plan's bad inputs are refused by name."""

import os
import re
import subprocess
import sys

import jax
import pytest

from jaxrl.config import load_run_config
from jaxrl.errors import UserError
from jaxrl.models import ModelConfig, abstract_model, lora, split_params
from jaxrl.rollout.local_servers import LocalServers, parse_cpus, plan
from jaxrl.telemetry.metrics import read_metrics
from serving.runner.engine import EngineConfig
from tests.run.test_rl import BASE, WARMUP

pytestmark = pytest.mark.slow


def test_core_plans():
    assert parse_cpus("0,2-3, 5") == [0, 2, 3, 5]
    p = plan(2, "2-5", available=list(range(8)))
    assert p.servers == [[2, 3], [4, 5]] and p.trainer == [0, 1, 6, 7]
    assert plan(1, "", available=[0, 1]).trainer == []          # nothing pinned
    for launch, cpus, error in [(1, "1-x", "'1-x' is not a core"), (1, "3-1", "'3-1'"),
                                (1, "0-2", "takes every core"), (1, "5", r"\[5\] are not"),
                                (3, "1", "has 1 core\\(s\\) for rl.generation.launch=3")]:
        with pytest.raises(UserError, match=error):
            plan(launch, cpus, available=[0, 1, 2])


def test_a_server_that_cannot_start_fails_the_wait_with_its_log(tmp_path):
    servers = LocalServers(tmp_path, EngineConfig(), ModelConfig(), [[4096]], tmp_path,
                           log=lambda _: None)
    try:
        with pytest.raises(UserError, match=r"(?s)exited with status 2; the end of its log .*"
                                            r"--cpus: cannot run on cores \[4096\]"):
            servers.wait_ready(120)
    finally:
        servers.close()
    assert servers.exit_codes() == [2]


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to split")
@pytest.mark.parametrize("mode, weights", [("sync", "int8"), ("partial", "model")])
def test_train_launches_a_pinned_server_and_trains_on_it(tmp_path, mode, weights):
    """Partial rollouts pause the server for each step (its Pause call): it generates nothing
    between the pause and the resume, each logged with the server's token count. A run with
    int8 rollouts launches its server holding int8 projections."""
    cores = sorted(os.sched_getaffinity(0))
    overrides = [o for o in BASE if not o.startswith("rl.steps=")] + [
        f"run_dir={tmp_path}", "rl.steps=4", f"rl.mode={mode}", "rl.generation.launch=1",
        f"rl.generation.cpus={cores[-1]}", f"rl.generation.weights={weights}"]
    done = subprocess.run([sys.executable, "-m", "jaxrl.cli", "train", *overrides],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"trainer pinned to cores {cores[:-1]}" in done.stdout
    server_log = (tmp_path / "launched_server_0.log").read_text()
    assert re.search(rf"ready on 127\.0\.0\.1:\d+: .*CPU cores \[{cores[-1]}\]", server_log)
    assert "shutting down" in server_log                      # stopped with the run
    assert ("its layer projections int8" in server_log) == (weights == "int8")
    rows = [r for r in read_metrics(tmp_path) if "reward" in r]
    assert [r["step"] for r in rows] == list(range(WARMUP + 1, WARMUP + 5))
    assert [r["samples_trained"] for r in rows] == [16 * 8 * k for k in range(1, 5)]
    assert all(r["members_ready"] == 1 for r in rows)
    # It served every version, pulled over tcp (rl.generation.transfer=auto, on this host).
    assert f"weights version {WARMUP + 3} pulled" in server_log
    paused = [int(n) for n in re.findall(r"paused \(lease 600 s\) at (\d+) tokens", server_log)]
    resumed = [int(n) for n in re.findall(r"resumed at (\d+) tokens", server_log)]
    if mode == "sync":
        assert paused == resumed == []
    else:                   # every step, and nothing generated in between
        assert len(paused) == 4 and paused == resumed and paused[0] > 0, (paused, resumed)


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to split")
def test_a_lora_run_pushes_its_launched_server_the_adapters_alone(tmp_path):
    """model.lora with a launched server: the server holds adapters (--lora-rank ...), takes
    every weight in the run's first push and the adapters alone in every later one, and
    samples from the trainer's adapters (its log-probs are the trainer's)."""
    cores = sorted(os.sched_getaffinity(0))
    overrides = [o for o in BASE if not o.startswith(("rl.steps=", "train.steps="))] + [
        f"run_dir={tmp_path}", "train.steps=4", "rl.steps=3", "rl.mode=sync",
        "rl.generation.launch=1", f"rl.generation.cpus={cores[-1]}",
        "model.lora.rank=4", "model.lora.alpha=8", "model.lora.targets=q_proj,v_proj,up_proj"]
    done = subprocess.run([sys.executable, "-m", "jaxrl.cli", "train", *overrides],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    server_log = (tmp_path / "launched_server_0.log").read_text()
    assert "holding LoRA adapters of rank 4 on q_proj,v_proj,up_proj" in server_log
    updates = re.findall(r"weights version (\d+) pulled( \(LoRA adapters alone\))?",
                         server_log)        # over tcp: rl.generation.transfer=auto
    assert [bool(alone) for _, alone in updates] == [False] + [True] * (len(updates) - 1)
    assert len(updates) >= 3, updates
    cfg = load_run_config(None, overrides)
    _, abstract = split_params(abstract_model(cfg.model))
    everything = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(abstract))
    adapters = sum(a.size * 4 for a in jax.tree.leaves(lora.trainable(abstract)))
    rows = [r for r in read_metrics(tmp_path) if "reward" in r]
    for r in rows:      # the first push every weight, each later one the adapters alone
        assert r["push_bytes"] == everything + (r["pushes"] - 1) * adapters, r
    assert rows[-1]["pushes"] >= 2
    for r in rows[1:]:  # sampled by weights the trainer had pushed its adapters alone for
        assert 0 < r["logprob_parity_tokens"] and r["logprob_abs_diff_max"] < 1e-4, r


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to split")
def test_a_multiplexed_trainer_generates_beside_its_launched_server_while_it_waits(tmp_path):
    """rl.multiplex with a launched server, sync: every step's groups are placed while the
    trainer waits, on the server and on the trainer's own engine (each step's rows say what
    share the trainer's devices generated), and the samples its engine drew carry the
    trainer's log-probs as the server's do."""
    cores = sorted(os.sched_getaffinity(0))
    overrides = [o for o in BASE if not o.startswith("rl.steps=")] + [
        f"run_dir={tmp_path}", "rl.steps=3", "rl.mode=sync", "rl.generation.launch=1",
        f"rl.generation.cpus={cores[-1]}", "rl.multiplex=true"]
    done = subprocess.run([sys.executable, "-m", "jaxrl.cli", "train", *overrides],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "multiplexing: the trainer's 1 device(s) generate while it waits" in done.stdout
    rows = [r for r in read_metrics(tmp_path) if "reward" in r]
    assert [r["samples_trained"] for r in rows] == [16 * 8 * k for k in range(1, 4)]
    for r in rows:
        assert 0.2 < r["trainer_generated_share"] < 0.8, r
        assert r["groups_withdrawn"] == 0           # sync: a batch is ready when all are done
        assert 0 < r["logprob_parity_tokens"] and r["logprob_abs_diff_max"] < 1e-4, r


def test_a_launch_refuses_engine_settings_jaxrl_serve_cannot_take():
    from jaxrl.config import ConfigError
    from jaxrl.trainer.rl import check_config

    cfg = load_run_config(None, ["rl.generation.launch=1", "rl.engine.steps_per_dispatch=2",
                                 "rl.engine.page_buckets=2"])
    with pytest.raises(ConfigError, match=r"no flag for rl.engine.steps_per_dispatch=2, "
                                          r"rl.engine.page_buckets=2"):
        check_config(cfg)
    check_config(load_run_config(None, ["rl.generation.launch=1", "rl.engine.num_pages=64",
                                        "rl.engine.score=true"]))


def test_multiplexing_needs_generation_off_the_trainers_devices():
    from jaxrl.config import ConfigError
    from jaxrl.trainer.rl import check_config

    with pytest.raises(ConfigError, match=r"rl.multiplex=true .* with rl.placement=colocated "
                                          r"they generate already"):
        check_config(load_run_config(None, ["rl.multiplex=true"]))
    check_config(load_run_config(None, ["rl.multiplex=true", "rl.generation.launch=1"]))
