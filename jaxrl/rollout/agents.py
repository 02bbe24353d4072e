"""External agent programs as the rollout source (SeamlessFlow's data plane): the trainer runs
any program written against an OpenAI client, and trains on exactly the tokens it made the
model produce.

The run serves its own engine through the OpenAI-compatible endpoint
(serving/frontends/openai_api.py) on 127.0.0.1 and starts `rl.agent.workers` processes of
`rl.agent.command`, each with `OPENAI_BASE_URL` and `OPENAI_API_KEY` set, so `openai.OpenAI()` finds
it unconfigured. The protocol is JSON lines:

- on the agent's stdin, one line per episode to run:
  `{"id": ..., "problem": {"prompt": ..., "answer": ...}, "temperature": ..., "max_tokens": ...,
  "max_turns": ...}`; stdin closing means: finish up and exit;
- the agent runs the episode, naming `id` as the trajectory of every request (the
  `X-Trajectory-Id` header, or `trajectory_id` in the body: `extra_body` in the `openai` package)
  and sampling at `temperature` (the trained policy; other sampling is refused with HTTP 400), and
  writes one line on its stdout: `{"id": ..., "reward": r}` (or `"rewards": [per turn]`, summed),
  optionally with `"finish"` (`done`, the default: the environment ended it; `turns` or `length`: a
  limit cut it, as the built-in environments say; `rl.filter_overlong` drops `length`),
  `"tool_calls"` and `"tool_errors"`; or `{"id": ..., "error": "..."}`.

A request may not take an episode past `rl.max_prompt_len` plus its episode budget (the
trainer's sample length): it gets HTTP 400, and the agent ends the episode there (`length`).

Several episodes may be in flight on one worker (`rl.agent.episodes_per_worker`), reported in
any order. stdout is the protocol's channel: an agent logs to stderr, which goes to
`<run_dir>/agents/worker-<n>.log`.

Each reported episode becomes the trajectory the endpoint recorded under its id: the model's
tokens with the engine's log-probs and weights versions (trained), everything else (prompts,
tool results, template markup) untrained. Failures cost the episode, never the run: an error
report, an episode not reported within `rl.agent.timeout_s`, a worker that exits (it is
restarted), a reward that is not a number, an id no request named; each is counted
(`dropped_agent`). A worker that exits `rl.agent.restarts + 1` times in a row without finishing
an episode ends the run with its command, exit status and the end of its stderr.

Across a restart, an agent's unfinished episodes are run again from their start: the agent's
own state is not the trainer's to keep (the built-in environments continue theirs).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import math
import os
from pathlib import Path
from typing import Callable

from jaxrl.rl.config import RLConfig
from jaxrl.rl.env import Trajectory
from jaxrl.rl.tasks.base import Problem
from jaxrl.rollout.agent_pool import (  # noqa: F401 (the agent protocol's errors, re-exported)
    AgentFailed,
    AgentPool,
    EpisodeFailed,
    Shutdown,
    _settle,
)

_groups = itertools.count()


class AgentGroup:
    """A group of one problem's episodes run by the agents; to the actor, what an EpisodeGroup
    is (`run`, `snapshot`, `cancel`)."""

    def __init__(self, agents: "Agents", problem: Problem, cfg: RLConfig, *, index: int,
                 seed: int):
        self.agents, self.problem, self.cfg = agents, problem, cfg
        base = f"agent-{seed}-{index}-{next(_groups)}"
        self.keys = [f"{base}-{i}" for i in range(cfg.group_size)]
        self.failures: list[str] = []     # why each lost episode was lost
        self._futures: list[concurrent.futures.Future] = []

    def run(self) -> list[Trajectory] | None:
        """Every episode the agents reported, as trajectories (lost ones counted in
        `failures`); None if the agents shut down first (the group stays in flight)."""
        line = {"problem": dataclasses.asdict(self.problem),
                "temperature": self.cfg.temperature, "max_tokens": self.cfg.max_new_tokens,
                "max_turns": self.cfg.max_turns}
        self._futures = [self.agents.pool.submit({"id": key, **line}) for key in self.keys]
        out, cut = [], False
        for key, future in zip(self.keys, self._futures):
            try:
                report = future.result()
                out.append(self._trajectory(key, report))
            except Shutdown:
                cut = True
            except EpisodeFailed as e:
                self.failures.append(str(e))
                self.agents.lost(str(e))
            finally:
                self.agents.end(key)
        return None if cut else out

    def _trajectory(self, key: str, report: dict) -> Trajectory:
        if "error" in report:
            raise EpisodeFailed(f"the agent reported an error: {str(report['error'])[:200]}")
        rewards = report.get("rewards", [report.get("reward")])
        if not isinstance(rewards, list) or not rewards or not all(
                isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r)
                for r in rewards):
            raise EpisodeFailed(f"episode {key}: reward {report.get('reward')!r} / rewards "
                                f"{report.get('rewards')!r}: finite numbers are required")
        record = self.agents.app.trajectories.get(key)
        if record is None or not any(record["trained"]):
            raise EpisodeFailed(f"episode {key} was reported, but no request named it as its "
                                f"trajectory (the X-Trajectory-Id header or the trajectory_id field)")
        t = trajectory_from_record(record, self.agents.app.tokenizer.decode)
        if len(t.history) > self.cfg.sample_len:
            raise EpisodeFailed(f"episode {key} holds {len(t.history)} tokens, more than "
                                f"{self.cfg.sample_len_names} = {self.cfg.sample_len}")
        finish = report.get("finish", "done")
        if finish not in ("done", "turns", "length"):
            raise EpisodeFailed(f"episode {key}: finish {finish!r} is not one of done, turns, "
                                f"length")
        t.finish = finish
        t.rewards = [float(r) for r in rewards]
        t.tool_calls = _count(report, "tool_calls")
        t.tool_errors = _count(report, "tool_errors")
        return t

    def snapshot(self) -> dict:
        """Nothing to carry: an agent's unfinished episodes start again after a restart."""
        return {"trajectories": [], "turns": []}

    def cancel(self) -> None:
        for future in self._futures:
            _settle(future, error=Shutdown("cancelled"))


