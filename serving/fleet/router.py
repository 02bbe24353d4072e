"""Where a group goes when several engines can take it: one rule for `jaxrl serve
--replicas` (serving/fleet/replicas.py) and the RL run's fleet (jaxrl/rollout/fleet.py).

A multi-turn episode's later turns go to the target that holds its KV pages (its "home"), as
long as that target can take work; any other group goes to the least loaded target (ties: the
one that has waited longest). Homes are remembered for the newest `max_homes` sessions."""

from __future__ import annotations

import collections
import itertools
from typing import Callable, Generic, Hashable, Sequence, TypeVar

T = TypeVar("T", bound=Hashable)


class Router(Generic[T]):
    """Not thread-safe by itself: its owner calls it under its own lock."""

    def __init__(self, load: Callable[[T], float], max_homes: int = 1 << 16):
        self._load = load
        self._homes: collections.OrderedDict[str, T] = collections.OrderedDict()
        self._used: dict[T, int] = {}
        self._clock = itertools.count(1)
        self.max_homes = max_homes

    def choose(self, candidates: Sequence[T], sessions: Sequence[str] = ()) -> T:
        """The target among `candidates` (non-empty) for a group whose samples are the
        sessions `sessions` (none for a one-turn group); records it as their home."""
        home = self._homes.get(sessions[0]) if sessions else None
        target = home if home in candidates else min(
            candidates, key=lambda c: (self._load(c), self._used.get(c, 0)))
        self._used[target] = next(self._clock)
        for key in sessions:
            self._homes[key] = target
            self._homes.move_to_end(key)
        while len(self._homes) > self.max_homes:
            self._homes.popitem(last=False)
        return target

    def forget(self, session: str) -> T | None:
        """The session has ended: its home, which may now free its pages (None if unknown)."""
        return self._homes.pop(session, None)


def session_keys(session: str | Sequence[str] | None) -> list[str]:
    """A request's `session` argument as a list of keys (a turn's one, or a group's n)."""
    return [session] if isinstance(session, str) else list(session or ())
