"""The data plane behind the OpenAI endpoint (SeamlessFlow): requests that name a trajectory
(the `X-Trajectory-Id` header, or the `user` field) are recorded into it token by token, so an
agent written for any OpenAI client produces training data without knowing it.

An agent sends its whole conversation each turn. The store lines the new prompt up with the
tokens the trajectory already holds and keeps them, so the trainer sees exactly the tokens the
model sampled (never a re-tokenisation of their text):
- if the prompt's text starts with the text of the recorded tokens, the prompt becomes those
  tokens plus the encoding of the rest;
- otherwise (the agent edited its history) the longest common token prefix is kept and the
  rest of the prompt follows it.
Tokens the model sampled are `trained`, with their log-probs and weights versions; everything
else (the first prompt, user and tool messages, the chat template's markup) is not.

Each trajectory is also the engine session of its turns: the next turn continues from the KV
pages the last one kept (serving/core/sessions.py). `end` frees them and returns the record.
"""

from __future__ import annotations

import collections
import dataclasses
import threading


@dataclasses.dataclass
class Recorded:
    prompt: list[int]                       # the first request's prompt
    tokens: list[int] = dataclasses.field(default_factory=list)   # everything after it
    trained: list[bool] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    turns: int = 0

    @property
    def history(self) -> list[int]:
        return self.prompt + self.tokens

    def cut(self, keep: int) -> None:
        """Keeps the first `keep` tokens of the history."""
        if keep < len(self.prompt):
            self.prompt = self.prompt[:keep]
        keep = max(keep - len(self.prompt), 0)
        for name in ("tokens", "trained", "logprobs", "versions"):
            setattr(self, name, getattr(self, name)[:keep])

    def extend(self, tokens, trained: bool, logprobs=None, versions=None) -> None:
        tokens = list(tokens)
        self.tokens += tokens
        self.trained += [trained] * len(tokens)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(tokens)
        last = self.versions[-1] if self.versions else 0
        self.versions += list(versions) if versions is not None else [last] * len(tokens)

    def to_json(self, key: str, decode) -> dict:
        return {"id": key, "object": "trajectory", "prompt": self.prompt, "tokens": self.tokens,
                "trained": self.trained, "logprobs": self.logprobs, "versions": self.versions,
                "turns": self.turns, "text": decode(self.history)}


class TrajectoryStore:
    def __init__(self, tokenizer, max_trajectories: int = 1 << 14):
        self.tokenizer = tokenizer
        self.max_trajectories = max_trajectories
        self._records: collections.OrderedDict[str, Recorded] = collections.OrderedDict()
        self._lock = threading.Lock()

    def align(self, key: str, ids: list[int], text: str | None = None) -> list[int]:
        """The prompt to submit for trajectory `key`: `ids` (the encoding of `text`, if given)
        lined up with the tokens recorded so far, and recorded as the trajectory's history."""
        with self._lock:
            record = self._records.get(key)
            if record is None:
                self._records[key] = Recorded(list(ids))
                while len(self._records) > self.max_trajectories:
                    self._records.popitem(last=False)
                return list(ids)
            self._records.move_to_end(key)
            history = record.history
            said = self.tokenizer.decode(history)
            if text is not None and said and text.startswith(said):
                rest = self.tokenizer.encode(text[len(said):]) if len(text) > len(said) else []
                record.extend(rest, trained=False)
                return history + rest
            same = 0
            for a, b in zip(history, ids):
                if a != b:
                    break
                same += 1
            record.cut(same)
            record.extend(ids[same:], trained=False)
            return record.history

    def record(self, key: str, tokens, logprobs, versions) -> None:
        """The model's answer to the turn just aligned."""
        with self._lock:
            record = self._records.get(key)
            if record is not None:
                record.extend(tokens, True, logprobs, versions)
                record.turns += 1

    def get(self, key: str) -> dict | None:
        with self._lock:
            record = self._records.get(key)
            return None if record is None else record.to_json(key, self.tokenizer.decode)

    def end(self, key: str) -> dict | None:
        with self._lock:
            record = self._records.pop(key, None)
            return None if record is None else record.to_json(key, self.tokenizer.decode)
