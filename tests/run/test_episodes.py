"""The trajectory manager (jaxrl/rollout/episodes.py) on the paged engine with a random model and
the calculator task's environment: each later turn prefills only its new tokens and equals a fresh
decode of the whole history; an episode group cut mid-turn (checkpoint) or updated mid-episode
continues with the same tokens."""

import itertools
import threading
import time

import numpy as np
import pytest
from flax import nnx

from jaxrl.models import Transformer, split_params
from jaxrl.models.tokenizer import CharTokenizer
from jaxrl.rl.config import RLConfig
from jaxrl.rl.tasks.base import Problem
from jaxrl.rl.tasks.toolcalc import ToolCalcTask
from jaxrl.rollout.episodes import EpisodeGroup
from jaxrl.rollout.group import Group
from serving.core.orchestrator import Orchestrator
from serving.runner.engine import Engine
from serving.runner.engine_config import EngineConfig
from serving.runner.sampling import SamplingParams
from tests.serving.common import CFG, ENGINE

pytestmark = pytest.mark.slow

TASK = ToolCalcTask()
TOKENIZER = CharTokenizer(TASK.alphabet)
RL = RLConfig(group_size=3, max_prompt_len=10, max_new_tokens=6, max_turns=3,
              max_episode_tokens=28, engine=EngineConfig(max_concurrent_decodes=4), pack_len=64)
PROBLEM = Problem("37*45+12=", TASK._worked((37, 45, 12)))
PROMPT = [TOKENIZER.bos_id] + TOKENIZER.encode(PROBLEM.prompt)


@pytest.fixture(scope="module")
def params():
    return split_params(Transformer(CFG, rngs=nnx.Rngs(3)))[1]


@pytest.fixture(scope="module")
def engine(params):
    return Engine(CFG, ENGINE)


def _group(o, state=None, temperature=0.0):
    return EpisodeGroup(o, TASK, TOKENIZER, Group(0, PROBLEM, PROMPT, seed=5), RL, state=state,
                        temperature=temperature)


def _fresh_turns(o, t):
    """Each model turn of episode `t` decoded again from its whole history, in a request of its
    own (no session, no kept pages): (tokens, log-probs) fresh and as recorded, per turn."""
    stop = tuple(TOKENIZER.encode(";"))
    out, at = [], 0
    for trained, run in itertools.groupby(t.trained):
        end = at + len(list(run))
        if trained:
            budget = min(RL.max_new_tokens, RL.episode_tokens - at)
            [s] = o.submit(PROMPT + t.tokens[:at], SamplingParams(
                temperature=0.0, max_tokens=budget, stop_token_ids=stop)).result()
            out.append((s.tokens, s.logprobs, t.tokens[at:end], t.logprobs[at:end]))
        at = end
    return out


def test_turns_continue_from_kept_pages_and_equal_a_fresh_decode(engine, params):
    with Orchestrator(engine, params, eos_id=TOKENIZER.eos_id) as o:
        [t] = _group(o).run()
        metrics = o.metrics()
        o.generate(PROMPT, SamplingParams(max_tokens=1))     # the loop has ended the session
        assert o.metrics()["sessions_kept"] == 0
        assert o.scheduler.pool.free == o.scheduler.pool.capacity
        for got, got_lp, want, want_lp in _fresh_turns(o, t):
            assert got == want
            np.testing.assert_allclose(got_lp, want_lp, atol=1e-5)
    assert len(t.turns) >= 2 and t.finish in ("done", "turns", "length")
    observations = len(t.tokens) - t.model_tokens
    # the prompt once, then per later turn: the last answer's final token and the observation
    assert metrics["prefill_tokens"] == len(PROMPT) + (len(t.turns) - 1) + observations
    assert metrics["prefix_reused_tokens"] > 0
    assert all(t.logprobs[i] == 0.0 for i in range(len(t.tokens)) if not t.trained[i])


def test_a_group_cut_mid_turn_continues_exactly(engine, params):
    """A group of three sampled episodes, snapshotted while its second turn is being generated
    and the engine stopped (a checkpoint, then a crash), continues on a new engine to exactly
    the episodes of an uninterrupted run, generating only what was missing."""
    with Orchestrator(engine, params, eos_id=TOKENIZER.eos_id) as o:
        whole = _group(o, temperature=None).run()
    with Orchestrator(engine, params, eos_id=TOKENIZER.eos_id) as o:
        group = _group(o, temperature=None)
        out = {}
        runner = threading.Thread(target=lambda: out.update(result=group.run()))
        runner.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            state = group.snapshot()
            if any(len(t["turns"]) >= 1 for t in state["trajectories"]) and any(state["turns"]):
                o.pause()
                state = group.snapshot()
                break
            time.sleep(0.001)
    runner.join(30)
    assert out["result"] is None                       # cut: stays in flight
    assert any(len(t["turns"]) >= 1 for t in state["trajectories"])
    with Orchestrator(engine, params, eos_id=TOKENIZER.eos_id) as o:
        resumed = _group(o, state=state, temperature=None).run()
        generated = o.metrics()["generated_tokens"]
    for a, b in zip(resumed, whole):
        assert (a.tokens, a.trained, a.turns, a.rewards, a.finish) == \
            (b.tokens, b.trained, b.turns, b.rewards, b.finish)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    carried = sum(sum(t["trained"]) for t in state["trajectories"]) + sum(
        len(s["tokens"]) for s in state["turns"] if s)
    assert generated == sum(t.model_tokens for t in whole) - carried


