"""Pipeline schedule tables: which op each stage runs at each tick, as data.

A schedule splits the layer stack into K = p*v chunks (virtual stages) of equal size, places
v of them on each of the p stages (devices), and gives every stage a row of ticks. At a tick a
stage runs one op on one (chunk, microbatch), or idles:

- F: the chunk's forward; the last chunk's F also runs the head (norm, logits, loss) and its
     backward, so the cotangent for that chunk's B is ready as soon as F ends.
- B: the chunk's input gradient (sent to the previous chunk); its weight gradient is left to W.
- W: the chunk's weight gradient (ZB's split: B is on the critical path, W is not).
- X: B and W as one op (1F1B without the split); it takes two ticks.
- R: the frozen reference model's forward of the chunk (PipeFill, `with_reference`): no
     activations kept, no backward; the last chunk's R also runs the reference head, whose
     log-probs the same microbatch's head (the KL term) reads, so R of the last chunk precedes
     that chunk's F.

Tables come from per-stage op orders run as soon as possible (zb-h1's from its paper,
interleaved's from Megatron-LM) or from a list scheduler (`_list_schedule`: 1f1b and the V
schedules) run with the schedule's placement, op priority and activation cap. Time is in ticks
of one F (F = B = W = R = 1, X = 2, the papers' unit); an op's output reaches its consumer at the tick after the op ends. A (chunk,
microbatch) holds activations from its F until its W (or X) ends; activation memory is counted
in units of one stage's activations for one microbatch (a chunk holds 1/v of that).

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
               activation cap of p/2 (v-half), p/3 (v-min) or p (v-zb) stage-microbatches.
               Each table is the better of two constructions under that cap: the paper's
               repeating building block (`_repeated_v_block`, found by modulo scheduling
               rather than drawn by hand) and the list scheduler; the bubbles they reach are
               reported, not assumed (`bubble`, `peak`, `weighted_bubble`).
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

import numpy as np

TABLE_SCHEDULES = ("1f1b", "interleaved", "zb-h1", "v-half", "v-min", "v-zb")
V_SCHEDULES = ("v-half", "v-min", "v-zb")
OPS = ("idle", "F", "B", "W", "X", "busy", "R")  # op codes; `busy` is X's second tick
IDLE, F, B, W, X, BUSY, R = range(len(OPS))
TICKS = {F: 1, B: 1, W: 1, X: 2, R: 1}


@dataclasses.dataclass(frozen=True)
class Op:
    kind: int        # F, B, W, X or R
    chunk: int       # virtual stage k in 0..K-1
    microbatch: int


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A schedule table. `rows[s][t]` is stage s's op at tick t (None: idle, or X's second
    tick); `placement[k] = (stage, local chunk)`; `bound` the stated activation cap per stage,
    in stage-microbatches."""

    name: str
    stages: int
    microbatches: int
    chunks_per_stage: int
    placement: tuple[tuple[int, int], ...]
    rows: tuple[tuple[Op | None, ...], ...]
    bound: Fraction

    @property
    def split(self) -> bool:
        """Whether the backward is split into B and W (else one X per chunk and microbatch)."""
        return any(op is not None and op.kind == B for row in self.rows for op in row)

    @property
    def reference(self) -> bool:
        """Whether the table runs the reference model's forward (R ops, `with_reference`)."""
        return any(op is not None and op.kind == R for row in self.rows for op in row)

    @property
    def chunks(self) -> int:
        return self.stages * self.chunks_per_stage

    @property
    def ticks(self) -> int:
        return len(self.rows[0])

    def start(self) -> dict[Op, int]:
        """The tick each op starts at."""
        return {op: t for row in self.rows for t, op in enumerate(row) if op is not None}

    def bubble(self) -> float:
        """Idle stage-ticks over all stage-ticks (F = B = W = R = 1, X = 2)."""
        return self.idle() / (self.stages * self.ticks)

    def idle(self) -> int:
        """Idle stage-ticks."""
        work = sum(TICKS[op.kind] for row in self.rows for op in row if op is not None)
        return self.stages * self.ticks - work

    def live(self) -> list[list[Fraction]]:
        """Activations each stage holds after every tick, in stage-microbatches."""
        unit = Fraction(1, self.chunks_per_stage)
        out = []
        for row in self.rows:
            held, trace = Fraction(0), []
            for op in row:
                if op is not None and op.kind == F:
                    held += unit
                trace.append(held)
                if op is not None and op.kind in (W, X):
                    held -= unit
            out.append(trace)
        return out

    def peak(self) -> Fraction:
        """The most activations any stage holds at once, in stage-microbatches."""
        return max(max(trace) for trace in self.live())

    def render(self) -> str:
        """The table as text: one line per stage, one cell per tick (`F3` forward of
        microbatch 3 (R3 the reference model's), lower case for a V's second chunk or an
        interleaved chunk past the first,
        `.` idle, `=` the second tick of an X)."""
        lines = []
        for s, row in enumerate(self.rows):
            cells = []
            for t, op in enumerate(row):
                if op is None:
                    cells.append("=" if t and row[t - 1] is not None and row[t - 1].kind == X
                                 else ".")
                    continue
                name = OPS[op.kind]
                if self.placement[op.chunk][1]:
                    name = name.lower()
                cells.append(f"{name}{op.microbatch}")
            width = max(len(c) for c in cells)
            lines.append(f"stage {s}: " + " ".join(c.rjust(width) for c in cells))
        return "\n".join(lines)


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
    split = name not in ("1f1b", "interleaved")
    if name == "1f1b":
        caps = [p - s for s in range(p)]                      # chunk-microbatches per stage
    elif name == "zb-h1":                                     # 1F1B's peak, on every stage
        caps = [p] * p
    elif name == "interleaved":
        caps = [min(v * m, (p - s - 1) * 2 + (v - 1) * p + 1) for s in range(p)]
    else:
        share = {"v-half": Fraction(1, 2), "v-min": Fraction(1, 3), "v-zb": Fraction(1)}[name]
        caps = [max(2, math.floor(2 * p * share))] * p        # each chunk is half a stage
    bound = Fraction(max(caps), v)
    make = lambda rows: Schedule(name, p, m, v, placement(name, p, v), rows, bound)  # noqa: E731
    if name == "interleaved":
        sched = make(_rows_from_orders(_interleaved_orders(p, m, v), p * v))
    elif name == "zb-h1":
        sched = make(_rows_from_orders(_zb_h1_orders(p, m), p))
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
        sched = make(_rows_from_orders(_v_block_orders(p, m, d), 2 * p))
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


