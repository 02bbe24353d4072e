"""External agent programs as the rollout source (SeamlessFlow's data plane): the trainer runs
any program written against an OpenAI client, and trains on exactly the tokens it made the
model produce.

The run serves its own engine through the OpenAI-compatible endpoint (serving/openai_api.py)
on 127.0.0.1 and starts `rl.agent.workers` processes of `rl.agent.command`, each with
`OPENAI_BASE_URL` and `OPENAI_API_KEY` set, so `openai.OpenAI()` finds it unconfigured. The
protocol is JSON lines:

- on the agent's stdin, one line per episode to run:
  `{"id": ..., "problem": {"prompt": ..., "answer": ...}, "temperature": ..., "max_tokens": ...,
  "max_turns": ...}`; stdin closing means: finish up and exit;
- the agent runs the episode, naming `id` as the trajectory of every request (the `user` field
  or the `X-Trajectory-Id` header) and sampling at `temperature` (the trained policy; other
  sampling is refused with HTTP 400), and writes one line on its stdout:
  `{"id": ..., "reward": r}` (or `"rewards": [per turn]`, summed), optionally with
  `"finish"` (`done`, the default: the environment ended it; `turns` or `length`: a limit cut
  it, as the built-in environments say; `rl.filter_overlong` drops `length`), `"tool_calls"`
  and `"tool_errors"`; or `{"id": ..., "error": "..."}`.

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

import collections
import concurrent.futures
import dataclasses
import itertools
import json
import math
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable

from jaxrl.errors import UserError
from jaxrl.rl.config import AgentConfig, RLConfig
from jaxrl.rl.env import Trajectory
from jaxrl.rl.tasks.base import Problem


class AgentFailed(UserError):
    """The agent program cannot run episodes: the run stops."""


class EpisodeFailed(Exception):
    """One episode is lost (reported error, timeout, worker exit, bad report)."""


class Shutdown(Exception):
    """The pool closed before the episode was reported."""


@dataclasses.dataclass
class _Worker:
    index: int
    process: subprocess.Popen
    log_path: Path
    in_flight: dict = dataclasses.field(default_factory=dict)   # id -> (future, deadline)
    exits_in_a_row: int = 0
    write_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


class AgentPool:
    """The worker processes, and the episodes given to them."""

    def __init__(self, cfg: AgentConfig, env: dict[str, str], log_dir: Path,
                 warn: Callable[[str], None] = print):
        self.cfg, self.env, self.log_dir, self.warn = cfg, env, log_dir, warn
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._pending: collections.deque = collections.deque()   # (episode, future)
        self._closed = False
        self.error: AgentFailed | None = None
        self._workers = [self._spawn(i) for i in range(cfg.workers)]
        for w in self._workers:
            self._read(w)
        self._watchdog = threading.Thread(target=self._watch, name="agent-timeouts",
                                          daemon=True)
        self._watchdog.start()

    # -- workers -------------------------------------------------------------------------------
    def _spawn(self, index: int, exits: int = 0) -> _Worker:
        path = self.log_dir / f"worker-{index}.log"
        try:
            with open(path, "ab") as stderr:
                process = subprocess.Popen(
                    list(self.cfg.command), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                    stderr=stderr, env=self.env, text=True, bufsize=1)
        except OSError as e:
            raise AgentFailed(f"rl.agent.command {list(self.cfg.command)}: cannot start it "
                              f"({e.strerror or e})") from None
        return _Worker(index, process, path, exits_in_a_row=exits)

    def _read(self, w: _Worker) -> None:
        threading.Thread(target=self._reader, args=(w,), name=f"agent-{w.index}",
                         daemon=True).start()

    def _reader(self, w: _Worker) -> None:
        """Hands each report to its episode; when the worker exits, fails what it held and
        starts another in its place."""
        complained = False
        for line in w.process.stdout:
            line = line.strip()
            if not line:
                continue
            try:
                report = json.loads(line)
                key = report["id"]
            except (ValueError, KeyError, TypeError):
                if not complained:
                    self.warn(f"agent worker {w.index} wrote a line that is not a report "
                              f"({line[:80]!r}); stdout is the protocol's channel: log to "
                              f"stderr")
                    complained = True
                continue
            with self._lock:
                held = w.in_flight.pop(key, None)
                if held is not None and "error" not in report:
                    w.exits_in_a_row = 0
            if held is not None:
                _settle(held[0], result=report)
            self._dispatch()
        status = w.process.wait()
        with self._lock:
            lost, w.in_flight = list(w.in_flight.values()), {}
            closing = self._closed
        why = f"agent worker {w.index} exited with status {status}"
        for future, _ in lost:
            _settle(future, error=Shutdown(why) if closing else EpisodeFailed(why))
        if closing:
            return
        if w.exits_in_a_row + 1 > self.cfg.restarts:
            self._fail(AgentFailed(
                f"rl.agent.command {list(self.cfg.command)} exited {w.exits_in_a_row + 1} "
                f"time(s) in a row without finishing an episode (last status {status}); the "
                f"end of its stderr ({w.log_path}):\n{_tail(w.log_path)}"))
            return
        self.warn(f"{why}; restarting it ({_tail(w.log_path, 1)})")
        try:
            replacement = self._spawn(w.index, w.exits_in_a_row + 1)
        except AgentFailed as e:
            self._fail(e)
            return
        with self._lock:
            self._workers[w.index] = replacement
        self._read(replacement)
        self._dispatch()

    def _fail(self, error: AgentFailed) -> None:
        with self._lock:
            self.error = error
            pending, self._pending = list(self._pending), collections.deque()
        for _, future in pending:
            _settle(future, error=error)

    def _watch(self) -> None:
        while not self._closed:
            time.sleep(0.25)
            now = time.monotonic()
            late = []
            with self._lock:
                for w in self._workers:
                    for key, (future, deadline) in list(w.in_flight.items()):
                        if now > deadline:
                            del w.in_flight[key]
                            late.append(future)
            for future in late:
                _settle(future, error=EpisodeFailed(
                    f"not reported within rl.agent.timeout_s={self.cfg.timeout_s}"))
            if late:
                self._dispatch()

    # -- episodes ------------------------------------------------------------------------------
    def submit(self, episode: dict) -> concurrent.futures.Future:
        """Runs `episode` (a protocol line, as a dict) on the least busy worker; the future
        holds the agent's report."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self.error is not None:
                future.set_exception(self.error)
                return future
            if self._closed:
                future.set_exception(Shutdown("the agents are shut down"))
                return future
            self._pending.append((episode, future))
        self._dispatch()
        return future

    def _dispatch(self) -> None:
        """Gives waiting episodes to workers with room. A line is written outside the pool's
        lock (the worker's own lock keeps lines whole), so a worker slow to read its stdin
        holds up no other."""
        while True:
            with self._lock:
                if not self._pending or self._closed:
                    return
                room = [w for w in self._workers if w.process.poll() is None
                        and len(w.in_flight) < self.cfg.episodes_per_worker]
                if not room:
                    return
                w = min(room, key=lambda w: len(w.in_flight))
                episode, future = self._pending.popleft()
                w.in_flight[episode["id"]] = (future, time.monotonic() + self.cfg.timeout_s)
            try:
                with w.write_lock:
                    w.process.stdin.write(json.dumps(episode) + "\n")
                    w.process.stdin.flush()
            except (OSError, ValueError):    # it is exiting: its reader restarts it
                with self._lock:
                    if w.in_flight.pop(episode["id"], None) is not None:
                        self._pending.appendleft((episode, future))
                return

    def close(self) -> None:
        """Closes every worker's stdin (exit), then terminates what is still running."""
        with self._lock:
            self._closed = True
            pending, self._pending = list(self._pending), collections.deque()
            workers = list(self._workers)
        for _, future in pending:
            _settle(future, error=Shutdown("the agents are shut down"))
        for w in workers:
            try:
                w.process.stdin.close()
            except OSError:
                pass
        deadline = time.monotonic() + 5
        for w in workers:
            try:
                w.process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                w.process.kill()
                w.process.wait()


def _settle(future: concurrent.futures.Future, result=None, error=None) -> None:
    if not future.done():
        future.set_exception(error) if error is not None else future.set_result(result)


def _tail(path: Path, lines: int = 20) -> str:
    try:
        text = path.read_bytes()[-4000:].decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.strip().splitlines()[-lines:])


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
                                f"trajectory (the `user` field or X-Trajectory-Id)")
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
    """The endpoint's record of an episode (serving/trajectories.py) as a Trajectory: the
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
        from serving.openai_api import OpenAIApp, start_http

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
