"""The trajectory manager (SeamlessFlow): a group of multi-turn episodes of one problem, run
turn by turn on any Generation, keeping each episode's whole token history.

- The group's first turn is one request with n samples (one prefill of the prompt), each
  sample opening its episode's session; every later turn is a request of its own whose prompt
  is the episode's history, continued from the KV pages the session kept (serving/core/sessions.py):
  earlier turns are never prefilled again.
- Weight updates land between and inside turns as they land inside sequences; each token keeps
  the version that drew it.
- `snapshot()` is the group as far as it got (histories, and each episode's current turn as far
  as it was generated); a group built from it continues exactly there, its turns' tokens
  carried rather than regenerated (the kept pages are gone after a restart: the history is
  prefilled once, then decoding goes on).

The episodes of a group take their turns together (a turn of every unfinished episode is
submitted, then all are awaited): a short turn waits for the group's longest before its next.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading

from jaxrl.models.tokenizer import Tokenizer
from jaxrl.rl.config import RLConfig
from jaxrl.rl.env import MultiTurnTask, Trajectory
from jaxrl.rollout.group import Group
from serving.core.stream import FINISHED, Sample
from serving.fleet.generation import Generation
from serving.runner.sampling import SamplingParams

_keys = itertools.count()


class EpisodeGroup:
    def __init__(self, generation: Generation, task: MultiTurnTask, tokenizer: Tokenizer,
                 group: Group, cfg: RLConfig, *, temperature: float | None = None,
                 state: dict | None = None):
        """`group`: the problem, its prompt and the group's sampling seed; `state`: a
        `snapshot()` to continue from. `temperature`: None samples rl.group_size episodes at
        rl.temperature (training); a value runs one episode at it (held-out evaluation: 0.0,
        greedy)."""
        self.generation = generation
        self.task = task
        self.tokenizer = tokenizer
        self.problem, prompt = group.problem, group.prompt
        self.cfg = cfg
        self.seed = seed = group.seed
        self.temperature = cfg.temperature if temperature is None else temperature
        state = state or {}
        n = cfg.group_size if temperature is None else 1
        self.trajectories = [Trajectory.from_json(t) for t in state.get("trajectories", [])] \
            or [Trajectory(list(prompt)) for _ in range(n)]
        self._carry = [Sample(*(list(s[k]) for k in ("tokens", "logprobs", "versions")))
                       if s else None for s in state.get("turns", [])] \
            or [None] * len(self.trajectories)
        self.keys = [f"episode-{seed}-{next(_keys)}-{i}" for i in range(len(self.trajectories))]
        stop = getattr(task, "turn_stop", None)     # a token that ends a model turn
        self._stop = tuple(tokenizer.encode(stop)) if stop else ()
        self._streams: dict[int, object] = {}      # episode -> its current turn's stream
        self._lock = threading.Lock()

    # -- running -------------------------------------------------------------------------------
    def run(self) -> list[Trajectory] | None:
        """Runs every episode to its end; None if a turn was cut short (shutdown, a lost
        engine): the group stays in flight and `snapshot()` says where it got."""
        try:
            while True:
                going = [i for i, t in enumerate(self.trajectories) if not t.done]
                if not going:
                    return self.trajectories
                done = [(episodes, stream.result()) for episodes, stream in self._submit(going)]
                if any(s.finish_reason not in FINISHED for _, samples in done for s in samples):
                    return None
                with self._lock:
                    self._streams.clear()
                    for episodes, samples in done:
                        for i, sample in zip(episodes, samples):
                            self._carry[i] = None
                            self._after_turn(self.trajectories[i], sample)
        finally:
            for key in self.keys:
                self.generation.end_session(key)

    def _submit(self, going: list[int]) -> list[tuple[list[int], object]]:
        """Submits the next turn of each episode in `going`: (episodes, stream) per request."""
        if all(not t.turns for t in self.trajectories):
            # The group's first turn: one request, the prompt prefilled once.
            n = len(self.trajectories)
            carry = [c or Sample() for c in self._carry] if any(self._carry) else None
            requests = [(list(range(n)), self.trajectories[0].prompt,
                         self._sampling(n, self.seed), self.keys if n > 1 else self.keys[0],
                         carry)]
        else:
            requests = []
            for i in going:
                t = self.trajectories[i]
                seed = (self.seed * 1_000_003 + 7919 * i + len(t.turns)) % 2**32
                requests.append(([i], t.history, self._sampling(1, seed, t), self.keys[i],
                                 [self._carry[i]] if self._carry[i] else None))
        out = []
        for episodes, prompt, sampling, session, carry in requests:
            stream = self.generation.submit(prompt, sampling, session=session, carry=carry)
            with self._lock:
                for position, i in enumerate(episodes):
                    self._streams[i] = (stream, position)
            out.append((episodes, stream))
        return out

    def _sampling(self, n: int, seed: int, t: Trajectory | None = None) -> SamplingParams:
        used = len(t.tokens) if t is not None else 0
        return SamplingParams(max_tokens=min(self.cfg.max_new_tokens,
                                             self.cfg.episode_tokens - used),
                              temperature=self.temperature, n=n, seed=seed,
                              stop_token_ids=self._stop)

    def _after_turn(self, t: Trajectory, sample: Sample) -> None:
        """Appends the model's turn and the environment's answer; ends the episode when the
        environment says so or a limit is reached."""
        eos = self.tokenizer.eos_id
        body = sample.tokens[:-1] if sample.tokens and sample.tokens[-1] == eos else \
            sample.tokens
        t.add_model(sample.tokens, sample.logprobs, sample.versions,
                    self.tokenizer.decode(body))
        reply = self.task.reply(self.problem, t.turns)
        if reply.done:
            t.add_reply(reply)
            t.finish = "done"
            return
        if len(t.turns) >= self.cfg.max_turns:
            t.add_reply(reply)
            t.finish = "turns"
            return
        observation = self.tokenizer.encode(reply.observation)
        if len(t.tokens) + len(observation) >= self.cfg.episode_tokens:   # no room for another turn
            t.add_reply(reply)
            t.finish = "length"
            return
        t.add_reply(reply, observation)

    # -- checkpoints ---------------------------------------------------------------------------
    def snapshot(self) -> dict:
        """The group as far as it got: every history, and each current turn's tokens so far
        (finished or not: a resumed group replays them rather than generating them again)."""
        with self._lock:
            turns = [dataclasses.asdict(c) if c else None for c in self._carry]
            for i, (stream, position) in self._streams.items():
                sample = stream.snapshot()[position]
                if sample.tokens:
                    turns[i] = dataclasses.asdict(sample)
            return {"trajectories": [t.to_json() for t in self.trajectories],
                    "turns": [s and {**s, "finish_reason": None} for s in turns]}

    def cancel(self) -> None:
        with self._lock:
            streams = [stream for stream, _ in self._streams.values()]
        for stream in streams:
            stream.cancel()