class _HeldAfterItsFirstTurn(ToolCalcTask):
    """The tool-calculator task whose environment answers the first turn only once `updated`
    is set: the episode's later turns are generated after whatever the test does meanwhile."""

    def __init__(self, updated: threading.Event):
        super().__init__()
        self.updated, self.answering = updated, threading.Event()

    def reply(self, problem, turns):
        self.answering.set()
        assert self.updated.wait(60), "the test never let the episode go on"
        return super().reply(problem, turns)


def test_weight_update_mid_episode(engine, params):
    """The same weights pushed as version 1 between the episode's first turn and its second:
    the same episode, its first turn's tokens tagged with version 0, every later one with 1."""
    updated = threading.Event()
    task = _HeldAfterItsFirstTurn(updated)
    with Orchestrator(engine, params, eos_id=TOKENIZER.eos_id) as o:
        [plain] = _group(o).run()
        group = EpisodeGroup(o, task, TOKENIZER, Group(0, PROBLEM, PROMPT, seed=5), RL,
                             temperature=0.0)
        out = {}
        runner = threading.Thread(target=lambda: out.update(result=group.run()))
        runner.start()
        assert task.answering.wait(60)
        o.update_params(params, 1)          # returns once the engine serves version 1
        updated.set()
        runner.join(60)
    [t] = out["result"]
    assert t.tokens == plain.tokens and len(t.turns) > 1
    versions = [v for v, trained in zip(t.versions, t.trained) if trained]
    assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions), versions


def test_the_example_openai_agent_runs_episodes_through_the_endpoint(engine, params):
    """examples/tool_calc_agent.py, unchanged, against the HTTP endpoint: every episode's
    trajectory comes back (and is ended) with the model's tokens marked and their versions;
    greedy, the same episode twice."""
    import importlib.util

    import httpx
    import openai

    from serving.frontends.openai_api import OpenAIApp, start_http

    spec = importlib.util.spec_from_file_location("agent", "examples/tool_calc_agent.py")
    agent = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(agent)
    assert agent.calculator("37*45+12") == "1677" and agent.calculator("2**99") == "?"
    with Orchestrator(engine, params, eos_id=TOKENIZER.eos_id) as o:
        app = OpenAIApp(o, TOKENIZER, "jaxrl", ENGINE.max_len)
        server, port = start_http(app.app, "127.0.0.1", 0)
        try:
            url = f"http://127.0.0.1:{port}/v1"
            client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
            results, records = [], []
            for i in range(2):
                results.append(agent.episode(client, "37*45+12=", f"ex-{i}", max_turns=3))
                records.append(httpx.delete(f"{url}/trajectories/ex-{i}").json())
            assert httpx.get(f"{url}/trajectories/ex-0").status_code == 404      # ended
        finally:
            server.should_exit = True
    assert results[0] == results[1]                      # greedy: the same episode
    assert records[0]["tokens"] == records[1]["tokens"]
    e, record = results[0], records[0]
    assert e["transcript"].startswith("37*45+12=") and sum(record["trained"]) > 0
    # the text prompt begins with BOS, as the trainer's prompts do
    assert record["prompt"] == [TOKENIZER.bos_id] + TOKENIZER.encode("37*45+12=")
    assert e["transcript"].startswith(TOKENIZER.decode(record["prompt"] + record["tokens"]))
    assert set(record["versions"]) == {o.version} == {0}    # no update: its first weights


def test_agents_episodes_carry_the_trained_policys_tokens_and_logprobs(engine, params, tmp_path):
    """A group run by the example agent in worker mode (jaxrl/rollout/agents.py) at temperature 1:
    each trajectory's model tokens carry the log-probs a plain forward pass of the served
    weights gives them at that temperature; everything else is the agent's own text (its
    tool results), untrained; a request at another temperature is refused."""
    import dataclasses
    import re
    import sys

    import httpx
    import jax

    from jaxrl.models import merge_params
    from jaxrl.rl.config import AgentConfig
    from jaxrl.rollout.agents import Agents

    cfg = dataclasses.replace(RL, temperature=1.0, agent=AgentConfig(
        command=(sys.executable, "examples/tool_calc_agent.py", "--worker")))
    with Orchestrator(engine, params, eos_id=TOKENIZER.eos_id) as o:
        agents = Agents(cfg, o, TOKENIZER, "jaxrl", tmp_path, warn=print)
        try:
            group = agents.group(PROBLEM, cfg, index=0, seed=1)
            trajectories = group.run()
            refused = httpx.post(f"{agents.url}/completions", json={
                "prompt": "1+1=", "max_tokens": 2, "temperature": 0.5,
                "trajectory_id": "other"})
        finally:
            agents.close()
    assert refused.status_code == 400 and "temperature=1.0" in refused.text
    assert len(trajectories) == cfg.group_size and not group.failures
    model = merge_params(engine.graphdef, params)
    for t in trajectories:
        assert t.prompt == PROMPT and 1 <= len(t.turns) <= cfg.max_turns
        assert len(t.history) <= cfg.sample_len and t.rewards == [0.0]   # a random model
        logp = jax.nn.log_softmax(np.asarray(model(np.asarray([t.history[:-1]])))[0], -1)
        at = [len(PROMPT) + i for i, trained in enumerate(t.trained) if trained]
        np.testing.assert_allclose([t.logprobs[i - len(PROMPT)] for i in at],
                                   [logp[i - 1, t.history[i]] for i in at], atol=1e-4)
        env = [TOKENIZER.decode(t.tokens[i] for i in range(len(t.tokens)) if not t.trained[i])]
        assert all(re.fullmatch(r"(;?=[-0-9?]*;)*", text) for text in env), env