def with_reference(sched: Schedule) -> Schedule:
    """PipeFill: `sched` with the frozen reference model's forward of every (chunk,
    microbatch) added as R ops, in the ticks the schedule leaves idle where their deadlines
    allow (R of microbatch j's last chunk must end before that chunk's F, whose head reads the
    reference log-probs), else as few extra ticks as the fill finds. Each stage keeps its own
    ops in the schedule's order, so the activation peak is unchanged. How much of the R work
    cost no time: `absorbed`."""
    # Candidates: the fill at a few urgencies, and the reference pass run first on its own
    # (what a fill must beat).
    own_pass = [sorted((Op(R, op.chunk, op.microbatch) for op in row if op is not None
                        and op.kind == F), key=lambda op: (op.microbatch, op.chunk))
                + [op for op in row if op is not None] for row in sched.rows]
    best = _rows_from_orders(own_pass, sched.chunks)
    for slack in range(4):
        rows = _fill_reference(sched, slack)
        if len(rows[0]) <= len(best[0]):
            best = rows
    filled = dataclasses.replace(sched, rows=best)
    check(filled)
    return filled


def _fill_reference(sched: Schedule, slack: int):
    """Tick by tick, each stage runs whichever is more urgent of its next own op (when its
    inputs have arrived) and its most urgent ready R op; an own op is due at its tick in
    `sched`, R of chunk k for microbatch j `K - k + slack` ticks before the last chunk's F of j.
    A stage whose next own op is not ready runs an R op if one is ready (the fill)."""
    K, m, p = sched.chunks, sched.microbatches, sched.stages
    start = sched.start()
    back = B if sched.split else X

    def due(op):
        if op.kind != R:
            return start[op]
        return start[Op(F, K - 1, op.microbatch)] - (K - op.chunk) - slack

    orders = [[op for op in row if op is not None] for row in sched.rows]
    refs = [sorted((Op(R, k, j) for k in range(K) if sched.placement[k][0] == s
                    for j in range(m)), key=due) for s in range(p)]
    total = sum(map(len, orders)) + sum(map(len, refs))
    end: dict[Op, int] = {}
    rows: list[list[Op | None]] = [[] for _ in range(p)]
    pos = [0] * p
    t = 0
    while len(end) < total:
        if t > 4 * total + 64:
            raise RuntimeError(f"{sched.name}: the reference fill did not converge")
        for s in range(p):
            if len(rows[s]) > t:                  # the second tick of an X
                continue
            ready = lambda op: all(end.get(d, t + 1) <= t  # noqa: E731
                                   for d in _dependencies(op, K, back, True))
            own = orders[s][pos[s]] if pos[s] < len(orders[s]) else None
            ref = next((r for r in refs[s] if ready(r)), None)
            choices = [op for op in (own, ref) if op is not None and ready(op)]
            if not choices:
                rows[s].append(None)
                continue
            op = min(choices, key=due)
            if op is own:
                pos[s] += 1
            else:
                refs[s].remove(op)
            rows[s].extend([op] + [None] * (TICKS[op.kind] - 1))
            end[op] = t + TICKS[op.kind]
        t += 1
    width = max(len(r) for r in rows)
    return tuple(tuple(r + [None] * (width - len(r))) for r in rows)


