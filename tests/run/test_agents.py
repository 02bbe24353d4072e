"""External agent programs as the rollout source (jaxrl/rollout/agents.py): the worker pool against
scripted agents (reports in any order, errors, crashes and restarts, timeouts, noise on stdout,
an agent that cannot run), the endpoint's records as trajectories, and `jaxrl train` with the
example `openai` agent end to end."""

import json
import re
import sys
import textwrap

import pytest

from jaxrl.rl.config import AgentConfig
from jaxrl.rollout.agents import (
    AgentFailed,
    AgentPool,
    EpisodeFailed,
    trajectory_from_record,
)
from tests.run import one_device

pytestmark = pytest.mark.slow

# Behaves as its problem's prompt says; reports out of order (a "slow" episode answers after
# the next one).
SCRIPTED = textwrap.dedent(r"""
    import json, sys, time
    held = []
    for line in sys.stdin:
        job = json.loads(line)
        what = job["problem"]["prompt"]
        if what == "crash":
            sys.stderr.write("crashing on purpose\n"); sys.stderr.flush(); sys.exit(3)
        if what == "hang":
            continue
        if what == "slow":
            held.append(job["id"]); continue
        if what == "noise":
            print("a line that is not a report", flush=True)
        if what == "err":
            print(json.dumps({"id": job["id"], "error": "boom"}), flush=True); continue
        print(json.dumps({"id": job["id"], "reward": len(what)}), flush=True)
        for key in held:
            print(json.dumps({"id": key, "reward": -1}), flush=True)
        held = []
""")


def _pool(tmp_path, command=None, warnings=None, **kw):
    script = tmp_path / "agent.py"
    script.write_text(SCRIPTED)
    cfg = AgentConfig(command=tuple(command or (sys.executable, str(script))), **kw)
    return AgentPool(cfg, {"PATH": "/usr/bin:/bin"}, tmp_path / "agents",
                     warn=(warnings.append if warnings is not None else lambda _: None))


def _episode(key, prompt):
    return {"id": key, "problem": {"prompt": prompt, "answer": ""}}


def test_reports_reach_their_episodes_in_any_order(tmp_path):
    pool = _pool(tmp_path, workers=2)
    try:
        futures = {k: pool.submit(_episode(k, p)) for k, p in
                   [("a", "slow"), ("b", "xy"), ("c", "xyz"), ("d", "w")]}
        got = {k: f.result(timeout=30) for k, f in futures.items()}
    finally:
        pool.close()
    assert {k: r["reward"] for k, r in got.items()} == {"a": -1, "b": 2, "c": 3, "d": 1}
    assert all(r["id"] == k for k, r in got.items())


def test_an_error_a_crash_and_a_timeout_lose_their_episode_only(tmp_path):
    warnings = []
    pool = _pool(tmp_path, warnings=warnings, timeout_s=1.0, restarts=2)
    try:
        assert "error" in pool.submit(_episode("e", "err")).result(timeout=30)
        with pytest.raises(EpisodeFailed, match="not reported within rl.agent.timeout_s=1.0"):
            pool.submit(_episode("h", "hang")).result(timeout=30)
        with pytest.raises(EpisodeFailed, match="agent worker 0 exited with status 3"):
            pool.submit(_episode("c", "crash")).result(timeout=30)
        # restarted: the next episode runs
        assert pool.submit(_episode("n", "noise")).result(timeout=30)["reward"] == 5
    finally:
        pool.close()
    assert any("restarting it (crashing on purpose)" in w for w in warnings), warnings
    assert any("not a report" in w for w in warnings), warnings
    assert (tmp_path / "agents" / "worker-0.log").read_text().count("crashing on purpose") == 1


def test_an_agent_that_keeps_exiting_stops_the_run_with_its_stderr(tmp_path):
    pool = _pool(tmp_path, command=[sys.executable, "-c",
                                    "import sys; sys.stderr.write('no model here\\n'); "
                                    "sys.exit(2)"], restarts=1)
    try:
        for _ in range(100):       # episodes given before it is judged are lost one by one
            with pytest.raises((EpisodeFailed, AgentFailed)) as error:
                pool.submit(_episode("x", "x")).result(timeout=30)
            if error.type is AgentFailed:
                break
    finally:
        pool.close()
    assert error.type is AgentFailed
    assert re.search(r"exited 2 time\(s\) in a row without finishing an episode \(last status "
                     r"2\)(.|\n)*no model here", str(error.value)), str(error.value)


