"""A pipeline schedule table: which op each stage runs at each tick, as data, and its checks.

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

Time is in ticks of one F (F = B = W = R = 1, X = 2, the papers' unit); an op's output reaches
its consumer at the tick after the op ends. A (chunk, microbatch) holds activations from its F
until its W (or X) ends; activation memory is counted in units of one stage's activations for
one microbatch (a chunk holds 1/v of that).

A table here is only data and its checks; the schedules that make tables are in
`sharding/schedules.py`, the reference-model fill in `sharding/pipefill.py`.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import numpy as np

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

    def bubble_floor(self) -> float:
        """The smallest bubble any table with this placement, split and activation bound can
        have (unit ticks). A (chunk k, microbatch) holds its activations at least from its F
        to the end of its W (or X): the forward through chunks k+1..K-1, then the backward
        back to k, `life(k)` ticks. Stage s holds at most `bound` stage-microbatches at once,
        so its m microbatches need at least m * sum(life(k) / v for its chunks) / bound
        ticks, or its 3vm ticks of work if more, after its first chunk's first F, which
        cannot start before tick k."""
        K, v, m = self.chunks, self.chunks_per_stage, self.microbatches
        life = (lambda k: 2 * (K - k) + 1) if self.split else (lambda k: 3 * (K - k))
        need, start = [Fraction(0)] * self.stages, [K] * self.stages
        for k, (s, _) in enumerate(self.placement):
            need[s] += Fraction(life(k), v)
            start[s] = min(start[s], k)
        work = 3 * v * m
        ticks = max(start[s] + max(m * need[s] / self.bound, work) for s in range(self.stages))
        return float(1 - work / ticks)

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


def dependencies(op: Op, K: int, back: int, reference: bool = False) -> list[Op]:
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


def run_in_order(orders: list[list[Op]], K: int, cost: dict[int, float]) -> dict[Op, float]:
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
                deps = dependencies(op, K, back, reference)
                if any(d not in end for d in deps):
                    break
                start[op] = max([clock[s], *(end[d] for d in deps)])
                clock[s] = end[op] = start[op] + cost[op.kind]
                pos[s] += 1
                moved = True
        if not moved:
            raise ValueError("the stages' op orders deadlock")
    return start


def rows_from_orders(orders: list[list[Op]], K: int):
    """The tick table of per-stage op orders run as soon as possible in unit ticks."""
    start = run_in_order(orders, K, TICKS)
    width = max(int(start[op]) + TICKS[op.kind] for row in orders for op in row)
    rows = [[None] * width for _ in orders]
    for s, order in enumerate(orders):
        for op in order:
            rows[s][int(start[op])] = op
    return tuple(tuple(r) for r in rows)


def _weighted_run(sched: Schedule, costs: dict[str, float]):
    """(makespan, work) when each stage runs its row's ops in order as soon as their inputs
    arrive (no lock step), an op taking `costs['F' | 'B' | 'W' | 'R']` (X = B + W; R defaults
    to F)."""
    cost = {F: costs["F"], B: costs["B"], W: costs["W"], X: costs["B"] + costs["W"],
            R: costs.get("R", costs["F"])}
    orders = [[op for op in row if op is not None] for row in sched.rows]
    start = run_in_order(orders, sched.chunks, cost)
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
    writes and B/X/W read; w_slot: the slot B writes its per-layer stash to and W reads;
    send (0 none, 1 next stage, 2 previous stage, 3 this stage) and send_slot: where the op's
    output goes in the receiver's inbox. Also the slot counts."""
    table = _Arrays(sched)
    table.route_messages()
    table.place_ops()
    table.share_reads()
    pools = table.pools
    return {**table.arr,
            "slots": {name: max(1, max(pool.size for pool in pools[name])) for name in pools}}