def absorbed(base: Schedule, filled: Schedule, costs: dict[str, float] | None = None) -> float:
    """The share of the reference forward's work that `filled` (`with_reference(base)`) runs
    in `base`'s idle time: 1 - (stages x added makespan) / R work. With `costs` (F, B, W and
    R, measured) the makespans are those of `weighted_makespan`, else in ticks."""
    r_work = sum(op.kind == R for row in filled.rows for op in row if op is not None)
    if costs is None:
        added, unit = filled.ticks - base.ticks, 1.0
    else:
        added, unit = weighted_makespan(filled, costs) - weighted_makespan(base, costs), costs["R"]
    return 1 - base.stages * added / (r_work * unit)


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
    """Greedy list scheduling: every tick, each free stage runs its most urgent ready op.
    Urgency: B (or X) first, the deepest chunk first (it frees memory and feeds the stage
    below); then F, deepest chunk first, if the stage is under its activation cap; then W (the
    oldest). In-order per chunk: microbatch j's F (B) of a chunk follows j-1's."""
    K = len(place)
    local = [[k for k in range(K) if place[k][0] == s] for s in range(p)]
    done: dict[Op, int] = {}                 # op -> first tick its output can be used
    next_f, next_b = [0] * K, [0] * K
    pending_w: list[list[Op]] = [[] for _ in range(p)]
    # Activations held or reserved per stage, in chunk-microbatches: a microbatch's first F on
    # a stage reserves room for all its chunks there, so a stage never fills with microbatches
    # that cannot reach their deeper chunks (a V's or an interleaved schedule's deadlock).
    held, free_at = [0] * p, [0] * p
    first_local = [min(ks) for ks in local]
    rows: list[list[Op | None]] = [[] for _ in range(p)]
    total = K * m * (3 if split else 2)
    t = 0
    while len(done) < total:
        if t > 8 * total + 64:
            raise RuntimeError(f"schedule did not converge (caps {caps})")
        for s in range(p):
            if free_at[s] > t:
                continue
            room = held[s] + len(local[s]) <= caps[s]
            op = _pick(s, t, local[s], first_local[s], K, m, done, next_f, next_b,
                       pending_w[s], room, split)
            if op is None:
                rows[s].append(None)
                continue
            ticks = TICKS[op.kind]
            rows[s].extend([op] + [None] * (ticks - 1))
            free_at[s] = t + ticks
            done[op] = t + ticks
            if op.kind == F:
                next_f[op.chunk] += 1
                held[s] += len(local[s]) if op.chunk == first_local[s] else 0
            elif op.kind in (B, X):
                next_b[op.chunk] += 1
                if op.kind == B:
                    pending_w[s].append(Op(W, op.chunk, op.microbatch))
            if op.kind in (W, X):
                # Freed when the op ends; counted as free for picks from the next tick on
                # (the op itself runs while the activations are still held).
                held[s] -= 1
        t += 1
    width = max(len(r) for r in rows)
    return tuple(tuple(r + [None] * (width - len(r))) for r in rows)


