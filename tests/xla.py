"""XLA_FLAGS for the processes tests start: `devices` CPU devices, plus the compile flags the
suite runs with (tests/conftest.py)."""

import os

_DEVICES = "--xla_force_host_platform_device_count="


def xla_flags(devices: int) -> str:
    rest = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICES)]
    return " ".join([f"{_DEVICES}{devices}", *rest])
