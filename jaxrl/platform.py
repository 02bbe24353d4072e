"""Which JAX platforms a `jaxrl` process may start, decided before JAX is imported.

With libtpu installed (the test extras install it for ahead-of-time TPU compiles) but no TPU
attached, JAX still tries the TPU backend first: the process prints libtpu's initialisation
errors and takes libtpu's machine-wide lock file, and a `jaxrl compile --topology ...` started
beside it then aborts. So when JAX_PLATFORMS is not set and this machine has no TPU, the CLI
leaves TPU out: CUDA then CPU on a machine with an NVIDIA GPU and JAX's CUDA plugin, else CPU.
The ahead-of-time path (sharding/aot.py) reaches libtpu through `get_topology_desc`, which does
not need the TPU backend. An explicit JAX_PLATFORMS is always kept.
"""

from __future__ import annotations

import glob
import importlib.util
import os


def has_tpu() -> bool:
    """TPU chips are attached: /dev/accel* (v2-v5e) or /dev/vfio/<n> (v5p, v6e)."""
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def has_cuda() -> bool:
    """An NVIDIA device and JAX's CUDA plugin."""
    plugin = any(importlib.util.find_spec(f"jax_cuda{v}_plugin") is not None
                 for v in (12, 13))
    return plugin and (os.path.exists("/dev/nvidiactl") or bool(glob.glob("/dev/nvidia[0-9]*")))


def choose_platforms(environ=os.environ) -> str | None:
    """Sets JAX_PLATFORMS in `environ` when it is unset and no TPU is attached; returns what it
    set (None: left as it was)."""
    if environ.get("JAX_PLATFORMS") or has_tpu():
        return None
    environ["JAX_PLATFORMS"] = "cuda,cpu" if has_cuda() else "cpu"
    return environ["JAX_PLATFORMS"]


DEFAULT_CACHE = "~/.cache/jaxrl/xla"


def use_compilation_cache(environ=os.environ) -> str | None:
    """Turns on JAX's persistent compilation cache for this process, so the second run of a
    config loads its programs instead of compiling them (the train step, every serving
    program). The directory is $JAX_COMPILATION_CACHE_DIR when set (empty: no cache), else
    ~/.cache/jaxrl/xla. Every program is cached, however quickly it compiled: an engine's many
    small programs add up. Returns the directory used, or None."""
    path = environ.get("JAX_COMPILATION_CACHE_DIR", DEFAULT_CACHE)
    if not path:
        return None
    import jax

    path = os.path.expanduser(path)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