def _pick(s, t, chunks, first, K, m, done, next_f, next_b, pending_w, room, split):
    ready = lambda op: op in done and done[op] <= t  # noqa: E731
    for k in sorted(chunks, reverse=True):
        j = next_b[k]
        if j < m and ready(Op(F, k, j)) and (k == K - 1 or _backward_done(k + 1, j, done, t)):
            return Op(B if split else X, k, j)
    for k in sorted(chunks, reverse=True):
        j = next_f[k]
        if j < m and (k == 0 or ready(Op(F, k - 1, j))) and (room or k != first):
            return Op(F, k, j)
    for w in pending_w:
        if ready(Op(B, w.chunk, w.microbatch)):
            pending_w.remove(w)
            return w
    return None


def _backward_done(k, j, done, t) -> bool:
    for kind in (B, X):
        op = Op(kind, k, j)
        if op in done:
            return done[op] <= t
    return False


def check(sched: Schedule) -> None:
    """ValueError unless the table is a valid schedule: every (chunk, microbatch) has one F
    and one B and W (or one X) on the chunk's stage; F follows the previous chunk's F, B
    follows its own F and the next chunk's B, W follows B, each op starting after its input's
    op has ended; no stage ever holds more activations than the schedule's bound. With R ops:
    one per (chunk, microbatch), each after the previous chunk's R, and the last chunk's F
    after its R."""
    start = sched.start()
    K, m = sched.chunks, sched.microbatches
    end = {op: t + TICKS[op.kind] for op, t in start.items()}
    split, reference = sched.split, sched.reference
    for s, row in enumerate(sched.rows):
        for op in row:
            if op is not None and sched.placement[op.chunk][0] != s:
                raise ValueError(f"{sched.name}: {op} runs on stage {s}, not its chunk's stage")

    def after(op, dep):
        if dep not in start:
            raise ValueError(f"{sched.name}: {op} depends on {dep}, which never runs")
        if start[op] < end[dep]:
            raise ValueError(f"{sched.name}: {op} at tick {start[op]} starts before {dep} "
                             f"ends at tick {end[dep]}")

    for k in range(K):
        for j in range(m):
            f = Op(F, k, j)
            back = Op(B if split else X, k, j)
            if f not in start or back not in start:
                raise ValueError(f"{sched.name}: chunk {k}, microbatch {j} lacks an F or B")
            if k:
                after(f, Op(F, k - 1, j))
            after(back, f)
            if k < K - 1:
                after(back, Op(B if split else X, k + 1, j))
            if split:
                after(Op(W, k, j), back)
            if reference:
                ref = Op(R, k, j)
                if k:
                    after(ref, Op(R, k - 1, j))
                if k == K - 1:
                    after(f, ref)
    ops = sum(op is not None for row in sched.rows for op in row)
    if ops != K * m * ((3 if split else 2) + reference):
        raise ValueError(f"{sched.name}: {ops} ops for {K} chunks x {m} microbatches")
    if sched.peak() > sched.bound:
        raise ValueError(f"{sched.name}: a stage holds {sched.peak()} stage-microbatches of "
                         f"activations, above the bound {sched.bound}")


