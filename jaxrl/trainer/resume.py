"""What an RL checkpoint holds beside the trainer's arrays, typed: the rollout stream's
position, the rollouts generated and not yet trained on, the groups in flight (redone or
continued on resume), the pipeline's iterator, the metrics' running totals. Saved as the
checkpoint's data item (JSON) with a `layout` number; a checkpoint of a layout this version
cannot read is refused with an error that names both."""

from __future__ import annotations

import dataclasses

from jaxrl.train.checkpoint import CheckpointError

LAYOUT = 1    # 0: the same keys, written before the layout was numbered (read as 1)


@dataclasses.dataclass
class ResumeState:
    position: int = 0                 # rollouts of the stream trained on so far
    rollouts: list = dataclasses.field(default_factory=list)   # generated, not trained on
    redo: list = dataclasses.field(default_factory=list)       # problems of groups in flight
    partial: dict = dataclasses.field(default_factory=dict)    # their tokens so far
    next_problem: int = 0             # the actor's next problem index
    stats: dict | None = None         # the actor's counters
    iterator: dict | None = None      # the rollout pipeline's iterator state
    lag_stats: dict | None = None     # per-length lag statistics
    trained: int = 0                  # samples trained on
    time_s: float = 0.0               # the run's wall time so far, evaluation left out
    eval_before: float | None = None  # held-out accuracy before RL

    @classmethod
    def from_saved(cls, data: dict | None, where: str = "the checkpoint") -> "ResumeState":
        """The state a checkpoint saved (None: a warm-up checkpoint, RL starts afresh)."""
        if data is None:
            return cls()
        data = dict(data)
        layout = data.pop("layout", 0)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if layout not in (0, LAYOUT) or unknown:
            what = (f"layout {layout}" if layout not in (0, LAYOUT)
                    else f"unknown fields {unknown}")
            raise CheckpointError(
                f"{where} holds RL state of {what}; this version of jaxrl reads layout "
                f"{LAYOUT} (and the unnumbered one before it): resume it with the jaxrl that "
                f"wrote it")
        return cls(**data)

    def to_saved(self) -> dict:
        return {**dataclasses.asdict(self), "layout": LAYOUT}
