"""Fan-out along a chain: which server each tcp weight push pulls from (serving/weights/bulk.py).

The first server pushed an update pulls it from the trainer and offers what arrives, as it
arrives, under a relay id of its own; the next pulls from it and relays in turn, and so on. The
trainer sends each byte once, and pushing to N servers costs about one push plus a chunk per
hop, not N pushes (checkpoint-engine's and Marin's fan-out). A relay is single-use: each link
of the chain has one server downstream. The last push planned when the update was published
relays nothing (nobody would pull from it), so it keeps its receive arrays for the next update.

A push that fails cuts the chain there: the next push of that update pulls from the trainer
again. A server downstream of the failed one fails too (its source stopped short), is set aside
like any failed push, and is pushed again, from the trainer or a new chain, once it answers.
"""

from __future__ import annotations

import dataclasses
import secrets
import threading
import time


@dataclasses.dataclass(frozen=True)
class Link:
    """One push's place in its chain: where it pulls from (None: the trainer) and the id it
    relays under (0: it does not relay, its server having no bulk address)."""

    pull_from: tuple[str, int] | None
    relay_as: int

    def route(self) -> dict:
        """The keyword arguments of `RemoteGeneration.update_params`."""
        return {"pull_from": self.pull_from, "relay_as": self.relay_as}


class RelayChains:
    """The tail of each update's chain: the server that joined last and its relay id."""

    def __init__(self, deadline_s: float):
        self._deadline_s = deadline_s
        self._lock = threading.Lock()
        self._tails: dict[tuple, tuple[str, int, float]] = {}   # update -> (address, id, until)
        self._expected: dict[tuple, int] = {}    # update -> pushes planned when it was published
        self._joined: dict[tuple, int] = {}

    def expect(self, pushes: dict[tuple, int]) -> None:
        """The pushes planned of each update (those published are the only ones kept): the
        last to join a chain relays nothing, and keeps its receive arrays for the next."""
        with self._lock:
            self._expected = dict(pushes)
            self._joined = {k: n for k, n in self._joined.items() if k in pushes}

    def join(self, update: tuple, bulk_address: str | None) -> Link:
        """The link of a push of `update` (e.g. (version, adapters only)) to a server whose
        bulk server is at `bulk_address`: it pulls from the chain's tail if that relay is
        still offered, and becomes the new tail if it can relay and another push of the update
        is still to come."""
        with self._lock:
            now = time.monotonic()
            self._tails = {k: t for k, t in self._tails.items() if t[2] > now}
            tail = self._tails.pop(update, None)
            self._joined[update] = self._joined.get(update, 0) + 1
            more = self._joined[update] < self._expected.get(update, 0)
            relay_as = (secrets.randbits(63) or 1) if bulk_address and more else 0
            if relay_as:
                self._tails[update] = (bulk_address, relay_as, now + self._deadline_s)
            return Link(None if tail is None else tail[:2], relay_as)

    def failed(self, update: tuple, link: Link) -> None:
        """The push on `link` failed: a later push of `update` does not pull from it."""
        with self._lock:
            tail = self._tails.get(update)
            if tail is not None and tail[1] == link.relay_as:
                del self._tails[update]
