"""Shared by the benchmarks that compare runs side by side: they measure only on a quiet
machine, since shared cores distort every variant (and every stack) differently."""

from __future__ import annotations

import sys
import time


def busy_share(seconds: float = 2.0) -> float:
    """The share of the machine's CPU time other processes used over `seconds` (/proc/stat)."""
    def sample():
        fields = [int(x) for x in open("/proc/stat").readline().split()[1:]]
        idle = fields[3] + fields[4]
        return sum(fields), idle

    total0, idle0 = sample()
    time.sleep(seconds)
    total1, idle1 = sample()
    return 1.0 - (idle1 - idle0) / max(total1 - total0, 1)


def wait_until_quiet(limit: float, who: str, patience_s: float = 120.0) -> None:
    """Returns once other processes use at most `limit` of the CPU; exits the bench with a
    message naming the share if that does not happen within `patience_s`."""
    deadline = time.monotonic() + patience_s
    while (share := busy_share()) > limit:
        if time.monotonic() > deadline:
            sys.exit(f"{who}: the machine is busy ({share:.0%} of its CPU used by other "
                     f"processes, the limit is {limit:.0%}); refusing to measure")


def best_seconds(call, repeats: int, batch: int) -> float:
    """Seconds one `call()` takes: the best of `repeats` batches of `batch` calls, after a first
    call (compilation); a JAX result is waited for at the end of each batch."""
    call()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(batch):
            out = call()
        if hasattr(out, "block_until_ready"):
            out.block_until_ready()
        best = min(best, (time.perf_counter() - start) / batch)
    return best
