"""The agent processes: `rl.agent.workers` copies of `rl.agent.command`, fed one JSON line per
episode on stdin and read one JSON line per report on stdout (the protocol: jaxrl/rollout/
agents.py). A worker that exits is restarted; one that keeps exiting without finishing an
episode ends the run, naming its command, exit status and the end of its stderr."""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable

from jaxrl.errors import UserError
from jaxrl.rl.config import AgentConfig


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