def _dependencies(op: Op, K: int, back: int, reference: bool = False) -> list[Op]:
    """The ops whose output `op` reads (`reference`: the table has R ops)."""
    if op.kind in (F, R):
        deps = [Op(op.kind, op.chunk - 1, op.microbatch)] if op.chunk else []
        if op.kind == F and reference and op.chunk == K - 1:
            deps.append(Op(R, op.chunk, op.microbatch))
        return deps
    if op.kind == W:
        return [Op(B, op.chunk, op.microbatch)]
    deps = [Op(F, op.chunk, op.microbatch)]
    if op.chunk < K - 1:
        deps.append(Op(back, op.chunk + 1, op.microbatch))
    return deps


def _run_in_order(orders: list[list[Op]], K: int, cost: dict[int, float]) -> dict[Op, float]:
    """Start time of every op when each stage runs its ops in the given order, each as soon as
    the stage is free and its inputs have arrived (a dataflow run, no lock step)."""
    split = any(op.kind == B for row in orders for op in row)
    reference = any(op.kind == R for row in orders for op in row)
    back = B if split else X
    start: dict[Op, float] = {}
    end: dict[Op, float] = {}
    pos, clock = [0] * len(orders), [0.0] * len(orders)
    while any(pos[s] < len(orders[s]) for s in range(len(orders))):
        moved = False
        for s, order in enumerate(orders):
            while pos[s] < len(order):
                op = order[pos[s]]
                deps = _dependencies(op, K, back, reference)
                if any(d not in end for d in deps):
                    break
                start[op] = max([clock[s], *(end[d] for d in deps)])
                clock[s] = end[op] = start[op] + cost[op.kind]
                pos[s] += 1
                moved = True
        if not moved:
            raise ValueError("the stages' op orders deadlock")
    return start


def _rows_from_orders(orders: list[list[Op]], K: int):
    """The tick table of per-stage op orders run as soon as possible in unit ticks."""
    start = _run_in_order(orders, K, TICKS)
    width = max(int(start[op]) + TICKS[op.kind] for row in orders for op in row)
    rows = [[None] * width for _ in orders]
    for s, order in enumerate(orders):
        for op in order:
            rows[s][int(start[op])] = op
    return tuple(tuple(r) for r in rows)


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


def _weighted_run(sched: Schedule, costs: dict[str, float]):
    """(makespan, work) when each stage runs its row's ops in order as soon as their inputs
    arrive (no lock step), an op taking `costs['F' | 'B' | 'W' | 'R']` (X = B + W; R defaults
    to F)."""
    cost = {F: costs["F"], B: costs["B"], W: costs["W"], X: costs["B"] + costs["W"],
            R: costs.get("R", costs["F"])}
    orders = [[op for op in row if op is not None] for row in sched.rows]
    start = _run_in_order(orders, sched.chunks, cost)
    makespan = max(start[op] + cost[op.kind] for op in start)
    return makespan, sum(cost[op.kind] for op in start)


def weighted_makespan(sched: Schedule, costs: dict[str, float]) -> float:
    """The step's length in the units of `costs` when its ops take those costs (see
    `weighted_bubble`)."""
    return _weighted_run(sched, costs)[0]


def weighted_bubble(sched: Schedule, costs: dict[str, float]) -> float:
    """The bubble when each stage runs its row's ops in order as soon as their inputs arrive
    (no lock step), an op taking `costs['F' | 'B' | 'W']` (X = B + W): idle time over
    stages x makespan. With unit costs this is the table's own bubble or less."""
    makespan, work = _weighted_run(sched, costs)
    return 1 - work / (sched.stages * makespan) if makespan else 0.0