def test_an_agent_that_cannot_start_is_one_line(tmp_path):
    with pytest.raises(AgentFailed, match=r"rl.agent.command \['/no/such/agent'\]: cannot "
                                          r"start it \(No such file or directory\)"):
        _pool(tmp_path, command=["/no/such/agent"])


def test_bad_agent_settings_are_refused_by_name():
    from jaxrl.config import ConfigError, load_run_config

    for overrides, message in [
        (["rl.agent.workers=0"], r"rl.agent.workers=0 must be >= 1"),
        (["rl.agent.timeout_s=0"], r"rl.agent.timeout_s=0.0 must be > 0"),
        (["rl.agent.command=[python, '']"], r"must be a list of non-empty strings"),
        (["rl.agent.command=[python]", "rl.generation.servers=[127.0.0.1:9]"],
         r"rl.agent .* cannot be combined with rl.generation.servers"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_run_config("configs/tool_calc_cpu.yaml", overrides)


def test_a_record_becomes_a_trajectory_of_turns():
    record = {"prompt": [1, 5], "tokens": [7, 8, 9, 10, 11, 12, 13],
              "trained": [True, True, False, False, True, False, False],
              "logprobs": [-0.5, -0.25, 0, 0, -1.0, 0, 0], "versions": [3, 3, 3, 3, 4, 4, 4]}
    t = trajectory_from_record(record, lambda ids: "".join(chr(96 + i) for i in ids))
    assert t.tokens == [7, 8, 9, 10, 11] and t.trained == [True, True, False, False, True]
    assert t.turns == ["gh", "k"] and t.versions == [3, 3, 3, 3, 4]
    assert t.model_tokens == 3 and t.env_tokens == 2 and t.finish == "done"


# The tool-calc config scaled down as in test_tool_calc.py, with no warm-up (the random model's
# episodes are as good a test of the plumbing); its episodes come from the example agent, two
# workers, in sync mode (each step's batch generated with the step's weights).
SMALL = ["model.num_layers=2", "model.embed_dim=64", "model.mlp_dim=192",
         "model.head_dim=16", "train.steps=0", "train.eval_problems=0",
         "train.stop_at_accuracy=0", "checkpoint.every=1000", "log.progress=false",
         "rl.steps=2", "rl.mode=sync", "rl.prompts_per_step=4", "rl.group_size=4",
         "rl.engine.max_concurrent_decodes=16", "rl.microbatch_rows=8",
         "rl.filter_zero_advantage=false",
         "rl.filter_overlong=false", "rl.eval_every=0",
         f"rl.agent.command=[{sys.executable}, {one_device.ROOT}/examples/tool_calc_agent.py, "
         f"--worker, --concurrency, '4']", "rl.agent.workers=2"]


def test_train_runs_its_episodes_through_the_example_openai_agent(tmp_path):
    run_dir = tmp_path / "run"
    one_device.train("configs/tool_calc_cpu.yaml", SMALL, run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r.get("phase") == "rl" and "loss" in r]
    assert [r["step"] for r in rl] == [1, 2]
    assert all(r["trained_tokens"] > 0 for r in rl)
    assert sum(r["episodes"] for r in rl) == 2 * 16 and rl[-1]["dropped_agent"] == 0
    assert rl[-1]["samples_trained"] == 2 * 16          # sync: every episode trained, once
    assert all(1 <= r["turns_per_episode"] <= 4 for r in rl)
    assert all(r["env_tokens_per_model_token"] > 0 for r in rl)   # the agent's observations
    assert sorted(p.name for p in (run_dir / "agents").iterdir()) == ["worker-0.log",
                                                                     "worker-1.log"]


def test_episodes_beyond_what_the_workers_hold_wait_their_turn(tmp_path):
    """One worker holding 2 episodes at a time runs 6, each given when one is reported."""
    pool = _pool(tmp_path, workers=1, episodes_per_worker=2)
    try:
        futures = [pool.submit(_episode(f"k{i}", "ab")) for i in range(6)]
        assert len(pool._workers[0].in_flight) <= 2
        assert [f.result(timeout=30)["id"] for f in futures] == [f"k{i}" for i in range(6)]
    finally:
        pool.close()
