"""The engine's compiled programs: built once per shape, compiled before serving starts.

Every program is a module-level function of a `Spec` (model config, engine config, mesh, pool
size), jitted with the spec bound in by the one `Programs` of that spec (`programs_for`),
never with an Engine as a static argument: a second Engine with the same spec reuses every
executable, and when the last Engine of a spec is dropped, its executables go with it.

`Programs.compile_all` compiles every program at every shape its calls can take (`shapes`),
ahead of time, on the calling thread, before the engine loop starts; afterwards a call only
looks its executable up. A call at a shape outside that set would be a bug in `shapes`: it is
compiled on the spot, counted in `late_compiles` and logged, never silently.

An engine that must start generating soon (an RL run's first step waits for it) compiles only
its largest row count first (`compile_all(largest_rows_only=True)`) and the smaller ones on a
thread of its own while it generates (`compile_rest`): until a row count's programs are all
compiled, its batches run padded to the next row count that is (`row_bucket`), so no call waits
for a compile either way.

The shapes a call can take are fixed by a few ladders (serving/engine_config.py):
- rows: a decode batch, an insert, a page copy or a sampling call holds S/16, S/4 or S rows
  (S slots; always S up to 8 slots);
- prefill: a chunk bucket b (a power of two from min_bucket, and prefill_chunk) with
  `prefill_rows(b)` rows, so that a call's padded grid stays within the prefill budget;
- page-table widths: `page_buckets` per doubling for decode, one per doubling for prefill.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from functools import partial

import jax
import jax.numpy as jnp

from jaxrl import executables
from serving.constraints import mask_words
from serving.spec import SAMPLING, Spec
from serving.steps import HISTORY_CHUNK, PROGRAMS
from sharding import mesh as shd

log = logging.getLogger(__name__)

_COMPILES = [0]


def _count_compiles(event: str, duration: float, **_) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILES[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compiles)


def process_compiles() -> int:
    """XLA compilations in this process so far, by anyone (the soak bench reads it through
    the server's metrics: none may happen once the server is ready)."""
    return _COMPILES[0]

# Programs whose key starts with a row count (serving/engine_config.py, `row_sizes`).
ROWS_FIRST = ("sample_first", "insert", "copy_pages", "decode", "advance", "decode_steps")


def _lower_priority() -> None:
    """This thread at low CPU priority (nice 19; Linux sets it per thread), so that compiling
    ahead takes the cores the engine and the trainer leave."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):   # not Linux, or not allowed: compile at normal priority
        pass


# -- shapes and compilation -------------------------------------------------------------------
class Programs:
    """The executables of one spec, compiled ahead of time; `programs_for` shares them."""

    def __init__(self, spec: Spec):
        self.spec = spec
        # jits of their own (the spec bound in), not module-level ones with the spec static:
        # JAX's lowering caches hold a module-level jit's executables for good, these go with
        # this object (bench/compile_stress.py, `programs_for`).
        self._jitted = {name: jax.jit(partial(fn, spec), static_argnums=static,
                                      donate_argnums=donated)
                        for name, (fn, static, donated) in PROGRAMS.items()}
        self._compiled: dict[tuple, object] = {}
        self._lock = threading.Lock()
        self.compile_s = 0.0
        self.late_compiles = 0
        self._row_buckets = (0,) * (spec.cfg.max_concurrent_decodes + 1)   # none ready yet

    def shapes(self) -> list[tuple]:
        """(program, key) of every call the engine can make, key as in `args`."""
        cfg, out = self.spec.cfg, [("init", ())]
        rows = cfg.row_sizes
        for b in cfg.buckets:
            out += [("prefill", (cfg.prefill_rows(b), b, w)) for w in cfg.prefill_widths]
        out += [(name, (k,)) for name in ROWS_FIRST[:3] for k in rows]
        k = cfg.steps_per_dispatch
        for r in rows:
            if k == 1:
                out += [("decode", (r, w)) for w in cfg.decode_widths] + [("advance", (r,))]
            else:
                out += [("decode_steps", (r, w, k)) for w in cfg.decode_widths]
        return out + [("score", (b,)) for b in cfg.score_buckets]

    def _rows(self, shape: tuple) -> int | None:
        """The row count of a call at `shape`, None for programs without one."""
        name, key = shape
        return key[0] if name in ROWS_FIRST else None

    def args(self, name: str, key: tuple) -> tuple:
        """Abstract arguments of program `name` at shape `key`."""
        spec = self.spec
        rep = shd.replicated(spec.mesh)
        arr = lambda *shape, dtype=jnp.int32: jax.ShapeDtypeStruct(shape, dtype, sharding=rep)  # noqa: E731
        params, state = spec.param_target, spec.abstract_state()
        sampling = lambda k: tuple(arr(k, *shape, dtype=d) for d, shape in SAMPLING)  # noqa: E731
        words = mask_words(spec.model_cfg.vocab_size)    # a row's token bitmask
        if name == "init":
            return ()
        if name == "score":
            (t,) = key
            return (params, arr(t))
        if name == "prefill":
            p, t, w = key
            return (params, state, arr(p, t), arr(p), arr(p), arr(p, w))
        if name == "sample_first":
            (k,) = key
            logits = arr(spec.cfg.max_prefill_rows, spec.model_cfg.vocab_size,
                         dtype=jnp.float32)
            return (logits, arr(k), arr(k), *sampling(k), arr(k, words))
        if name == "insert":
            (k,) = key
            return (state, arr(k), arr(k), arr(k), arr(k), *sampling(k), arr(k),
                    arr(k, dtype=jnp.float32), arr(k, dtype=jnp.float32),
                    arr(k, HISTORY_CHUNK), arr(dtype=jnp.bool_))
        if name == "copy_pages":
            (k,) = key
            return (state, arr(k), arr(k))
        if name == "decode":
            r, w = key
            return (params, state, arr(r, w), arr(r))
        if name == "advance":
            (r,) = key
            logits = arr(r, spec.model_cfg.vocab_size, dtype=jnp.float32)
            return (state, logits, arr(r), arr(r, dtype=jnp.bool_), arr(r, words))
        if name == "decode_steps":
            r, w, k = key
            return (params, state, arr(r, w), arr(r), arr(r, dtype=jnp.bool_), k)
        raise KeyError(name)

    def lower(self, name: str, key: tuple):
        """The program lowered at `key` (ahead-of-time compiles for other devices, e.g. TPU)."""
        return self._jitted[name].lower(*self.args(name, key))

    def _compile(self, name: str, key: tuple):
        """The program at `key`, compiled, or loaded as an earlier run compiled it
        (jaxrl/executables.py: found without tracing it again)."""
        spec = self.spec
        return executables.load_or_compile(
            lambda: self.lower(name, key), ("engine", name, key, spec.model_cfg, spec.cfg,
                                            spec.num_pages), self.args(name, key),
            list(spec.mesh.devices.flat))

    def compile_all(self, largest_rows_only: bool = False) -> int:
        """Compiles every program at every shape not compiled yet (`largest_rows_only`: those
        of the largest row count and the programs without one; `compile_rest` does the rest);
        returns how many it compiled. Thread-safe; meant for the thread that starts the
        engine."""
        largest = self.spec.cfg.row_sizes[-1]
        with self._lock:
            todo = [s for s in self.shapes() if s not in self._compiled and
                    (not largest_rows_only or self._rows(s) in (None, largest))]
            t0 = time.perf_counter()
            for name, key in todo:
                self._compiled[(name, key)] = self._compile(name, key)
            self.compile_s += time.perf_counter() - t0
            self._update_row_buckets()
        return len(todo)

    def compile_rest(self, stop: threading.Event) -> int:
        """Compiles what `compile_all` left, smaller row counts last, one program at a time
        (a call between two of them never waits long for the lock), at low CPU priority;
        each row count is used once all its programs are. Meant for a thread of its own beside
        a running engine; returns between two programs once `stop` is set. Returns how many it
        compiled."""
        _lower_priority()
        todo = sorted((s for s in self.shapes() if s not in self._compiled),
                      key=lambda s: -(self._rows(s) or 0))
        done = 0
        for shape in todo:
            if stop.is_set():
                break
            with self._lock:
                if shape not in self._compiled:
                    t0 = time.perf_counter()
                    self._compiled[shape] = self._compile(*shape)
                    self.compile_s += time.perf_counter() - t0
                    done += 1
                self._update_row_buckets()
        return done

    def _update_row_buckets(self) -> None:
        """`row_bucket`'s table, from the row counts whose programs are all compiled."""
        sizes, shapes = self.spec.cfg.row_sizes, self.shapes()
        ready = [r for r in sizes
                 if all(s in self._compiled for s in shapes if self._rows(s) == r)]
        self._row_buckets = tuple(next((r for r in ready if r >= n), 0)
                                  for n in range(sizes[-1] + 1))

    def row_bucket(self, n: int) -> int:
        """Rows a call for `n` sequences runs with: the smallest row count of the ladder
        (EngineConfig.row_sizes) at least n whose programs are all compiled; the ladder's own
        choice before any is (an engine used without compiling first compiles as it goes,
        each program logged: `__call__`)."""
        return self._row_buckets[n] or self.spec.cfg.row_bucket(n)

    @property
    def compiled(self) -> int:
        return len(self._compiled)

    def __call__(self, name: str, key: tuple, *args):
        exe = self._compiled.get((name, key))
        if exe is None:
            with self._lock:
                exe = self._compiled.get((name, key))
                if exe is None:
                    self.late_compiles += 1
                    log.warning("engine program %s%s was not compiled at start; compiling it "
                                "now (a call outside Programs.shapes)", name, key)
                    exe = self._compiled[(name, key)] = self._compile(name, key)
        return exe(*args)


_LIVE: "weakref.WeakValueDictionary[Spec, Programs]" = weakref.WeakValueDictionary()
_LIVE_LOCK = threading.Lock()


def programs_for(spec: Spec) -> Programs:
    """The Programs of `spec`, shared by every Engine of that spec while one is alive, and
    freed with the last of them. Kept any longer, executables pile up in a process that builds
    engines of many shapes (a test worker): each holds ~90 memory maps of JIT code on XLA:CPU,
    and at the kernel's limit (vm.max_map_count, 65,530) LLVM aborts the next compile with
    "Unable to allocate section memory" (bench/compile_stress.py)."""
    with _LIVE_LOCK:
        programs = _LIVE.get(spec)
        if programs is None:
            programs = _LIVE[spec] = Programs(spec)
        return programs
