"""A member of the rollout fleet: a generation engine (this process's orchestrator or a
`jaxrl serve` process) and where it stands. Only the fleet (jaxrl/rollout/fleet.py) moves a
member from one state to another."""

from __future__ import annotations

import dataclasses
import enum

from serving.fleet.generation import Generation


class MemberState(enum.Enum):
    """Where a member stands. Its transitions are the fleet's alone:

        JOINING --(pushed the newest weights: `advanced`)--> READY
        JOINING, READY --(a failure: `set_aside`)--> SET_ASIDE
        SET_ASIDE --(answers a heartbeat again)--> JOINING, or READY if it has the weights
        READY --(its devices go back to training: `withdraw`)--> RESTING
        RESTING --(the trainer waits for data: `lend`)--> READY

    Only a member tagged "train" as well as "generate" (the trainer's own devices,
    rl.multiplex) rests.
    """

    JOINING = "joining"        # answers, and is being brought to the newest weights
    READY = "ready"            # takes work
    SET_ASIDE = "set aside"    # failed or not reached yet: no work; a remote one rejoins
    RESTING = "resting"        # its devices train: no work, kept at the newest weights


@dataclasses.dataclass(eq=False)
class Member:
    """A generation engine of the fleet. Whoever builds one sets where it starts (`state`,
    `why_down`); from then on only the fleet moves it."""

    name: str
    generation: Generation
    slots: int
    remote: bool
    # The version of this trainer's weights it serves; None until it has been given them (a
    # server's own start-up weights, or a version from before a trainer restart, do not count).
    version: int | None = None
    state: MemberState = MemberState.JOINING
    why_down: str | None = None     # why it was set aside
    outstanding: int = 0            # samples submitted to it and not finished
    failures: int = 0
    last_metrics: dict = dataclasses.field(default_factory=dict)
    streams: set = dataclasses.field(default_factory=set)   # its groups in progress
    counted: dict = dataclasses.field(default_factory=dict)  # counters before a restart
    # What its devices do (SeamlessFlow's capability tags): "generate", and "train" for the
    # trainer's own devices, which generate only while the trainer waits (rl.multiplex).
    tags: frozenset = frozenset({"generate"})

    @property
    def ready(self) -> bool:
        return self.state is MemberState.READY

    @property
    def alive(self) -> bool:
        """It answers (joining, ready or resting)."""
        return self.state is not MemberState.SET_ASIDE

    @property
    def trains(self) -> bool:
        return "train" in self.tags
