"""Pipeline schedules: the functions that build each schedule's table (`build`).

A table (`sharding/schedule_table.py`) gives each of the p stages an op per tick on one (chunk,
microbatch): F, B, W, X (B and W as one op) or R (the reference model's forward, PipeFill,
`sharding/pipefill.py`).

Tables come from per-stage op orders run as soon as possible (zb-h1's from its paper,
interleaved's from Megatron-LM) or from a list scheduler (`_list_schedule`: 1f1b and the V
schedules) run with the schedule's placement, op priority and activation cap.

Schedules (p stages, m microbatches):
- 1f1b:        PipeDream-Flush. Stage s keeps at most p-s microbatches in flight.
- interleaved: Megatron's interleaved 1F1B: v chunks per stage, chunk k on stage k mod p.
- zb-h1:       Zero Bubble H1 (Qi et al. 2023): 1F1B's placement and memory with B and W split;
               stage s runs 1F1B's warm-up, then B, W, F per microbatch with its W's s
               microbatches late, which fills the ramps: p-1 idle ticks per stage, a third of
               1F1B's 3(p-1) (the paper's measure; as a share of the shorter step it is
               (m+p-1)/(3m+p-1) of 1F1B's).
- v-half, v-min, v-zb: the V schedules of "Pipeline Parallelism with Controllable Memory"
               (Qi et al. 2024): two chunks per stage placed in a V (stage s holds chunks s and
               2p-1-s, so the first and last chunk sit on stage 0), F/B/W split, and an
               activation cap of (p+2)//2 (v-half), (p+4)//3 (v-min) or p (v-zb)
               stage-microbatches, the paper's counts (`paper_activations`; about a half and
               a third of 1F1B's p as p grows). Each table is the better of two
               constructions under that cap: the paper's repeating building block
               (`_repeated_v_block`, found by modulo scheduling rather than drawn by hand)
               and the list scheduler; the bubbles they reach are reported, not assumed
               (`bubble`, `peak`, `weighted_bubble`), beside the floor no table under the cap
               can beat (`bubble_floor`), which also shows why the paper rounds V-Min's third
               up: at 4 stages no V table holding a strict third idles as little as 1F1B.
"""

from __future__ import annotations

import math
from fractions import Fraction

from sharding.pipefill import absorbed, with_reference
from sharding.schedule_table import (B, BUSY, F, IDLE, OPS, R, TICKS, W, X, Op, Schedule,
                                     as_arrays, check, rows_from_orders, weighted_bubble,
                                     weighted_makespan)

# The schedules' whole API: tables, their ops and checks, and the reference fill.
__all__ = ["TABLE_SCHEDULES", "V_SCHEDULES", "SPLIT_SCHEDULES", "placement", "build", "Op",
           "Schedule", "OPS", "IDLE", "F", "B", "W", "X", "BUSY", "R", "TICKS", "check", "as_arrays",
           "weighted_bubble", "weighted_makespan", "with_reference", "absorbed",
           "paper_activations"]

TABLE_SCHEDULES = ("1f1b", "interleaved", "zb-h1", "v-half", "v-min", "v-zb")
V_SCHEDULES = ("v-half", "v-min", "v-zb")
SPLIT_SCHEDULES = ("zb-h1", *V_SCHEDULES)    # B and W are separate ops


def paper_activations(name: str, stages: int) -> int | None:
    """The activations a stage holds at the peak, in stage-microbatches (one microbatch's
    activations of a stage's layers), as the controllable-memory paper (Qi et al., arXiv
    2405.15362, table 1) counts its schedules at p stages: 1F1B and ZB-H1 p, V-Half
    (p+2)//2, V-Min (p+4)//3, V-ZB p. None for a schedule it does not count."""
    p = stages
    return {"1f1b": p, "zb-h1": p, "v-half": (p + 2) // 2, "v-min": (p + 4) // 3,
            "v-zb": p}.get(name)


