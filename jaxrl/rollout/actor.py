"""The actor: turns problems into scored groups of rollouts on the rollout log. Its groups come
from a `GroupSource` (jaxrl/rollout/sources.py: completions of a single-turn task, episodes
against a multi-turn task's environment, or episodes run by external agents), through any
Generation (serving/fleet/generation.py): this process's orchestrator or the rollout fleet.

A problem is a pure function of (seed, index), so the stream of problems is resumable by index
alone. When a group finishes it is scored, given leave-one-out advantages, filtered, and
appended to the log as one unit. Async: a thread keeps the slots busy, two steps' samples ahead
at most; sync: one step's at a time.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from typing import Callable

from jaxrl.config import ConfigError
from jaxrl.data.rollouts import Rollout, RolloutLog
from jaxrl.rl.advantages import group_advantages, keep_group
from jaxrl.rl.config import RLConfig
from jaxrl.rollout.filters import FilterStall, describe_drops, filter_drops, generated_samples
from jaxrl.rollout.group import Group
from jaxrl.rollout.sources import GroupSource, ScoredGroup
from serving.core import threads


def ahead_bound(batch: int, slots: int) -> int:
    """How many samples async's actor keeps finished-and-untrained plus in flight: a batch
    (the one training) and beside it as many as the slots hold, at least one batch more and at
    most two (Actor._run)."""
    return batch + max(batch, min(slots, 2 * batch))


class Actor:
    def __init__(self, source: GroupSource, log: RolloutLog, cfg: RLConfig, *, seed: int,
                 resume: dict | None = None, warn: Callable[[str], None] = print):
        """`source`: where the groups come from (jaxrl/rollout/sources.py). `resume`: a
        `snapshot` of the run this one continues: its next problem, the groups in flight when
        it was saved (submitted first) and what had been generated of them (continued rather
        than regenerated), its counters."""
        resume = resume or {}
        self.source = source
        self.log = log
        self.cfg = cfg
        self.seed = seed
        self.next_problem = resume.get("next_problem", 0)
        # Groups in flight when the run was saved, and what their source carried of them.
        self._redo = collections.deque(resume.get("redo", ()))
        self._carry = {int(i): p for i, p in (resume.get("partial") or {}).items()}
        self._in_flight: dict[int, int] = {}     # problem index -> samples expected
        self._handles: dict[int, object] = {}    # problem index -> its group's handle
        self._lock = threading.Condition()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(cfg.prompts_per_step,
                            cfg.engine.max_concurrent_decodes // cfg.group_size) + 2,
            thread_name_prefix="actor-collect")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.trained_position = 0    # set by the loop: rollouts before it were trained on
        self.turns_at_bound = 0      # async: turns of `_run` that found no room to submit
        self.stats = collections.Counter(resume.get("stats") or {})  # over the whole run
        self.error: BaseException | None = None
        self._warn = warn
        self._skipped_in_a_row = 0
        self._last_progress = time.monotonic()    # when a rollout last reached the log
        self._lengths: collections.deque[int] = collections.deque()  # see take_lengths
        self._since_progress = self.stats.copy()  # the counters when a rollout was last kept
        self._last_warned = float("-inf")
        self._reports, self._report_stats = 0, self.stats.copy()   # see drop_report

    # -- groups --------------------------------------------------------------------------------
    def problem(self, index: int):
        """Problem `index` of the run's stream (the source's, under the run's seed)."""
        return self.source.problem(self.seed, index)

    def _submit_next(self) -> int:
        """Submits the next group; returns the samples it will add (0 if it was skipped)."""
        with self._lock:  # choosing and registering a group is atomic for `snapshot`
            if self._redo:
                index = self._redo.popleft()
            else:
                index, self.next_problem = self.next_problem, self.next_problem + 1
            problem = self.problem(index)
            prompt = self.source.prompt(problem)
            if len(prompt) > self.cfg.max_prompt_len:
                self._skip_long(prompt)
                return 0
            self._skipped_in_a_row = 0
            self._in_flight[index] = self.cfg.group_size
            carry = self._carry.get(index)
        group = Group(index, problem, prompt, (self.seed * 1_000_003 + index) % 2**32)
        handle = self.source.open(group, carry)
        with self._lock:
            self._handles[index] = handle
            if self._carry.pop(index, None) is not None:
                self.stats["carried_tokens"] += self.source.carried_tokens(carry)
        self._pool.submit(self._collect, handle, group)
        return self.cfg.group_size

    def _skip_long(self, prompt: list[int]) -> None:
        """Counts a prompt over rl.max_prompt_len; a thousand in a row stop the run."""
        self.stats["prompts_too_long"] += 1
        self._skipped_in_a_row += 1
        if self._skipped_in_a_row >= 1000:
            raise ConfigError(
                f"the last {self._skipped_in_a_row} prompts were all longer than "
                f"rl.max_prompt_len={self.cfg.max_prompt_len} tokens (e.g. {len(prompt)}); "
                f"raise rl.max_prompt_len")

    def _collect(self, handle, group: Group) -> None:
        """The group's end (a pool thread): scored and logged, or left in flight when it was
        cut short (a resumed run redoes it); an error fails the actor."""
        rollouts, complete = [], False
        try:
            complete, scored = self.source.collect(handle, group, self.stats)
            rollouts = [] if scored is None else self._kept(scored)
        except BaseException as e:
            self._fail(e)
        self._logged(group.index, complete, rollouts)

    def _logged(self, index: int, complete: bool, rollouts: list[Rollout]) -> None:
        with self._lock:
            if complete:
                self.log.append(rollouts)
                if rollouts:
                    self._last_progress = time.monotonic()
                    self._since_progress = self.stats.copy()
                self.stats["samples"] += len(rollouts)
                self.stats["groups"] += 1
                del self._in_flight[index]
                del self._handles[index]
            self._lock.notify_all()

    def _kept(self, scored: ScoredGroup) -> list[Rollout]:
        """The group's rollouts after the filters (counted in the stats, with its rewards). A
        group an agent left with one episode has no baseline."""
        rewards, candidates = scored.rewards, scored.candidates
        self._lengths.extend(scored.lengths)
        self.stats["reward_sum"] += float(rewards.sum())
        self.stats["solved"] += int((rewards >= 1).sum())
        self.stats["scored"] += len(rewards)
        if len(rewards) < 2 or (self.cfg.filter_zero_advantage and not keep_group(rewards)):
            self.stats["dropped_zero_advantage"] += len(candidates)
            return []
        advantages = group_advantages(rewards[None], normalize_std=self.cfg.normalize_std)[0]
        out = []
        for (finish, rollout), a in zip(candidates, advantages):
            if self.cfg.filter_overlong and finish == "length":
                self.stats["dropped_overlong"] += 1
                continue
            out.append(rollout(a))
        return out

    # -- modes ---------------------------------------------------------------------------------
    def start(self) -> "Actor":
        """Async mode: keep the engine busy until `stop`."""
        self._thread = threading.Thread(target=self._run, name="actor", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        """Samples finished and not yet trained plus those in flight: at most one batch (the
        one training) and beside it as many as the engines' slots hold, at least a batch and at
        most two. With slots for more than a batch, the next batch is not held up by the
        longest group in flight (with only one batch in flight it is: sync's tail): short groups
        complete it while long ones go on under the newer weights (PipelineRL). With fewer, the
        bound is two batches, which keeps the samples' lag low."""
        try:
            while not self._stop.is_set():
                # The slots present now: a fleet's servers may join and leave during the run.
                bound = ahead_bound(self.cfg.batch_size, self.source.slots)
                with self._lock:
                    ahead = self.log.end + sum(self._in_flight.values()) - self.trained_position
                    if ahead >= bound:
                        self.turns_at_bound += 1
                        self._lock.wait(0.05)
                        continue
                self._check_progress()
                self._submit_next()
        except BaseException as e:
            self._fail(e)
            raise

    def _fail(self, error: BaseException) -> None:
        """Ends the stream so the trainer, blocked on it, sees the error instead of hanging."""
        self.error = error
        self.log.close()

    def generate(self, samples: int) -> None:
        """Sync mode: generate until `samples` more rollouts are on the log, then return once
        nothing is in flight (the weights stay fixed for all of them). A group the filters drop
        is replaced at once, not after the rest of its round: rounds, each as long as its
        slowest group, would idle the engine in between."""
        target = self.log.end + samples
        while not self._stop.is_set():
            with self._lock:
                if self.error is not None:
                    raise self.error
                missing = target - self.log.end - sum(self._in_flight.values())
                if missing <= 0 and not self._in_flight:
                    return
            for _ in range(-(-missing // self.cfg.group_size)):
                self._submit_next()
            self._check_progress()
            with self._lock:      # woken when a group lands or is dropped; 1 s for the check
                flying = len(self._in_flight)
                self._lock.wait_for(lambda: len(self._in_flight) < flying or self.error
                                    is not None or self._stop.is_set(), timeout=1.0)

    def _check_progress(self, patience_s: float = 60.0) -> None:
        """Says so, with the counters, when nothing has reached the trainer for a minute; when
        the filters have dropped every sample generated for rl.filter_wait_s, stops the run
        with an error that names the filter (e.g. a model that never emits EOS)."""
        now = time.monotonic()
        idle = now - self._last_progress
        if idle <= min(patience_s, self.cfg.filter_wait_s):
            return
        with self._lock:
            why = describe_drops(self.stats, self._since_progress, self.cfg)
        if idle > self.cfg.filter_wait_s and why:
            raise FilterStall(f"no sample reached the trainer for {idle:.0f} s "
                              f"(rl.filter_wait_s={self.cfg.filter_wait_s:g}): {why}")
        if now - self._last_warned >= patience_s:
            self._warn(f"actor: no rollout kept for {idle:.0f} s ({self.stats['groups']} "
                       f"groups kept so far); since the last one, "
                       f"{why or 'no group has finished'}")
            self._last_warned = now

    def drop_report(self, every: int = 5) -> str | None:
        """Called once a step: every `every` steps, which filters dropped more than half of
        the samples generated since the last report, and how many; else None."""
        self._reports += 1
        if self._reports % every:
            return None
        with self._lock:
            now, before = self.stats.copy(), self._report_stats
            self._report_stats = now
        generated = generated_samples(now) - generated_samples(before)
        dropped = sum(filter_drops(now, before).values())
        if not generated or 2 * dropped <= generated:
            return None
        return (f"filters, last {every} steps: {describe_drops(now, before, self.cfg)}; "
                f"{generated - dropped} kept")

    def take_lengths(self) -> list[int]:
        """Completion lengths of every sample scored since the last call, before any filter:
        the model's output-length distribution, not what the trainer kept of it."""
        out = []
        while self._lengths:
            out.append(self._lengths.popleft())
        return out

    def notify_trained(self, position: int) -> None:
        with self._lock:
            self.trained_position = position
            self._lock.notify_all()

    def snapshot(self, position: int) -> dict:
        """What a checkpoint needs to continue the same stream: the rollouts from `position`
        (generated, not yet trained on), the groups still being generated (redone first on
        resume) with every token generated of them so far (`partial`: continued, not
        regenerated), and the next problem index, all taken at one instant."""
        with self._lock:
            carry = {**self._carry,
                     **{i: self.source.carry(h) for i, h in self._handles.items()}}
            return {"position": position,
                    "rollouts": [r.to_json() for r in self.log.tail(position)],
                    "redo": sorted(self._in_flight) + list(self._redo),
                    "partial": {str(i): c for i, c in carry.items()
                                if self.source.carried_tokens(c)},
                    "next_problem": self.next_problem, "stats": dict(self.stats)}

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            self._lock.notify_all()
        threads.join(self._thread, 30)
        self._pool.shutdown(wait=False, cancel_futures=True)
