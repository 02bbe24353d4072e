"""What a compiled program's device memory holds at its peak, read from XLA's own dumps.

`memory_analysis()` gives one number, the temp allocation's size. To say what fills it, XLA is
asked to dump the program it compiled (`dump_flags`): the buffer assignment (every value of the
temp allocation, its size and shape) and the live ranges (when each value is born and dies, in
the program's flattened schedule). Sweeping the schedule gives the moment most bytes are live
and the values live then, largest first; each is named by the JAX operation that made it (the
`op_name` XLA keeps from the trace: `jit(step)/while/body/...`), which is what a reader can
change. The sum at the peak can sit under the allocation's size: XLA packs values by offset
and leaves gaps.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

_ALLOCATION = re.compile(r"^allocation \d+: size (\d+),(.*):$")
_VALUE = re.compile(r"^ value: <\d+ (\S+) @\d+> \(size=(\d+),offset=\d+\): (.*)$")
_RANGE = re.compile(r"^\s+(\S+):(\d+)-(\d+)$")
_OP_NAME = re.compile(r"^\s*(?:ROOT )?%(\S+) = .*?op_name=\"([^\"]*)\"")


def dump_flags(directory: str | Path, module: str = "jit_step") -> str:
    """XLA_FLAGS that make the compiler dump what `peak` reads, for modules named `module`
    (set before the compiler starts: libtpu reads XLA_FLAGS once)."""
    return (f"--xla_dump_to={directory} --xla_dump_hlo_as_text "
            f"--xla_dump_hlo_module_re={module}")


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One value live at the peak."""

    name: str      # the HLO value, e.g. fusion.12{0}
    bytes: int
    shape: str     # with XLA's layout, e.g. bf16[8,2048,2048]{2,1,0:T(8,128)(2,1)}
    op: str        # the JAX operation that made it, or "" when XLA made it (copies, layouts)


@dataclasses.dataclass(frozen=True)
class Peak:
    bytes: int                   # live bytes of the temp allocation at the peak
    allocation_bytes: int        # the temp allocation's size (memory_analysis's temp)
    buffers: tuple[Buffer, ...]  # live at the peak, largest first

    def render(self, top: int = 12) -> str:
        lines = [f"at the peak: {self.bytes / 2**20:,.1f} MiB live of a "
                 f"{self.allocation_bytes / 2**20:,.1f} MiB temp allocation; the largest "
                 f"{min(top, len(self.buffers))} of {len(self.buffers)} buffers:"]
        for b in self.buffers[:top]:
            shape = b.shape.split("{")[0]
            lines.append(f"  {b.bytes / 2**20:10,.1f} MiB  {shape:<28} {b.op or b.name}")
        return "\n".join(lines)


def _key(name: str) -> str:
    return name if "{" in name else name + "{}"


def _temp_values(assignment: str) -> tuple[int, dict[str, tuple[int, str]]]:
    """(the device temp allocation's size, its values: name -> (bytes, shape))."""
    size, values, inside = 0, {}, False
    for line in assignment.splitlines():
        if m := _ALLOCATION.match(line):
            attributes = m.group(2)
            inside = "preallocated-temp" in attributes and "color" not in attributes
            if inside:
                size = max(size, int(m.group(1)))
        elif inside and (m := _VALUE.match(line)):
            values[_key(m.group(1))] = (int(m.group(2)), m.group(3))
    return size, values


def peak(directory: str | Path, module: str = "jit_step") -> Peak:
    """The peak of the last program named `module` dumped into `directory`."""
    directory = Path(directory)
    assignments = sorted(directory.glob(f"*.{module}.*after_optimizations-buffer-assignment.txt"))
    if not assignments:
        raise FileNotFoundError(f"no buffer assignment of {module} in {directory}: was the "
                                f"compiler started with sharding.buffers.dump_flags?")
    stem = str(assignments[-1]).removesuffix("-buffer-assignment.txt")
    allocation, values = _temp_values(assignments[-1].read_text())
    ranges = {}
    for line in Path(stem + "-live-range.txt").read_text().splitlines():
        if (m := _RANGE.match(line)) and _key(m.group(1)) in values:
            ranges[_key(m.group(1))] = (int(m.group(2)), int(m.group(3)))
    ops = {}
    for line in Path(stem + ".txt").read_text().splitlines():
        if m := _OP_NAME.match(line):
            ops[m.group(1)] = m.group(2)
    events: dict[int, int] = {}
    for name, (start, end) in ranges.items():
        events[start] = events.get(start, 0) + values[name][0]
        events[end + 1] = events.get(end + 1, 0) - values[name][0]
    live, best, when = 0, -1, 0
    for t in sorted(events):
        live += events[t]
        if live > best:
            best, when = live, t
    at_peak = sorted((Buffer(name, values[name][0], values[name][1],
                             ops.get(name.split("{")[0], ""))
                      for name, (start, end) in ranges.items() if start <= when <= end),
                     key=lambda b: -b.bytes)
    return Peak(max(best, 0), allocation, tuple(at_peak))
