"""Ahead-of-time compilation for TPU topologies on a machine without a TPU (JAX + libtpu).

`tpu_devices("v5e:2x4")` gives abstract TPU devices to build a mesh over; a function jitted with
shardings on that mesh lowers and compiles for the real chip, and `compiled.memory_analysis()`
reports what it would use. This is how TPU readiness is checked in CI.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re

# Chips on one host, per generation: a single-host slice is at most this big.
_CHIPS_PER_HOST = {"v4": (2, 2, 1), "v5e": (2, 4, 1), "v5p": (2, 2, 1), "v6e": (2, 4, 1)}


def tpu_devices(topology: str):
    """Abstract devices of a single-host TPU slice, e.g. 'v5e:2x2' or 'v5e:2x4'."""
    from jax.experimental import topologies

    m = re.fullmatch(r"(v4|v5e|v5p|v6e):(\d+)x(\d+)(?:x(\d+))?", topology)
    if not m:
        raise ValueError(f"topology {topology!r} is not of the form GEN:AxB[xC] with GEN one of "
                         f"{', '.join(_CHIPS_PER_HOST)}")
    gen = m.group(1)
    dims = tuple(int(d) for d in m.groups()[1:] if d) + (1,) * (3 - len(
        [d for d in m.groups()[1:] if d]))
    host = _CHIPS_PER_HOST[gen]
    if any(d > h for d, h in zip(dims, host)):
        raise ValueError(f"topology {topology!r} spans several hosts; single-host slices of "
                         f"{gen} go up to {'x'.join(map(str, host[:2]))}")
    with _without_cpu_flags():
        desc = topologies.get_topology_desc(
            platform="tpu", topology_name=topology, chip_config_name="default",
            chips_per_host_bounds=dims, num_slices=1, wrap=(False, False, False))
        _start_tpu_compiler(desc.devices[0])
    return desc.devices


@functools.cache
def _start_tpu_compiler(device) -> None:
    """Compiles a trivial program for `device`: libtpu reads XLA_FLAGS at its first compile in
    the process, which then happens here, inside `_without_cpu_flags`."""
    import jax
    import jax.numpy as jnp

    at = jax.sharding.SingleDeviceSharding(device)
    jax.jit(jnp.negative, out_shardings=at).lower(
        jax.ShapeDtypeStruct((), jnp.float32, sharding=at)).compile()


@contextlib.contextmanager
def _without_cpu_flags():
    """XLA_FLAGS without its XLA:CPU flags (`--xla_cpu_*`) while libtpu starts. libtpu reads
    XLA_FLAGS once, at its first compile, with its own XLA's flag list, and aborts the process on a
    flag it does not know (`Unknown flag in XLA_FLAGS`): XLA:CPU's newer flags, which a CPU run
    (or the test suite) sets, are such flags, and they mean nothing to a TPU compile. They are
    put back on the way out, so a CPU backend that first reads them after this keeps them (one
    that starts inside this window would not: start it first to be sure)."""
    flags = os.environ.get("XLA_FLAGS")
    if flags is None:
        yield
        return
    os.environ["XLA_FLAGS"] = " ".join(f for f in flags.split()
                                       if not f.startswith("--xla_cpu_"))
    try:
        yield
    finally:
        os.environ["XLA_FLAGS"] = flags
