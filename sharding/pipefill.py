"""PipeFill: the frozen reference model's forward (the KL term's log-probs) run in a schedule's
idle ticks, as R ops added to its table (`with_reference`), and how much of that work the
bubbles absorbed (`absorbed`)."""

from __future__ import annotations

import dataclasses

from sharding.schedule_table import (B, F, R, TICKS, X, Op, Schedule, check, dependencies,
                                     rows_from_orders, weighted_makespan)


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
    best = rows_from_orders(own_pass, sched.chunks)
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
                                   for d in dependencies(op, K, back, True))
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
