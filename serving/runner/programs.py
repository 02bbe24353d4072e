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
the top of each ladder below first (`compile_all(largest_only=True)`: S rows, the largest
prefill chunk bucket). A call that would use a smaller row count or chunk bucket runs padded
to the smallest compiled one (`row_bucket`, `bucket`); once ASK_AFTER calls have been padded
so, their own is asked for, and a thread beside the engine compiles it (`compile_wanted`). No
call waits for a compile, and what only a few calls would use (the first steps of a batch
whose rows arrive a group at a time) is not compiled at all.

The shapes a call can take are fixed by a few ladders (serving/runner/engine_config.py):
- rows: a decode batch, an insert, a page copy or a sampling call holds S/16, S/4 or S rows
  (S slots; always S up to 8 slots);
- prefill: a chunk bucket b (a power of two from min_bucket, and prefill_chunk) with
  `prefill_rows(b)` rows, so that a call's padded grid stays within the prefill budget;
- page-table widths: `page_buckets` per doubling for decode, one per doubling for prefill.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
import weakref
from functools import partial

import jax
import jax.numpy as jnp

from jaxrl import executables
from serving.runner.constraints import mask_words
from serving.runner import speculate, steps
from serving.runner.steps import HISTORY_CHUNK, PER_SLOT, ROW_TYPES, SAMPLING, Spec
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

# The programs whose key starts with a row count (serving/runner/engine_config.py, `row_sizes`), and
# the family each chooses it with: a decode batch's logits go to `advance` at its row count;
# the others choose theirs alone.
FAMILY = {"sample_first": "sample_first", "insert": "insert", "copy_pages": "copy_pages",
          "decode": "decode", "advance": "decode", "decode_steps": "decode",
          "verify": "verify"}
