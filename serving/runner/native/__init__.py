"""Native CPU kernels, called from jitted programs through XLA's FFI.

`paged_attention` is PagedKV's attention on CPU (`attention="native"`, the CPU default where a
C++ compiler is present): each query reads its row's keys and values straight from the pool
once (paged_attention.cc). The source is compiled on first use with the machine's C++ compiler
(`CXX`, else g++ or c++) into ~/.cache/jaxrl/kernels (`JAXRL_KERNEL_CACHE` elsewhere), one
library per source, jaxlib and CPU, and loaded from there afterwards (milliseconds). Where no
compiler is found or the build fails, `available()` says why and the engine keeps the XLA
`loop` attention."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

SOURCE = Path(__file__).with_name("paged_attention.cc")
TARGET = "jaxrl_paged_attention"
FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC"]


class KernelUnavailable(RuntimeError):
    """The native kernels could not be built or loaded here (the message says why)."""


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and (path := shutil.which(name)):
            return path
    return None


def _cpu_key() -> str:
    """What -march=native depends on: the CPU's model and feature flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [x for x in info.splitlines() if x.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = []
    return "\n".join([platform.machine(), platform.processor(), *lines])


def _library_path(compiler: str) -> Path:
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), jax.ffi.include_dir().encode(), jax.__version__.encode(),
                 compiler.encode(), " ".join(FLAGS).encode(), _cpu_key().encode()):
        key.update(part)
        key.update(b"\0")
    root = Path(os.environ.get("JAXRL_KERNEL_CACHE", "~/.cache/jaxrl/kernels")).expanduser()
    return root / f"paged_attention-{key.hexdigest()[:16]}.so"


def _build(compiler: str, library: Path) -> None:
    """Compiles the source into `library`, once across processes (a lock beside it; the file
    appears whole, by rename)."""
    import fcntl  # POSIX only; where it is missing, available() gives the reason

    library.parent.mkdir(parents=True, exist_ok=True)
    with open(library.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if library.exists():
            return
        fd, partial = tempfile.mkstemp(suffix=".so", dir=library.parent)
        os.close(fd)
        try:
            built = subprocess.run([compiler, *FLAGS, "-isystem", jax.ffi.include_dir(),
                                    str(SOURCE), "-o", partial],
                                   capture_output=True, text=True, timeout=300)
            if built.returncode != 0:
                raise KernelUnavailable(f"{compiler} failed to build {SOURCE.name}:\n"
                                        f"{built.stderr[-2000:]}")
            os.replace(partial, library)
        finally:
            if os.path.exists(partial):
                os.unlink(partial)


def _load() -> None:
    """Builds (or finds) the library and registers its handler with XLA:CPU; raises
    KernelUnavailable saying why not."""
    compiler = _compiler()
    if compiler is None:
        raise KernelUnavailable("no C++ compiler found (set CXX, or install g++)")
    library = _library_path(compiler)
    if not library.exists():
        _build(compiler, library)
    handle = ctypes.cdll.LoadLibrary(str(library))
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(handle.JaxrlPagedAttention),
                                platform="cpu")


@functools.cache
def available() -> str | None:
    """None where the kernels can be used (built or found, and registered: once a process),
    else why not."""
    try:
        _load()
    except (KernelUnavailable, ImportError, OSError, subprocess.SubprocessError) as e:
        return str(e)
    return None


def paged_attention(q_BTNH, positions_BT, kv, table_BW, layer, *, window: int | None = None,
                    scale: float | None = None, softcap: float | None = None):
    """PagedKV.attend's result, [B, T, N, H] in q's dtype (see paged_attention.cc)."""
    if (why := available()) is not None:
        raise KernelUnavailable(why)
    scale = q_BTNH.shape[-1] ** -0.5 if scale is None else scale
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q_BTNH.shape, q_BTNH.dtype))
    window = 0 if window is None else window    # may be traced: a layer's own, in a scan
    return call(q_BTNH, positions_BT.astype(jnp.int32), kv, table_BW.astype(jnp.int32),
                jnp.asarray(layer, jnp.int32), jnp.asarray(window, jnp.int32),
                scale=np.float32(scale), softcap=np.float32(softcap or 0.0))
