"""The actor: turns problems into scored groups of rollouts on the rollout log, through any
Generation (serving/generation.py): this process's orchestrator or the rollout fleet.

A problem is a pure function of (seed, index), so the stream of problems is resumable by index
alone. Each group is one request with n = group_size samples (one prefill); when it finishes it
is scored, given leave-one-out advantages, filtered, and appended to the log as one unit.
Async: a thread keeps the slots busy, two steps' samples ahead at most; sync: one step's at a time.

A multi-turn task's group is n episodes run turn by turn by the trajectory manager
(jaxrl/rollout/episodes.py); each episode becomes one rollout, its environment tokens untrained,
scored by its return.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import threading
import time
from typing import Callable

import numpy as np

from jaxrl.config import ConfigError
from jaxrl.data.rollouts import Rollout, RolloutLog
from jaxrl.errors import UserError
from jaxrl.models.tokenizer import Tokenizer, prompt_ids
from jaxrl.rl.advantages import group_advantages, keep_group, turn_advantages
from jaxrl.rl.config import RLConfig
from jaxrl.rl.env import Trajectory, is_multi_turn
from jaxrl.rl.rewards import Scorer
from jaxrl.rl.tasks.base import Problem, Task
from jaxrl.rollout.episodes import EpisodeGroup
from jaxrl.rollout.filters import FilterStall, describe_drops, filter_drops, generated_samples
from serving import threads
from serving.generation import Generation
from serving.sampling import SamplingParams
from serving.stream import FINISHED, Sample


def ahead_bound(batch: int, slots: int) -> int:
    """How many samples async's actor keeps finished-and-untrained plus in flight: a batch
    (the one training) and beside it as many as the slots hold, at least one batch more and at
    most two (Actor._run)."""
    return batch + max(batch, min(slots, 2 * batch))

class Actor:
    def __init__(self, generation: Generation, task: Task, tokenizer: Tokenizer,
                 log: RolloutLog, cfg: RLConfig, *, seed: int, resume: dict | None = None,
                 warn: Callable[[str], None] = print, agents=None):
        """`resume`: a `snapshot` of the run this one continues: its next problem, the groups
        in flight when it was saved (submitted first) and what had been generated of them
        (continued rather than regenerated), its counters. `agents`: external agent programs
        run the episodes (jaxrl/rollout/agents.py) instead of the task's environment."""
        resume = resume or {}
        next_problem, redo = resume.get("next_problem", 0), tuple(resume.get("redo", ()))
        carry, stats = Actor.carry_from(resume), resume.get("stats")
        self.generation = generation
        self.agents = agents
        self.task = task
        self.tokenizer = tokenizer
        self.log = log
        self.cfg = cfg
        self.seed = seed
        self.next_problem = next_problem
        self._redo = collections.deque(redo)   # groups in flight when the run was saved
        self._carry = dict(carry or {})          # ... and their samples so far
        self._in_flight: dict[int, int] = {}     # problem index -> samples expected
        self._streams: dict[int, object] = {}   # problem index -> its request's stream
        self._lock = threading.Condition()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(cfg.prompts_per_step, cfg.slots // cfg.group_size) + 2,
            thread_name_prefix="actor-collect")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.trained_position = 0    # set by the loop: rollouts before it were trained on
        self.turns_at_bound = 0      # async: turns of `_run` that found no room to submit
        self.stats = collections.Counter(stats or {})  # cumulative over the whole run
        self.error: BaseException | None = None
        self._warn = warn
        self._skipped_in_a_row = 0
        self._last_progress = time.monotonic()    # when a rollout last reached the log
        self._lengths: collections.deque[int] = collections.deque()  # see take_lengths
        self.scorer = Scorer(task, timeout_s=cfg.reward_timeout_s,
                             max_failures=cfg.max_reward_failures, warn=warn)
        self._since_progress = self.stats.copy()  # the counters when a rollout was last kept
        self._last_warned = float("-inf")
        self._reports, self._report_stats = 0, self.stats.copy()   # see drop_report

    # -- problems and requests -----------------------------------------------------------------
    def problem(self, index: int) -> Problem:
        return self.task.sample(np.random.default_rng((self.seed, index, 1)))

    def _submit_next(self) -> int:
        """Submits the next group; returns the samples it will add (0 if it was skipped)."""
        with self._lock:  # choosing and registering a group is atomic for `snapshot`
            if self._redo:
                index = self._redo.popleft()
            else:
                index, self.next_problem = self.next_problem, self.next_problem + 1
            problem = self.problem(index)
            prompt = prompt_ids(self.tokenizer, problem.prompt)
            if len(prompt) > self.cfg.max_prompt_len:
                self.stats["prompts_too_long"] += 1
                self._skipped_in_a_row += 1
                if self._skipped_in_a_row >= 1000:
                    raise ConfigError(
                        f"the last {self._skipped_in_a_row} prompts were all longer than "
                        f"rl.max_prompt_len={self.cfg.max_prompt_len} tokens (e.g. "
                        f"{len(prompt)}); raise rl.max_prompt_len")
                return 0
            self._skipped_in_a_row = 0
            self._in_flight[index] = self.cfg.group_size
            carry = self._carry.get(index)
        seed = (self.seed * 1_000_003 + index) % 2**32
        stream, finish = self._open(problem, prompt, index, seed, carry)
        with self._lock:
            self._streams[index] = stream
            if self._carry.pop(index, None) is not None:
                self.stats["carried_tokens"] += _carried_tokens(carry)
        self._pool.submit(self._collect, index, problem, prompt, stream, finish)
        return self.cfg.group_size

    def _open(self, problem: Problem, prompt: list[int], index: int, seed: int, carry):
        """The group's request, from one of the actor's three sources, and how it ends: (its
        stream, `finish(index, problem, prompt, stream) -> (complete, rollouts)`). Single-turn
        tasks sample n completions of one prompt from the generation; multi-turn tasks run n
        episodes against the task's environment (jaxrl/rollout/episodes.py); with rl.agent,
        external agent programs run them (jaxrl/rollout/agents.py)."""
        if self.agents is not None:
            return self.agents.group(problem, self.cfg, index=index, seed=seed), self._episodes
        if is_multi_turn(self.task):
            return EpisodeGroup(self.generation, self.task, self.tokenizer, problem, prompt,
                                self.cfg, seed=seed, state=carry), self._episodes
        sampling = SamplingParams(temperature=self.cfg.temperature, n=self.cfg.group_size,
                                  seed=seed, **self._length_limits(problem))
        return self.generation.submit(prompt, sampling, carry=carry), self._samples

    def _length_limits(self, problem: Problem) -> dict:
        """max_tokens (and min_tokens) of a problem's samples: rl.completion_length."""
        budget = self.cfg.max_new_tokens
        if self.cfg.completion_length == "free":
            return {"max_tokens": budget}
        answer = len(self.tokenizer.encode(problem.answer))
        return {"max_tokens": min(answer + 1, budget), "min_tokens": min(answer, budget - 1)}

    def _collect(self, index: int, problem: Problem, prompt: list[int], stream,
                 finish: Callable) -> None:
        """The group's end (a pool thread): scored and logged, or left in flight when it was
        cut short (a resumed run redoes it); an error fails the actor."""
        rollouts, complete = [], False
        try:
            complete, rollouts = finish(index, problem, prompt, stream)
        except BaseException as e:
            self._fail(e)
        self._logged(index, complete, rollouts)

    def _samples(self, index: int, problem: Problem, prompt: list[int], stream):
        samples = stream.result()
        complete = all(s.finish_reason in FINISHED for s in samples)
        return complete, self._score(index, problem, prompt, samples) if complete else []

    def _episodes(self, index: int, problem: Problem, prompt: list[int], group):
        trajectories = group.run()      # None: cut short
        self.stats["dropped_agent"] += len(getattr(group, "failures", ()))
        if trajectories is None:
            return False, []
        return True, self._score_episodes(index, trajectories)

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
                del self._streams[index]
            self._lock.notify_all()

    def _score(self, index, problem, prompt, samples) -> list[Rollout]:
        eos = self.tokenizer.eos_id
        completions = [self.tokenizer.decode(s.tokens[:-1] if s.tokens and s.tokens[-1] == eos
                                             else s.tokens) for s in samples]
        self._lengths.extend(len(s.tokens) for s in samples)
        if self.cfg.moe_routing == "replay" and any(s.routes is None for s in samples):
            raise UserError("rl.moe_routing=replay: a generation server sent samples without "
                            "their routing; start `jaxrl serve` with --record-routes")
        rewards = self.scorer.group(problem, completions)
        if rewards is None:      # reported by the scorer; the run goes on without the group
            self.stats["dropped_reward_error"] += len(samples)
            return []
        self.stats["reward_sum"] += float(rewards.sum())
        self.stats["solved"] += int((rewards >= 1).sum())
        self.stats["scored"] += len(rewards)
        return self._kept(rewards, [
            (s.finish_reason, lambda a, s=s, r=r: Rollout(
                prompt=list(prompt), completion=list(s.tokens), logprobs=list(s.logprobs),
                versions=list(s.versions), reward=float(r), advantage=float(a), group=index,
                finish=s.finish_reason, routes=s.routes)) for s, r in zip(samples, rewards)])

    def _score_episodes(self, index: int, trajectories: list[Trajectory]) -> list[Rollout]:
        rewards = np.asarray([t.episode_return for t in trajectories], np.float32)
        s = self.stats
        for t in trajectories:
            self._lengths.append(len(t.tokens))
            s.update(episodes=1, turns=len(t.turns), tool_calls=t.tool_calls,
                     tool_errors=t.tool_errors, model_tokens=t.model_tokens,
                     env_tokens=t.env_tokens)
        s["reward_sum"] += float(rewards.sum())
        s["solved"] += int((rewards >= 1).sum())
        s["scored"] += len(rewards)
        per_turn = [None] * len(trajectories)
        if self.cfg.turn_advantage == "per_turn" and len(trajectories) >= 2:
            per_turn = turn_advantages([t.turn_rewards for t in trajectories],
                                       discount=self.cfg.turn_discount,
                                       normalize_std=self.cfg.normalize_std)
        return self._kept(rewards, [
            (t.finish, lambda a, t=t, turns=turns: t.to_rollout(index, float(a), turns))
            for t, turns in zip(trajectories, per_turn)])

    def _kept(self, rewards: np.ndarray, samples: list) -> list[Rollout]:
        """The group's rollouts after the filters: `samples` are (finish reason, rollout given
        its advantage) in order. A group an agent left with one episode has no baseline."""
        if len(rewards) < 2 or (self.cfg.filter_zero_advantage and not keep_group(rewards)):
            self.stats["dropped_zero_advantage"] += len(samples)
            return []
        advantages = group_advantages(rewards[None], normalize_std=self.cfg.normalize_std)[0]
        out = []
        for (finish, rollout), a in zip(samples, advantages):
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
        bound = ahead_bound(self.cfg.batch_size, self._slots())
        try:
            while not self._stop.is_set():
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

    def _slots(self) -> int:
        """The slots of the engines generating now (rl.slots for a bare engine)."""
        return getattr(self.generation, "slots", None) or self.cfg.slots

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
            partial = {**self._carry, **{i: s.snapshot() for i, s in self._streams.items()}}
            return {"position": position,
                    "rollouts": [r.to_json() for r in self.log.tail(position)],
                    "redo": sorted(self._in_flight) + list(self._redo),
                    "partial": {str(i): _partial_json(p) for i, p in partial.items()
                                if _carried_tokens(p)},
                    "next_problem": self.next_problem, "stats": dict(self.stats)}

    @staticmethod
    def carry_from(data: dict) -> dict[int, list[Sample]]:
        """A snapshot's `partial`, as the Actor's `carry` argument."""
        return {int(i): p if isinstance(p, dict) else [Sample(**s) for s in p]
                for i, p in (data.get("partial") or {}).items()}

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            self._lock.notify_all()
        threads.join(self._thread, 30)
        self._pool.shutdown(wait=False, cancel_futures=True)


def _partial_json(partial) -> dict | list[dict]:
    """A group in flight as a checkpoint keeps it: an episode group's snapshot (already JSON),
    or a single-turn group's samples."""
    return partial if isinstance(partial, dict) else [dataclasses.asdict(s) for s in partial]


def _carried_tokens(partial) -> int:
    """Tokens generated of a group in flight (its snapshot or samples)."""
    if isinstance(partial, dict):
        return sum(len(t["tokens"]) for t in partial["trajectories"]) + sum(
            len(s["tokens"]) for s in partial["turns"] if s)
    return sum(len(s.tokens) for s in partial)
