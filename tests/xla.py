"""XLA_FLAGS for the suite and for the processes its tests start.

Two presets, since a test's time goes either to compiling or to running:
- `COMPILING` (the suite's own, tests/conftest.py): LLVM at -O0, no MLIR fusion emitters. Most
  unit tests compile many tiny programs and run each a few times; this halves their compiling.
- `RUNNING` (the few processes whose time goes to running more than to compiling): -O1, no
  fusion emitters. Measured alone on the 2-core machine, each test at both: the long-tail
  test's `jaxrl train` (0.1M model, 200 warm-up steps, 12 async RL steps) 88 s at -O0, 51 s at
  -O1 (56 s at XLA's default, -O2 with fusion emitters); the load test's `jaxrl serve` (10,000
  requests) 124 -> 69 s. The other end-to-end runs are shorter and got slower at -O1 (the
  multi-host, warm-up stop, tool and notebook runs: 0-11 s more each), so they keep
  `COMPILING`.
Both compile each program's LLVM module in one piece (`--xla_cpu_parallel_codegen_split_count=1`):
XLA:CPU splits it into parts compiled on several threads, which saves wall time on an idle
machine but costs CPU, and the suite's two workers already keep both cores busy. Measured on the
2-core machine: a tiny model's value-and-grad step 450-500 -> 340-370 ms of CPU to compile, a
one-op program 20 -> 17.5 ms; the unit tests of tests/train and tests/models (two workers) 126
-> 116 s of CPU.
JAXRL_TEST_RUNNING_XLA_FLAGS replaces `RUNNING` (to compare presets)."""

import os

_DEVICES = "--xla_force_host_platform_device_count="
_ONE_PIECE = "--xla_cpu_parallel_codegen_split_count=1"
COMPILING = f"--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false {_ONE_PIECE}"
RUNNING = os.environ.get(
    "JAXRL_TEST_RUNNING_XLA_FLAGS",
    f"--xla_backend_optimization_level=1 --xla_cpu_use_fusion_emitters=false {_ONE_PIECE}")


def xla_flags(devices: int, running: bool = False) -> str:
    """`devices` CPU devices with the suite's flags, or with `RUNNING`'s for a process that
    trains or serves for many steps."""
    if running:
        return f"{_DEVICES}{devices} {RUNNING}"
    rest = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICES)]
    return " ".join([f"{_DEVICES}{devices}", *rest])


def running_env(devices: int = 1) -> dict[str, str]:
    """os.environ for a `jaxrl train` / `jaxrl serve` process on `devices` CPU devices."""
    return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(devices, running=True)}
