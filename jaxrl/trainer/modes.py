"""How generation and training take turns in an RL run (`rl.mode`), as one interface the RL
loop (jaxrl/trainer/rl.py) calls at three points: once before the first step (`start`), before
each batch is taken (`before_batch`), and around each train step and weight publish
(`stepping`).

- async (PipelineRL): the actor keeps every slot busy; the engines swap each new version in
  between two decode steps, so sequences in flight continue under the new weights.
- sync (conventional RL): generate one step's samples with fixed weights, train, publish,
  repeat; the engines idle while the trainer trains and the trainer while they generate.
- partial (sync with partial rollouts): the actor keeps the engines full as in async mode, but
  every engine pauses while the trainer steps (a server through its leased Pause call);
  sequences unfinished when a batch is complete keep their tokens and continue under the new
  weights after the step.
"""

from __future__ import annotations

import contextlib

from jaxrl.data.rollouts import RolloutLog, source_position


class Mode:
    def __init__(self, actor, publisher, batches, rollout_log: RolloutLog, batch_size: int,
                 fleet=None):
        self.actor, self.publisher, self.batches = actor, publisher, batches
        self.rollout_log, self.batch_size, self.fleet = rollout_log, batch_size, fleet

    def start(self) -> None:
        """Before the first step."""

    def before_batch(self, step: int) -> None:
        """Before the trainer takes the batch of step `step + 1`."""

    @contextlib.contextmanager
    def stepping(self):
        """Around one train step and the publish of its weights."""
        yield


class Sync(Mode):
    def before_batch(self, step: int) -> None:
        self.publisher.wait(step)            # every engine serves the weights of `step`
        trained = source_position(self.batches.get_state())
        self.actor.generate(max(0, self.batch_size - (self.rollout_log.end - trained)))


class Async(Mode):
    def start(self) -> None:
        self.actor.start()


# A server paused for a step resumes by itself after this long: a trainer that dies mid-step
# does not leave its servers paused (a step that takes longer only overlaps generation).
PAUSE_LEASE_S = 600.0


class Partial(Async):
    @contextlib.contextmanager
    def stepping(self):
        self.fleet.pause(PAUSE_LEASE_S)
        try:
            yield
        finally:
            self.fleet.resume()


MODES = {"sync": Sync, "async": Async, "partial": Partial}
