"""A group: one problem's n rollouts, the unit the actor submits, scores and logs."""

from __future__ import annotations

import dataclasses

from jaxrl.rl.tasks.base import Problem


@dataclasses.dataclass(frozen=True)
class Group:
    """A group as chosen: its problem's index in the run's stream, the problem, its prompt's
    tokens and the group's sampling seed."""

    index: int
    problem: Problem
    prompt: list[int]
    seed: int
