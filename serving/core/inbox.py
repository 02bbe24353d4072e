"""What other threads queue for the engine loop (serving/core/engine_loop.py) to do between two of
its calls: weights to swap in, tokens to score. Each carries the event its caller waits on."""

from __future__ import annotations

import dataclasses
import threading


@dataclasses.dataclass
class Update:
    """Weights queued for the loop to swap in; `applied` is set once they serve. `adapters`:
    `params` holds a LoRA model's adapters alone, swapped in over the serving base."""
    params: object
    version: int
    applied: threading.Event = dataclasses.field(default_factory=threading.Event)
    adapters: bool = False
    pause_s: float = 0.0
    retired: object = None      # the weights it replaced, freed off the decode path


@dataclasses.dataclass
class Score:
    """Tokens queued for the loop to score (Engine.score) between two of its calls; `done` is
    set once `result` or `error` is."""
    tokens: list[int]
    adapter: int = 0                  # the LoRA adapter set scoring them (several held)
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    result: tuple | None = None
    error: BaseException | None = None
