"""Compiled programs kept on disk between runs and found without tracing them.

JAX's persistent compilation cache (jaxrl/platform.py) saves the compile, but finds an entry
by the lowered program: every run still traces and lowers each program again, which for the
engine's programs is most of a second run's start (1.5 of the 1.95 s its 18 programs take
from JAX's cache, on the peer job). Here a program is found by what fixes it, known before
tracing: a description from its owner (program name, shapes, configs), its abstract arguments
(shapes, dtypes, shardings and their devices), and this process's code, JAX, devices and
flags. A hit deserializes the executable (0.27 s for those 18).

Only executables this process compiled are written: XLA:CPU loses code when an executable
that was itself loaded from a cache is serialized again (it then fails with "Function ...
not found" when run), so a program JAX's cache already holds is found there, as before, until
a run compiles it afresh; one JAX hands back from its memory (compiled or loaded earlier in
the process) is not written either. The directory is `jaxrl-executables/` inside JAX's cache directory,
and nothing is kept when that cache is off; it holds at most MAX_BYTES, the least recently
used executables removed first. Entries are written whole (a file renamed into place) and one
that cannot be read is compiled again, never run.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import io
import logging
import os
import pickle
import threading
from pathlib import Path
from typing import Callable, Hashable, Sequence

import jax
from jax.experimental import serialize_executable

log = logging.getLogger(__name__)

SUBDIR = "jaxrl-executables"
MAX_BYTES = 2 << 30     # the directory's bound: least recently used executables go first
# Whose source is part of every key: a change to any of it may change any program.
PACKAGES = ("jaxrl", "serving", "sharding")
_VERSIONED = ("jax", "jaxlib", "flax", "optax")


def directory() -> Path | None:
    """Where executables are kept: inside JAX's persistent cache directory, None when off."""
    root = jax.config.jax_compilation_cache_dir
    return Path(root) / SUBDIR if root else None


def load_or_compile(lower: Callable[[], jax.stages.Lowered], what: Hashable, args,
                    devices: Sequence) -> jax.stages.Compiled:
    """`lower().compile()`, or the executable an earlier process compiled for the same
    program: `what` describes it (its name, static shapes, the configs it closes over; its
    repr must not change between processes), `args` are its abstract arguments, `devices` the
    devices it runs on, in its mesh's order."""
    devices = list(devices)
    root = directory()
    if root is None:
        return lower().compile()
    path = root / f"{key((what, [d.id for d in devices]), args)}.exe"
    try:
        blob = path.read_bytes()
    except OSError:
        blob = None
    if blob is not None:
        try:
            os.utime(path)                  # last used now: `_evict` removes the oldest first
            return serialize_executable.deserialize_and_load(
                *pickle.loads(blob), backend=devices[0].client, execution_devices=devices)
        except Exception as e:   # noqa: BLE001 (a cut or stale file: compiled again)
            log.warning("compiled executable %s could not be loaded (%s: %s); compiling it",
                        path.name, type(e).__name__, e)
    before = _events()
    compiled = lower().compile()
    compiles, hits = (a - b for a, b in zip(_events(), before))
    if compiles and not hits:    # compiled here: not from JAX's caches, on disk or in memory
        _write(path, compiled)
    else:
        log.debug("executable %s was loaded, not compiled: not kept", path.name)
    return compiled


def key(what: Hashable, args) -> str:
    """The file name of a program's executable: a hash of `what`, `args`' abstract values and
    this process's environment."""
    h = hashlib.sha256()
    for part in (repr(what), _abstract(args), environment()):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def _abstract(args) -> str:
    leaves, tree = jax.tree.flatten(args)
    parts = [repr(tree)]
    for x in leaves:
        sharding = getattr(x, "sharding", None)
        devices = getattr(sharding, "_device_assignment", None) or ()
        if not hasattr(x, "shape"):           # a static value
            parts.append(repr(x))
            continue
        parts.append(f"{x.shape}|{x.dtype}|{getattr(x, 'weak_type', False)}|{sharding}|"
                     f"{[d.id for d in devices]}")
    return "\n".join(parts)


@functools.lru_cache(maxsize=1)
def environment() -> str:
    """What else fixes a compiled program: the code of PACKAGES, the versions of JAX and its
    libraries, every JAX option, XLA's flags, and the devices."""
    code = hashlib.sha256()
    for package in PACKAGES:
        spec = importlib.util.find_spec(package)
        for root in spec.submodule_search_locations or ():
            for path in sorted(Path(root).rglob("*.py")):
                code.update(str(path.relative_to(root)).encode())
                code.update(path.read_bytes())
    versions = {name: _version(name) for name in _VERSIONED}
    flags = {k: v for k, v in sorted(os.environ.items())
             if k.startswith(("XLA_", "JAX_", "LIBTPU", "TPU_", "CUDA_", "NCCL_"))}
    devices = [(d.platform, d.device_kind, d.id, d.process_index) for d in jax.devices()]
    backend = jax.devices()[0].client
    return repr((code.hexdigest(), versions, flags, sorted(jax.config.values.items()),
                 devices, backend.platform_version))


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _write(path: Path, compiled: jax.stages.Compiled) -> None:
    """The executable, whole or not at all (a temporary file renamed into place)."""
    try:
        blob = pickle.dumps(serialize_executable.serialize(compiled))
    except (ValueError, NotImplementedError, pickle.PicklingError, TypeError) as e:
        log.debug("executable %s is not kept: %s", path.name, e)
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        with io.open(tmp, "wb") as f:
            f.write(blob)
        os.replace(tmp, path)
        _evict(path.parent, MAX_BYTES)
    except OSError as e:
        log.warning("executable %s could not be kept: %s", path.name, e)


def _evict(root: Path, limit: int) -> None:
    """Removes the least recently used executables until those left take at most `limit`
    bytes (each change to the code keys every program anew)."""
    entries = []
    for path in root.glob("*.exe"):
        try:
            st = path.stat()
        except FileNotFoundError:           # another process removed it meanwhile
            continue
        entries.append((st.st_mtime, st.st_size, path))
    total = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries):
        if total <= limit:
            break
        path.unlink(missing_ok=True)
        total -= size


# JAX reports each backend compile (a fresh one or a load from its persistent cache) and each
# persistent cache hit as events, on the compiling thread; counted per thread, a compile can
# tell a fresh executable from a loaded one, and from one JAX kept in memory (no event).
_EVENTS = threading.local()


def _on_event(event: str, *_, **__) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _EVENTS.hits = getattr(_EVENTS, "hits", 0) + 1
    elif event == "/jax/core/compile/backend_compile_duration":
        _EVENTS.compiles = getattr(_EVENTS, "compiles", 0) + 1


def _events() -> tuple[int, int]:
    return getattr(_EVENTS, "compiles", 0), getattr(_EVENTS, "hits", 0)


jax.monitoring.register_event_listener(_on_event)
jax.monitoring.register_event_duration_secs_listener(_on_event)