class _Arrays:
    """`as_arrays` under way: the arrays filled so far, each stage's slot pools, and the
    inbox slot of every message."""

    FIELDS = ("op", "chunk", "microbatch", "first", "last", "in_slot", "res_slot", "w_slot",
              "send", "send_slot")

    def __init__(self, sched: Schedule):
        self.sched, self.start, self.split = sched, sched.start(), sched.split
        self.back = B if self.split else X
        self.end = {op: t + TICKS[op.kind] for op, t in self.start.items()}
        self.arr = {f: np.zeros((sched.ticks, sched.stages), np.int32) for f in self.FIELDS}
        self.pools = {name: [_Pool() for _ in range(sched.stages)]
                      for name in ("inbox", "res", "w")}
        self.inbox_slot: dict[tuple[Op, Op], int] = {}

    def stage(self, chunk: int) -> int:
        return self.sched.placement[chunk][0]

    def _consumer(self, op: Op) -> Op | None:
        """Who reads op's output: F(k) -> F(k+1), the last F -> its own B (the head's
        cotangent), B(k) -> B(k-1), R(k) -> R(k+1); None for the ends."""
        last = self.sched.chunks - 1
        if op.kind == F:
            return Op(F, op.chunk + 1, op.microbatch) if op.chunk < last else \
                Op(self.back, op.chunk, op.microbatch)
        if op.kind == self.back and op.chunk > 0:
            return Op(self.back, op.chunk - 1, op.microbatch)
        if op.kind == R and op.chunk < last:
            return Op(R, op.chunk + 1, op.microbatch)
        return None

    def route_messages(self) -> None:
        """Every message an inbox slot, held from the end of its op's first tick to when its
        consumer starts, and the sender's send and send_slot."""
        p, arr = self.sched.stages, self.arr
        for op, t in sorted(self.start.items(), key=lambda kv: kv[1]):
            consumer = self._consumer(op)
            if consumer is None:
                continue
            dest, s = self.stage(consumer.chunk), self.stage(op.chunk)
            slot = self.pools["inbox"][dest].take(t, self.start[consumer])
            self.inbox_slot[(op, consumer)] = slot
            if dest not in (s, (s + 1) % p, (s - 1) % p):
                raise ValueError(f"{self.sched.name}: {op} sends to stage {dest}, not a "
                                 f"neighbour")
            arr["send"][t, s] = 3 if dest == s else 1 if dest == (s + 1) % p else 2
            arr["send_slot"][t, s] = slot

    def place_ops(self) -> None:
        """Each op in its stage's row: what it is, and the slots it reads and writes."""
        arr, K, split, back = self.arr, self.sched.chunks, self.split, self.back
        for op, t in self.start.items():
            s, (_, c) = self.stage(op.chunk), self.sched.placement[op.chunk]
            j = op.microbatch
            arr["op"][t, s], arr["chunk"][t, s], arr["microbatch"][t, s] = op.kind, c, j
            arr["first"][t, s], arr["last"][t, s] = op.chunk == 0, op.chunk == K - 1
            if op.kind == F:
                if op.chunk:
                    arr["in_slot"][t, s] = self.inbox_slot[(Op(F, op.chunk - 1, j), op)]
                freed = self.end[Op(W if split else X, op.chunk, j)] - 1
                arr["res_slot"][t, s] = self.pools["res"][s].take(t, freed)
            elif op.kind == R and op.chunk:
                arr["in_slot"][t, s] = self.inbox_slot[(Op(R, op.chunk - 1, j), op)]
            elif op.kind == back:
                producer = Op(F, op.chunk, j) if op.chunk == K - 1 else \
                    Op(back, op.chunk + 1, j)
                arr["in_slot"][t, s] = self.inbox_slot[(producer, op)]
                if split:
                    arr["w_slot"][t, s] = self.pools["w"][s].take(
                        t, self.start[Op(W, op.chunk, j)])

    def share_reads(self) -> None:
        """B/X/W read the activation slot their F wrote, W the slot its B wrote."""
        arr, start = self.arr, self.start
        for op, t in start.items():
            s = self.stage(op.chunk)
            if op.kind in (B, X, W):
                arr["res_slot"][t, s] = arr["res_slot"][start[Op(F, op.chunk, op.microbatch)], s]
            if op.kind == W:
                arr["w_slot"][t, s] = arr["w_slot"][start[Op(B, op.chunk, op.microbatch)], s]


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