def _count(report: dict, name: str) -> int:
    value = report.get(name, 0)
    return value if isinstance(value, int) and value >= 0 else 0


def trajectory_from_record(record: dict, decode) -> Trajectory:
    """The endpoint's record of an episode (serving/frontends/trajectories.py) as a Trajectory: the
    environment's tokens after the model's last turn are dropped (nothing learns from them);
    each run of model tokens is one turn."""
    trained = list(record["trained"])
    end = max(i for i, t in enumerate(trained) if t) + 1
    t = Trajectory(prompt=list(record["prompt"]), tokens=list(record["tokens"][:end]),
                   logprobs=[float(x) for x in record["logprobs"][:end]],
                   versions=[int(v) for v in record["versions"][:end]],
                   trained=trained[:end], finish="done")
    turn: list[int] = []
    for token, is_model in zip(t.tokens + [None], t.trained + [False]):
        if is_model:
            turn.append(token)
        elif turn:
            t.turns.append(decode(turn))
            turn = []
    return t


class Agents:
    """The endpoint the agents talk to and their processes, for one RL run."""

    def __init__(self, cfg: RLConfig, orchestrator, tokenizer, model_name: str,
                 run_dir: Path, warn: Callable[[str], None] = print):
        from serving.frontends.openai_api import OpenAIApp, start_http

        self.warn, self._lost = warn, 0
        self.app = OpenAIApp(orchestrator, tokenizer, model_name, cfg.sample_len,
                             trained_temperature=cfg.temperature)
        self.server, port = start_http(self.app.app, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{port}/v1"
        env = {**os.environ, "OPENAI_BASE_URL": self.url, "OPENAI_API_KEY": "jaxrl",
               "PYTHONUNBUFFERED": "1"}
        try:
            self.pool = AgentPool(cfg.agent, env, run_dir / "agents", warn)
        except BaseException:
            self.server.should_exit = True
            raise

    def group(self, problem: Problem, cfg: RLConfig, *, index: int, seed: int) -> AgentGroup:
        return AgentGroup(self, problem, cfg, index=index, seed=seed)

    def lost(self, why: str) -> None:
        """Says why an episode was lost: the first ten, then every hundredth."""
        self._lost += 1
        if self._lost <= 10 or self._lost % 100 == 0:
            self.warn(f"agents: episode lost ({self._lost} so far): {why}")

    def end(self, key: str) -> None:
        """Forgets an episode's trajectory and frees its KV pages."""
        self.app.trajectories.end(key)
        self.app.generation.end_session(key)

    def close(self) -> None:
        self.pool.close()
        self.server.should_exit = True
