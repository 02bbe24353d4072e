"""HelixPipe's schedule (Zhang et al. 2025, arXiv 2507.00394) as data: which stage runs which
part of which layer for which microbatch, round by round, and the bubble that follows.

A layer is cut around its attention (jaxrl/models/layer_parts.py): the weighted part before it
(norm, q/k/v projections) and after it (output projection, MLP) stay on the stage that holds
the weights, while the attention, which has no weights, may run anywhere. HelixPipe puts a
stage boundary inside every layer's attention: boundary i runs the end of layer i-1 and the
start of layer i (a "P op": post(i-1) then pre(i); boundary 0 is pre(0) alone, boundary L is
post(L-1) and the head), on stage i mod p, so each stage holds the input side of layers
s, s+p, ... and the output side of layers s-1, s-1+p, ... .

Attention parallel partition. Microbatches travel in waves of p*f (p stages, f folds); within
a wave, microbatch slot d*f + e (offset d, fold e) sends boundary i's queries, keys and
values to stage (i + d + 1) mod p, whose "A op" computes the attention and sends the result
on to stage i+1, the next boundary's. The p offsets of a wave therefore compute the attention
of one layer on p different stages at once, while the weighted parts of that layer run on
one stage: the pipeline's ramp costs p weighted parts, not p attentions, which is where a
long sequence spends its time.

Rounds. Round r is, for each offset d in turn, every stage's P ops for d's f folds and then
every stage's A ops for them; a stage runs the wave whose boundary it holds this round. Every
stage sends with the same shift in the same slot (P to A: d+1, A to P: -d), so each slot's
messages are one collective permute. Wave g enters at round g mod p of its generation
(generations of p waves, `start`), so with p waves in flight every stage has a wave every
round. The backward runs the rounds in reverse (first in, last out, both folds: the two-fold
FILO order), A ops before P ops in each slot: boundary i+1's backward hands the attention's
output gradient to the A op of layer i, which hands the q/k/v gradients to boundary i.

What a stage keeps from forward to backward: each P op's input (the residual stream and the
attention output it received) and each A op's q, k and v. The backward recomputes each
weighted part from its input and never recomputes an attention to do so ("recomputation
without attention"); the A op's own backward recomputes its forward from q, k, v, as a
rematerialised flash attention does (departure: the paper keeps the attention's softmax
statistics too). The dense MLP can run in pieces of the sequence (`model.mlp_chunks`, the
paper's chunked MLP).

Departures, all from running one SPMD program (every stage in lock step, each message slot a
collective permute) rather than the paper's per-rank send/receive loops: the waves enter in
round-robin rounds (the paper's ranks run ahead as their messages arrive), and the folds of
an offset run back to back inside its slot, so XLA's scheduler, not a second CUDA stream,
overlaps one fold's messages with the next fold's compute.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np


@dataclasses.dataclass(frozen=True)
class HelixPlan:
    """The helix schedule of `microbatches` through `layers` layers on `stages` stages, in
    waves of stages * folds microbatches."""

    stages: int
    layers: int
    microbatches: int
    folds: int = 2

    def __post_init__(self):
        p, f = self.stages, self.folds
        if self.layers % p:
            raise ValueError(f"sharding.pipeline.schedule=helix needs model.num_layers a "
                             f"multiple of the stages: num_layers={self.layers}, stages={p}")
        if f < 1 or self.microbatches % (p * f):
            raise ValueError(f"sharding.pipeline.schedule=helix sends microbatches in waves of "
                             f"stages x folds = {p} x {f}: microbatches={self.microbatches} is "
                             f"not a multiple of {p * f}")

    @property
    def wave(self) -> int:
        """Microbatches per wave: one per (offset, fold) slot."""
        return self.stages * self.folds

    @property
    def waves(self) -> int:
        return self.microbatches // self.wave

    @property
    def slots_per_stage(self) -> int:
        """Boundaries (P ops per microbatch) a stage holds at most: L/p, and stage 0 one more
        (boundary L, the head)."""
        return self.layers // self.stages + 1

    def start(self, g: int) -> int:
        """The round wave g's boundary 0 runs in. Waves enter one per round, p at a time; the
        next p follow once the first has left stage 0's every round (a stage serves one wave
        per round)."""
        p, L = self.stages, self.layers
        return (g // p) * (L + p) + g % p

    @property
    def rounds(self) -> int:
        return self.start(self.waves - 1) + self.layers + 1

    @functools.cached_property
    def owners(self) -> np.ndarray:
        """[rounds, stages] int32: the wave whose boundary each stage runs in each round, -1
        for none. The boundary is then round - start(wave)."""
        own = np.full((self.rounds, self.stages), -1, np.int32)
        for g in range(self.waves):
            for i in range(self.layers + 1):
                r, s = self.start(g) + i, i % self.stages
                if own[r, s] >= 0:
                    raise AssertionError(f"waves {own[r, s]} and {g} meet on stage {s}")
                own[r, s] = g
        return own

    def table(self) -> dict[str, np.ndarray]:
        """The P ops as arrays [rounds, stages] for the program: `wave` (-1 idle) and
        `boundary` (0..L)."""
        own = self.owners
        starts = np.array([self.start(g) for g in range(self.waves)] + [0], np.int32)
        boundary = np.where(own >= 0, np.arange(self.rounds)[:, None] - starts[own], 0)
        return {"wave": own, "boundary": boundary.astype(np.int32)}

    def attention_stage(self, layer: int, slot: int) -> int:
        """The stage that runs layer `layer`'s attention for wave slot `slot`."""
        return (layer + slot // self.folds + 1) % self.stages

    def busy(self) -> tuple[np.ndarray, np.ndarray]:
        """([rounds, stages] whether each stage runs P ops in a round (one per slot), [rounds,
        stages] how many offsets' attention it runs (each `folds` microbatches))."""
        own, p, L = self.owners, self.stages, self.layers
        boundary = self.table()["boundary"]
        p_busy = (own >= 0).astype(np.int32)
        a_count = np.zeros_like(p_busy)
        for r, s in zip(*np.nonzero((own >= 0) & (boundary < L))):
            for d in range(p):
                a_count[r, (s + d + 1) % p] += 1
        return p_busy, a_count

    def step_time(self, param: float, attention: float, backward: float = 3.0) -> float:
        """The step's length when a P op takes `param` and an A op `attention` (per
        microbatch, forward), their backward ops `backward` times that (recomputation plus the
        backward), in lock step: a round's P slots, each as long as a P op wherever one runs,
        then its A ops, as long as the busiest stage's."""
        p_busy, a_count = self.busy()
        p_time = p_busy.max(axis=1).sum() * self.wave * param
        a_time = a_count.max(axis=1).sum() * self.folds * attention
        return (1 + backward) * (p_time + a_time)

    def bubble(self, param: float = 1.0, attention: float = 1.0, backward: float = 3.0) -> float:
        """Idle time over stages x step time (see `step_time`)."""
        p_busy, a_count = self.busy()
        work = (1 + backward) * self.folds * (p_busy.sum() * self.stages * param
                                              + a_count.sum() * attention)
        return 1 - work / (self.stages * self.step_time(param, attention, backward))

    def render(self) -> str:
        """The forward's P ops as text: per stage, per round, `w<wave>:<boundary>` or `.`."""
        tab = self.table()
        cells = [[f"w{g}:{b}" if g >= 0 else "." for g, b in zip(row_g, row_b)]
                 for row_g, row_b in zip(tab["wave"], tab["boundary"])]
        width = max(len(c) for row in cells for c in row)
        return "\n".join(f"stage {s}: " + " ".join(row[s].rjust(width) for row in cells)
                         for s in range(self.stages))
