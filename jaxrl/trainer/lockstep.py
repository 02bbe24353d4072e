"""Process 0 decides, every process follows: how the RL loop runs on several hosts.

On `jax.distributed` every process runs the trainer's collectives (the train step, the gather
of the weights to publish, the checkpoint) on the global mesh, but only process 0 runs the
actor, the rollout pipeline, the weight pushes, evaluation and metrics. Between two collectives
the others wait at the next `share`, where process 0 hands them what it decided (the next
batch, whether to checkpoint).

If process 0 fails in its own part (an unreachable fleet, a failed evaluation), the others are
waiting at a `share`: `abort` sends them a stop there, so they end with a clear error instead of
waiting for a broadcast that never comes. A failure inside a collective fails on every process
by itself. With one process `share` just calls the leader's function.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxrl.errors import UserError


class LeaderStopped(UserError):
    """Process 0 stopped the run (its own output says why): one line from the others."""


class Lockstep:
    def __init__(self):
        self.processes = jax.process_count()
        self.leader = jax.process_index() == 0
        self._in_collective = False
        self._aborted = False

    def share(self, decide: Callable[[], dict], like: dict) -> dict:
        """Process 0's `decide()` (a dict of arrays), on every process. The others pass the
        same `like` (arrays of the same shapes and dtypes) and never call `decide`."""
        if self.processes == 1:
            return decide()
        value = decide() if self.leader else like
        with self.collective():      # a header of one shape first, so `abort` can answer it
            self._go()
            return multihost_utils.broadcast_one_to_all(value)

    def sync(self) -> None:
        """A `share` of nothing: every process passes here together (before a collective that
        follows process 0's own work), or stops if process 0 failed in it."""
        if self.processes > 1:
            with self.collective():
                self._go()

    def _go(self) -> None:
        go = multihost_utils.broadcast_one_to_all(np.ones((), np.int32))
        if not int(go):
            raise LeaderStopped("process 0 stopped the run; its output says why")

    @contextlib.contextmanager
    def collective(self):
        """Marks work every process does together: a failure inside it is not process 0's
        alone, so it sends no abort."""
        self._in_collective = True
        try:
            yield
        finally:
            self._in_collective = False

    def abort(self) -> None:
        """On process 0, after a failure of its own between collectives: releases the others
        from the `share` they wait at."""
        if self.processes == 1 or not self.leader or self._in_collective or self._aborted:
            return
        self._aborted = True
        multihost_utils.broadcast_one_to_all(np.zeros((), np.int32))