PROGRAMS = steps.PROGRAMS | speculate.PROGRAMS
ROWS_FIRST = tuple(FAMILY)


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

    # Calls padded to a larger row count or chunk bucket before their own is compiled: a
    # padded decode step costs a few ms more, its programs about two seconds of compiling.
    ASK_AFTER = 32

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
        self._row_tables: dict[str, tuple[int, ...]] = {}   # family -> rows by n (compiled)
        self._buckets: tuple[int, ...] = ()
        self._wanted: set[tuple[str, int]] = set()    # rungs a call asked for, not compiled
        self._padded: collections.Counter = collections.Counter()   # calls padded, by rung
        self._asked = threading.Event()

    def shapes(self) -> list[tuple]:
        """(program, key) of every call the engine can make, key as in `args`."""
        cfg, out = self.spec.cfg, [("init", ())]
        rows = cfg.row_sizes
        for b in cfg.buckets:
            out += [("prefill", (cfg.prefill_rows(b), b, w)) for w in cfg.prefill_widths]
        out += [(name, (k,)) for name in ("sample_first", "insert", "copy_pages") for k in rows]
        k = cfg.steps_per_dispatch
        for r in rows:
            if k == 1:
                out += [("decode", (r, w)) for w in cfg.decode_widths] + [("advance", (r,))]
            else:
                out += [("decode_steps", (r, w, k)) for w in cfg.decode_widths]
            out += [("verify", (r, w, n)) for w in cfg.verify_widths for n in cfg.draft_lengths]
        return out + [("score", (b,)) for b in cfg.score_buckets]

    def _rung(self, shape: tuple) -> tuple[str, int] | None:
        """Where a call at `shape` sits on the ladders: (its FAMILY, its row count),
        ("prefill", its chunk bucket), or None (init, score)."""
        name, key = shape
        if name in FAMILY:
            return (FAMILY[name], key[0])
        return ("prefill", key[1]) if name == "prefill" else None

    def _first(self, shape: tuple) -> bool:
        """Compiled before the engine starts even with `largest_only`: the top of its ladder,
        or on none."""
        rung, cfg = self._rung(shape), self.spec.cfg
        return rung is None or rung[1] == (cfg.buckets if rung[0] == "prefill"
                                           else cfg.row_sizes)[-1]

    def args(self, name: str, key: tuple) -> tuple:
        """Abstract arguments of program `name` at shape `key`."""
        spec = self.spec
        rep = shd.replicated(spec.mesh)
        arr = lambda *shape, dtype=jnp.int32: jax.ShapeDtypeStruct(shape, dtype, sharding=rep)  # noqa: E731
        params, state = spec.param_target, spec.abstract_state()
        fields = lambda k, names: {n: arr(k, *ROW_TYPES[n][1], dtype=ROW_TYPES[n][0])  # noqa: E731
                                   for n in names}
        words = mask_words(spec.model_cfg.vocab_size)    # a row's token bitmask
        if name == "init":
            return ()
        if name == "score":
            (t,) = key
            return (params, arr(t), arr())
        if name == "prefill":
            p, t, w = key
            return (params, state, arr(p, t), arr(p), arr(p), arr(p, w), arr(p))
        if name == "sample_first":
            (k,) = key
            logits = arr(spec.cfg.max_prefill_rows, spec.model_cfg.vocab_size,
                         dtype=jnp.float32)
            return (logits, arr(k), arr(k), fields(k, SAMPLING), arr(k, words))
        if name == "insert":
            (k,) = key
            return (state, arr(k), fields(k, PER_SLOT), arr(k, HISTORY_CHUNK),
                    arr(dtype=jnp.bool_))
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
        if name == "verify":
            r, w, k = key
            return (params, state, arr(r, w), arr(r), arr(r, k), arr(r, dtype=jnp.bool_))
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

    def compile_all(self, largest_only: bool = False) -> int:
        """Compiles every program at every shape not compiled yet (`largest_only`: those of
        the largest batches and prefill chunks, and those without either; `compile_wanted`
        the others a call asks for); returns how many it compiled. Thread-safe; meant for the
        thread that starts the engine."""
        with self._lock:
            todo = [s for s in self.shapes() if s not in self._compiled and
                    (not largest_only or self._first(s))]
            for shape in todo:
                self._compile_into(shape)
            self._update_ladders()
        return len(todo)

    def compile_wanted(self, stop: threading.Event) -> int:
        """Compiles the programs of every row count and chunk bucket a call asked for (`row_bucket`,
        `bucket`) as they are asked for, one program at a time (a call between two of them never
        waits long for the lock), at low CPU priority. Meant for a thread of its own beside a
        running engine; returns between two programs once `stop` is set, or once everything
        is compiled. Returns how many it compiled."""
        _lower_priority()
        done, total = 0, len(self.shapes())
        while not stop.is_set() and len(self._compiled) < total:
            if not self._asked.wait(0.2):
                continue
            self._asked.clear()
            todo = [s for s in self.shapes() if self._rung(s) in self._wanted]
            for shape in todo:
                if stop.is_set():
                    break
                with self._lock:
                    if shape not in self._compiled:
                        self._compile_into(shape)
                        done += 1
                    self._update_ladders()
        return done

    def _compile_into(self, shape: tuple) -> None:
        """Compiles (or loads) the program at `shape` into the table; the lock held."""
        t0 = time.perf_counter()
        self._compiled[shape] = self._compile(*shape)
        self.compile_s += time.perf_counter() - t0

    @property
    def wanted(self) -> set[tuple[str, int]]:
        """The (family, row count) and ("prefill", bucket) rungs calls asked for whose
        programs are not all compiled yet."""
        return {(family, v) for family, v in set(self._wanted)
                if (self.bucket_now(v) if family == "prefill"
                    else self.rows_now(family, v)) != v}

    def _padded_call(self, rung: tuple[str, int]) -> None:
        """A call ran padded for want of `rung`: the ASK_AFTER-th asks for it."""
        self._padded[rung] += 1
        if self._padded[rung] >= self.ASK_AFTER and rung not in self._wanted:
            self._wanted.add(rung)
            self._asked.set()

    def _update_ladders(self) -> None:
        """`row_bucket`'s tables and `bucket`'s list, from the row counts and chunk buckets
        whose programs are all compiled."""
        cfg, shapes = self.spec.cfg, self.shapes()
        done: dict[tuple[str, int], bool] = {}
        for shape in shapes:
            rung = self._rung(shape)
            if rung is not None:
                done[rung] = done.get(rung, True) and shape in self._compiled
        for family in set(FAMILY.values()):
            rows = [r for r in cfg.row_sizes if done.get((family, r))]
            self._row_tables[family] = tuple(next((r for r in rows if r >= n), 0)
                                             for n in range(cfg.row_sizes[-1] + 1))
        self._buckets = tuple(b for b in cfg.buckets if done.get(("prefill", b)))

    def row_bucket(self, family: str, n: int) -> int:
        """Rows a call of `family` (FAMILY) for `n` sequences runs with: the ladder's choice
        (EngineConfig.row_sizes) when its programs are compiled, else the smallest compiled
        row count above it (the ladder's choice asked for after ASK_AFTER such calls).
        Before anything is compiled, the ladder's choice (an engine used without compiling
        compiles as it goes, each program logged: `__call__`)."""
        best, got = self.spec.cfg.row_bucket(n), self.rows_now(family, n, 0)
        if got and got != best:
            self._padded_call((family, best))
        return got or best

    def rows_now(self, family: str, n: int, default: int | None = None) -> int:
        """What `row_bucket` returns, without asking for anything: for estimates of calls
        that may not be made (serving/core/scheduler.py, decode_groups)."""
        table = self._row_tables.get(family)
        got = table[n] if table else 0
        return got or (self.spec.cfg.row_bucket(n) if default is None else default)

    def bucket(self, length: int) -> int:
        """The prefill chunk bucket a chunk of `length` tokens pads to: as `row_bucket`, the
        ladder's (EngineConfig.buckets) when compiled, else the smallest compiled one above
        it (the ladder's asked for after ASK_AFTER such calls)."""
        best, got = self.spec.cfg.bucket(length), self.bucket_now(length, 0)
        if got and got != best:
            self._padded_call(("prefill", best))
        return got or best

    def bucket_now(self, length: int, default: int | None = None) -> int:
        """What `bucket` returns, without asking for anything."""
        got = next((b for b in self._buckets if b >= length), 0)
        return got or (self.spec.cfg.bucket(length) if default is None else default)

    @property
    def compiled(self) -> int:
        return len(self._compiled)

    def is_compiled(self, name: str, key: tuple) -> bool:
        return (name, key) in self._compiled

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