def placement(name: str, stages: int, chunks_per_stage: int) -> tuple[tuple[int, int], ...]:
    """(stage, local chunk) of every virtual stage k."""
    p = stages
    if name in V_SCHEDULES:
        return tuple((k, 0) if k < p else (2 * p - 1 - k, 1) for k in range(2 * p))
    return tuple((k % p, k // p) for k in range(p * chunks_per_stage))


def build(name: str, stages: int, microbatches: int, repeats: int = 1,
          reference: bool = False) -> Schedule:
    """The table of schedule `name` for p stages and m microbatches (`repeats`: chunks per
    stage of `interleaved`; `reference`: with the reference model's forward filled in, see
    `with_reference`). Raises ValueError for a combination the schedule cannot run."""
    p, m = stages, microbatches
    if name not in TABLE_SCHEDULES:
        raise ValueError(f"{name!r} has no schedule table; tables exist for "
                         f"{', '.join(TABLE_SCHEDULES)}")
    v = 2 if name in V_SCHEDULES else repeats if name == "interleaved" else 1
    if name == "interleaved" and (v < 2 or m % p):
        raise ValueError(f"the interleaved schedule needs repeats >= 2 and microbatches a "
                         f"multiple of stages: repeats={v}, microbatches={m}, stages={p}")
    split = name in SPLIT_SCHEDULES
    if name == "1f1b":
        caps = [p - s for s in range(p)]                      # chunk-microbatches per stage
    elif name == "zb-h1":                                     # 1F1B's peak, on every stage
        caps = [p] * p
    elif name == "interleaved":
        caps = [min(v * m, (p - s - 1) * 2 + (v - 1) * p + 1) for s in range(p)]
    else:                               # the paper's counts; each chunk is half a stage
        caps = [2 * paper_activations(name, p)] * p
    bound = Fraction(max(caps), v)
    make = lambda rows: Schedule(name, p, m, v, placement(name, p, v), rows, bound)  # noqa: E731
    if name == "interleaved":
        sched = make(rows_from_orders(_interleaved_orders(p, m, v), p * v))
    elif name == "zb-h1":
        sched = make(rows_from_orders(_zb_h1_orders(p, m), p))
    else:
        sched = make(_list_schedule(p, m, placement(name, p, v), split, caps))
    check(sched)
    if name in V_SCHEDULES:
        repeated = _repeated_v_block(make, p, m)
        if repeated is not None and (repeated.bubble(), repeated.peak()) < (sched.bubble(),
                                                                              sched.peak()):
            sched = repeated
    return with_reference(sched) if reference else sched


def _repeated_v_block(make, p: int, m: int) -> Schedule | None:
    """A V schedule from one repeating building block (the controllable-memory paper's
    construction, found here by modulo scheduling): microbatch 0's 6 ops per stage (F, B, W of
    two chunks) are placed in dependency order, each at the earliest tick whose residue modulo
    the interval d is still free on its stage, and microbatch j repeats them d*j ticks later;
    the per-stage orders that gives are then run as soon as possible. The smallest d whose
    table stays within the schedule's activation cap wins (d = 6 has no steady-state bubble);
    None when none does up to 6p."""
    for d in range(6, 6 * p + 1):
        sched = make(rows_from_orders(_v_block_orders(p, m, d), 2 * p))
        try:
            check(sched)
        except ValueError:
            continue
        return sched
    return None


def _v_block_orders(p: int, m: int, d: int) -> list[list[Op]]:
    K = 2 * p
    stage = lambda k: k if k < p else K - 1 - k  # noqa: E731
    taken: list[set[int]] = [set() for _ in range(p)]
    at: dict[Op, int] = {}

    def place(op, earliest):
        s, t = stage(op.chunk), earliest
        while t % d in taken[s]:
            t += 1
        taken[s].add(t % d)
        at[op] = t
        return t + 1

    t = 0
    for k in range(K):
        t = place(Op(F, k, 0), t)
    for k in reversed(range(K)):
        t = place(Op(B, k, 0), t)
    for k in reversed(range(K)):
        place(Op(W, k, 0), at[Op(B, k, 0)] + 1)
    timed = [[] for _ in range(p)]
    for op, t in at.items():
        for j in range(m):
            timed[stage(op.chunk)].append((t + d * j, Op(op.kind, op.chunk, j)))
    return [[op for _, op in sorted(row, key=lambda x: x[0])] for row in timed]


def _zb_h1_orders(p: int, m: int) -> list[list[Op]]:
    """ZB-H1's op order (Qi et al. 2023, figure 3): stage s warms up with 1F1B's p-s forwards,
    then runs B of microbatch i, W of microbatch i-s and F of microbatch i+p-s for every i,
    and its last s W's at the end. Deferring W by s keeps p microbatches in flight on every
    stage (1F1B's peak) and fills the ramps with W."""
    orders = []
    for s in range(p):
        warm = min(p - s, m)
        order = [Op(F, s, j) for j in range(warm)]
        for i in range(m):
            order.append(Op(B, s, i))
            if i >= s:
                order.append(Op(W, s, i - s))
            if i + warm < m:
                order.append(Op(F, s, i + warm))
        order += [Op(W, s, j) for j in range(max(0, m - s), m)]
        orders.append(order)
    return orders


def _list_schedule(p: int, m: int, place, split: bool, caps: list[int]):
    """Greedy list scheduling (`_ListScheduler`): every tick, each free stage runs its most
    urgent ready op."""
    return _ListScheduler(p, m, place, split, caps).run()


class _ListScheduler:
    """Every tick, each free stage runs its most urgent ready op. Urgency: B (or X) first, the
    deepest chunk first (it frees memory and feeds the stage below); then F, deepest chunk
    first, if the stage is under its activation cap; then W (the oldest). In-order per chunk:
    microbatch j's F (B) of a chunk follows j-1's.

    Activations held or reserved per stage are counted in chunk-microbatches: a microbatch's
    first F on a stage reserves room for all its chunks there, so a stage never fills with
    microbatches that cannot reach their deeper chunks (a V's or an interleaved schedule's
    deadlock)."""

    def __init__(self, p: int, m: int, place, split: bool, caps: list[int]):
        self.p, self.m, self.split, self.caps = p, m, split, caps
        self.K = len(place)
        self.local = [[k for k in range(self.K) if place[k][0] == s] for s in range(p)]
        self.first_local = [min(ks) for ks in self.local]
        self.done: dict[Op, int] = {}            # op -> first tick its output can be used
        self.next_f, self.next_b = [0] * self.K, [0] * self.K
        self.pending_w: list[list[Op]] = [[] for _ in range(p)]
        self.held, self.free_at = [0] * p, [0] * p
        self.rows: list[list[Op | None]] = [[] for _ in range(p)]

    def run(self) -> tuple:
        total = self.K * self.m * (3 if self.split else 2)
        t = 0
        while len(self.done) < total:
            if t > 8 * total + 64:
                raise RuntimeError(f"schedule did not converge (caps {self.caps})")
            for s in range(self.p):
                if self.free_at[s] > t:
                    continue
                op = self._pick(s, t)
                if op is None:
                    self.rows[s].append(None)
                else:
                    self._run(s, op, t)
            t += 1
        width = max(len(r) for r in self.rows)
        return tuple(tuple(r + [None] * (width - len(r))) for r in self.rows)

    def _run(self, s: int, op: Op, t: int) -> None:
        """Stage `s` runs `op` from tick `t`."""
        ticks = TICKS[op.kind]
        self.rows[s].extend([op] + [None] * (ticks - 1))
        self.free_at[s] = t + ticks
        self.done[op] = t + ticks
        if op.kind == F:
            self.next_f[op.chunk] += 1
            if op.chunk == self.first_local[s]:
                self.held[s] += len(self.local[s])
        elif op.kind in (B, X):
            self.next_b[op.chunk] += 1
            if op.kind == B:
                self.pending_w[s].append(Op(W, op.chunk, op.microbatch))
        if op.kind in (W, X):
            # Freed when the op ends; counted as free for picks from the next tick on (the op
            # itself runs while the activations are still held).
            self.held[s] -= 1

    def _pick(self, s: int, t: int) -> Op | None:
        """Stage `s`'s most urgent op that is ready at tick `t`."""
        done, m, K = self.done, self.m, self.K
        ready = lambda op: op in done and done[op] <= t  # noqa: E731
        chunks = sorted(self.local[s], reverse=True)
        for k in chunks:
            j = self.next_b[k]
            if j < m and ready(Op(F, k, j)) and (k == K - 1 or _backward_done(k + 1, j, done, t)):
                return Op(B if self.split else X, k, j)
        room = self.held[s] + len(self.local[s]) <= self.caps[s]
        for k in chunks:
            j = self.next_f[k]
            if j < m and (k == 0 or ready(Op(F, k - 1, j))) and (room or k != self.first_local[s]):
                return Op(F, k, j)
        for w in self.pending_w[s]:
            if ready(Op(B, w.chunk, w.microbatch)):
                self.pending_w[s].remove(w)
                return w
        return None


def _backward_done(k, j, done, t) -> bool:
    for kind in (B, X):
        op = Op(kind, k, j)
        if op in done:
            return done[op] <= t
    return False


def _interleaved_orders(p: int, m: int, v: int) -> list[list[Op]]:
    """Megatron-LM's interleaved 1F1B op order: forwards go through the stage's chunks in
    groups of p microbatches; stage s warms up with (p-s-1)*2 + (v-1)*p forwards, then
    alternates one forward and one backward."""
    def op(kind, s, i, backward):
        c = (i // p) % v
        c = v - 1 - c if backward else c
        return Op(kind, c * p + s, (i // (p * v)) * p + i % p)

    orders = []
    for s in range(p):
        n = v * m
        warm = min((p - s - 1) * 2 + (v - 1) * p, n)
        order = [op(F, s, i, False) for i in range(warm)]
        for i in range(n - warm):
            order += [op(F, s, warm + i, False), op(X, s, i, True)]
        order += [op(X, s, i, True) for i in range(n - warm, n)]
        orders.append(order)
    return orders