def as_arrays(sched: Schedule) -> dict[str, np.ndarray]:
    """The table as int32 arrays [ticks, stages] for the per-stage programs, with the buffer
    slots every op reads and writes (allocated here, so the program's buffers are exactly as
    large as the table needs):
    op, chunk (local), microbatch, first (chunk 0), last (chunk K-1);
    in_slot: the inbox slot F or R (chunks > 0) or B/X reads; res_slot: the activation slot F
    writes and B/X/W read; w_slot: the slot B writes its per-layer cotangents to and W reads;
    send (0 none, 1 next stage, 2 previous stage, 3 this stage) and send_slot: where the op's
    output goes in the receiver's inbox. Also the slot counts."""
    p, K = sched.stages, sched.chunks
    start = sched.start()
    split = sched.split
    back = B if split else X
    end = {op: t + TICKS[op.kind] for op, t in start.items()}
    fields = ("op", "chunk", "microbatch", "first", "last", "in_slot", "res_slot", "w_slot",
              "send", "send_slot")
    arr = {f: np.zeros((sched.ticks, p), np.int32) for f in fields}
    pools = {name: [_Pool() for _ in range(p)] for name in ("inbox", "res", "w")}
    stage = lambda k: sched.placement[k][0]  # noqa: E731
    # Messages: F(k) -> F(k+1)'s inbox, last F -> its own B (the head's cotangent), B(k) ->
    # B(k-1), R(k) -> R(k+1). A message is written at the end of its op's first tick and read
    # when the consumer starts.
    inbox_slot: dict[tuple[Op, Op], int] = {}
    for op, t in sorted(start.items(), key=lambda kv: kv[1]):
        consumer = None
        if op.kind == F:
            consumer = Op(F, op.chunk + 1, op.microbatch) if op.chunk < K - 1 else \
                Op(back, op.chunk, op.microbatch)
        elif op.kind == back and op.chunk > 0:
            consumer = Op(back, op.chunk - 1, op.microbatch)
        elif op.kind == R and op.chunk < K - 1:
            consumer = Op(R, op.chunk + 1, op.microbatch)
        if consumer is not None:
            dest = stage(consumer.chunk)
            slot = pools["inbox"][dest].take(t, start[consumer])
            inbox_slot[(op, consumer)] = slot
            s = stage(op.chunk)
            arr["send"][t, s] = 3 if dest == s else 1 if dest == (s + 1) % p else 2
            if dest not in (s, (s + 1) % p, (s - 1) % p):
                raise ValueError(f"{sched.name}: {op} sends to stage {dest}, not a neighbour")
            arr["send_slot"][t, s] = slot
    for op, t in start.items():
        s, (_, c) = stage(op.chunk), sched.placement[op.chunk]
        arr["op"][t, s], arr["chunk"][t, s], arr["microbatch"][t, s] = op.kind, c, op.microbatch
        arr["first"][t, s], arr["last"][t, s] = op.chunk == 0, op.chunk == K - 1
        j = op.microbatch
        if op.kind == F:
            if op.chunk:
                arr["in_slot"][t, s] = inbox_slot[(Op(F, op.chunk - 1, j), op)]
            freed = end[Op(W, op.chunk, j)] - 1 if split else end[Op(X, op.chunk, j)] - 1
            arr["res_slot"][t, s] = pools["res"][s].take(t, freed)
        elif op.kind == R and op.chunk:
            arr["in_slot"][t, s] = inbox_slot[(Op(R, op.chunk - 1, j), op)]
        elif op.kind == back:
            producer = Op(F, op.chunk, j) if op.chunk == K - 1 else Op(back, op.chunk + 1, j)
            arr["in_slot"][t, s] = inbox_slot[(producer, op)]
            if split:
                arr["w_slot"][t, s] = pools["w"][s].take(t, start[Op(W, op.chunk, j)])
    # Second pass: B/X/W read the activation slot their F wrote, W the slot its B wrote.
    for op, t in start.items():
        s = stage(op.chunk)
        if op.kind in (B, X, W):
            f = Op(F, op.chunk, op.microbatch)
            arr["res_slot"][t, s] = arr["res_slot"][start[f], s]
        if op.kind == W:
            b = Op(B, op.chunk, op.microbatch)
            arr["w_slot"][t, s] = arr["w_slot"][start[b], s]
    arr["slots"] = {name: max(1, max(pool.size for pool in pools[name])) for name in pools}
    return arr


class _Pool:
    """Buffer slots on one stage, each held over an interval of ticks [first, last]."""

    def __init__(self):
        self.busy_until: list[int] = []

    @property
    def size(self) -> int:
        return len(self.busy_until)

    def take(self, first: int, last: int) -> int:
        for i, until in enumerate(self.busy_until):
            if until < first:
                self.busy_until[i] = last
                return i
        self.busy_until.append(last)
        return len(self.busy_until) - 1
