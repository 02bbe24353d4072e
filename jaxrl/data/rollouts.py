"""The rollout stream: scored samples in the order they finished, and a Grain source over it.

The actor appends every finished group's samples to a `RolloutLog`; each sample gets the next
position. `RolloutSource` is a Grain `IterDataset` reading the log from a position, blocking
until the sample there exists, so the rest of the pipeline (lag filter, packing, batching,
prefetch) is ordinary Grain. Its iterator state is that position: with the log's unconsumed
tail saved beside it (`RolloutLog.tail`), a restored run reads exactly the samples the
interrupted one had not trained on yet.
"""

from __future__ import annotations

import base64
import dataclasses
import threading
from typing import Any, Iterable

import grain
import numpy as np


@dataclasses.dataclass
class Rollout:
    """One scored sample: a prompt and one completion, with what generated it. In a multi-turn
    episode the completion interleaves the model's turns with the environment's answers
    (observations, tool output), which `trained` marks False: they carry no loss."""

    prompt: list[int]         # token ids, BOS included
    completion: list[int]     # generated ids, EOS included when the sample stopped on it
    logprobs: list[float]     # per completion token, under the weights that produced it
    versions: list[int]       # per completion token: the weights' version (optimizer step)
    reward: float
    advantage: float
    group: int                # index of the problem (and group) it answers
    finish: str               # eos | stop | length
    # Per completion token: True where the model sampled it (trained on), False where the
    # environment wrote it (its logprob is ignored). None: every token is the model's.
    trained: list[bool] | None = None
    # Per completion token: its advantage, where it is not `advantage` for every token (the
    # turns of a multi-turn episode under rl.turn_advantage=per_turn). None: `advantage`.
    token_advantages: list[float] | None = None
    # A mixture-of-experts engine's routing of each fed token (prompt and completion, all but
    # the last token): int32 [tokens - 1, layers, experts per token]. None: not recorded.
    routes: np.ndarray | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self):
        n = len(self.completion)
        if len(self.logprobs) != n or len(self.versions) != n or (
                self.trained is not None and len(self.trained) != n) or (
                self.token_advantages is not None and len(self.token_advantages) != n):
            raise ValueError(f"rollout of group {self.group}: {n} completion tokens but "
                             f"{len(self.logprobs)} logprobs, {len(self.versions)} versions"
                             + ("" if self.trained is None
                                else f", {len(self.trained)} trained flags")
                             + ("" if self.token_advantages is None
                                else f", {len(self.token_advantages)} token advantages"))
        fed = len(self.prompt) + n - 1
        if self.routes is not None and len(self.routes) != fed:
            raise ValueError(f"rollout of group {self.group}: routing of {len(self.routes)} "
                             f"tokens; {fed} tokens were fed to the model")

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if self.routes is not None:   # int16 bytes, base64 (a long sample's routing is large)
            d["routes"] = {"shape": list(self.routes.shape), "int16": base64.b64encode(
                np.asarray(self.routes, "<i2").tobytes()).decode()}
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Rollout":
        routes = d.get("routes")
        if routes is not None:
            routes = np.frombuffer(base64.b64decode(routes["int16"]), "<i2").reshape(
                routes["shape"]).astype(np.int32)
        return cls(**{**d, "routes": routes})


class StreamClosed(Exception):
    """The log was closed while a reader waited on it."""


class RolloutLog:
    """Append-only, thread-safe list of rollouts addressed by absolute position; the part before
    `start` (already trained on and checkpointed) is released."""

    def __init__(self, start: int = 0, tail: Iterable[Rollout] = ()):
        self._items: list[Rollout] = list(tail)
        self._start = start
        self._cond = threading.Condition()
        self._closed = False

    @property
    def end(self) -> int:
        """Position the next appended rollout gets."""
        with self._cond:
            return self._start + len(self._items)

    def append(self, rollouts: Iterable[Rollout]) -> None:
        with self._cond:
            self._items.extend(rollouts)
            self._cond.notify_all()

    def get(self, position: int, timeout: float | None = None) -> Rollout:
        with self._cond:
            if position < self._start:
                raise IndexError(f"rollout {position} was released (the log starts at "
                                 f"{self._start})")
            self._cond.wait_for(
                lambda: self._closed or position < self._start + len(self._items), timeout)
            if position < self._start + len(self._items):
                return self._items[position - self._start]
            if self._closed:
                raise StreamClosed()
            raise TimeoutError(f"no rollout at position {position} within {timeout} s")

    def tail(self, position: int) -> list[Rollout]:
        """Rollouts from `position` on: what a checkpoint at `position` must keep."""
        with self._cond:
            return list(self._items[max(position - self._start, 0):])

    def release(self, position: int) -> None:
        """Forgets rollouts before `position`."""
        with self._cond:
            drop = max(0, min(position - self._start, len(self._items)))
            del self._items[:drop]
            self._start += drop

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class _SourceIterator(grain.DatasetIterator):
    def __init__(self, log: RolloutLog, position: int):
        super().__init__()
        self._log = log
        self._position = position

    def __next__(self) -> Rollout:
        try:
            item = self._log.get(self._position)
        except StreamClosed:
            raise StopIteration from None
        self._position += 1
        return item

    def get_state(self) -> dict[str, Any]:
        return {"position": self._position}

    def set_state(self, state: dict[str, Any]) -> None:
        self._position = int(state["position"])


class RolloutSource(grain.IterDataset):
    """Grain source over a `RolloutLog`, from position `start`."""

    def __init__(self, log: RolloutLog, start: int = 0):
        super().__init__()
        self._log = log
        self._start = start

    def __iter__(self) -> _SourceIterator:
        return _SourceIterator(self._log, self._start)

    def __str__(self) -> str:
        return f"RolloutSource(start={self._start})"


def source_position(state: dict[str, Any]) -> int:
    """The source position inside a pipeline's (nested) Grain iterator state."""
    while "position" not in state:
        state = state["parent"] if "parent" in state else next(
            v for v in state.values() if isinstance(v, dict))
    return int(state["position"])
