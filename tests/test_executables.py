"""jaxrl/executables.py: compiled programs kept on disk and found without tracing; what the
second process loads computes what the first compiled, and nothing else is ever loaded."""

import os
import random
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import monitoring
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl import executables


@pytest.fixture
def kept(tmp_path, monkeypatch):
    monkeypatch.setattr(executables, "directory", lambda: tmp_path)
    return tmp_path


# A constant of this run: the programs below are compiled afresh even where JAX's persistent
# cache (which `make test` shares between tests) holds those of another run, since an
# executable that cache loaded is never kept.
RUN = random.Random().randrange(1, 1 << 20) / (1 << 22)


def _program(scale=2.0):
    """A jitted program and its abstract arguments; each test compiles scales of its own."""
    scale += RUN
    mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
    rep = NamedSharding(mesh, PartitionSpec())
    f = jax.jit(lambda x, y: (x * scale + y, jnp.zeros((3,)) - 1), donate_argnums=0)
    args = (jax.ShapeDtypeStruct((4,), jnp.float32, sharding=rep),
            jax.ShapeDtypeStruct((4,), jnp.float32, sharding=rep))
    return f, args, list(mesh.devices.flat), rep


def _never():
    raise AssertionError("traced and lowered again: the kept executable was not used")


def test_a_kept_executable_is_loaded_without_tracing_and_computes_the_same(kept):
    f, args, devices, rep = _program()
    lowered = []
    first = executables.load_or_compile(lambda: lowered.append(1) or f.lower(*args),
                                        ("f", 1), args, devices)
    assert lowered == [1] and len(list(kept.glob("*.exe"))) == 1
    second = executables.load_or_compile(_never, ("f", 1), args, devices)
    x = np.arange(4, dtype=np.float32)
    outs = []
    for compiled in (first, second):
        donated = jax.device_put(x, rep)
        out = compiled(donated, jax.device_put(np.ones(4, np.float32), rep))
        assert donated.is_deleted()                  # the donation is kept too
        outs.append([np.asarray(o) for o in out])
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(outs[1][0], x * (2 + RUN) + 1, rtol=1e-6)
    np.testing.assert_array_equal(outs[1][1], -np.ones(3))


def test_the_key_follows_the_description_the_shapes_and_the_shardings():
    f, args, devices, rep = _program()
    base = executables.key(("f", 1), args)
    other_mesh = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("y",)), PartitionSpec())
    variants = [(("f", 2), args),
                (("f", 1), (jax.ShapeDtypeStruct((5,), jnp.float32, sharding=rep), args[1])),
                (("f", 1), (jax.ShapeDtypeStruct((4,), jnp.bfloat16, sharding=rep), args[1])),
                (("f", 1), (jax.ShapeDtypeStruct((4,), jnp.float32, sharding=other_mesh),
                            args[1])),
                (("f", 1), args[:1]),
                (("f", 1), (*args, 3))]
    keys = {executables.key(what, a) for what, a in variants}
    assert base == executables.key(("f", 1), args) and base not in keys and len(keys) == 6


def test_an_unreadable_entry_is_compiled_again_and_replaced(kept, caplog):
    f, args, devices, _ = _program(3.0)
    path = kept / f"{executables.key(('f', [d.id for d in devices]), args)}.exe"
    path.write_bytes(b"\x80\x04\x95 half an entry, as a run killed by hand may leave")
    compiled = executables.load_or_compile(lambda: f.lower(*args), "f", args, devices)
    assert "could not be loaded" in caplog.text
    np.testing.assert_allclose(compiled(np.ones(4, np.float32), np.ones(4, np.float32))[0],
                               (4 + RUN) * np.ones(4), rtol=1e-6)
    again = executables.load_or_compile(_never, "f", args, devices)      # replaced, whole
    np.testing.assert_allclose(again(np.ones(4, np.float32), np.ones(4, np.float32))[0],
                               (4 + RUN) * np.ones(4), rtol=1e-6)


def test_what_jaxs_cache_loaded_is_not_kept(kept):
    """XLA:CPU loses code when an executable loaded from a cache is serialized again; such an
    executable is run, never written."""
    f, args, devices, _ = _program(5.0)

    def from_jaxs_cache():
        monitoring.record_event("/jax/compilation_cache/cache_hits")   # as JAX reports a hit
        return f.lower(*args)

    executables.load_or_compile(from_jaxs_cache, "f", args, devices)
    assert list(kept.glob("*")) == []


def test_what_jax_kept_in_memory_is_not_kept(kept):
    """An executable JAX compiled earlier in this process (perhaps loaded from its persistent
    cache then) comes back from its memory without a compile: its origin unknown, it is run,
    never written."""
    f, args, devices, _ = _program(6.0)
    f.lower(*args).compile()
    executables.load_or_compile(lambda: f.lower(*args), "f", args, devices)
    assert list(kept.glob("*")) == []
    g, args, devices, _ = _program(7.0)           # the same, compiled here first: kept
    executables.load_or_compile(lambda: g.lower(*args), "g", args, devices)
    assert len(list(kept.glob("*.exe"))) == 1


def test_the_engines_keys_are_the_same_in_another_process():
    """A key made of reprs is only useful if no repr holds an object's address: the engine's
    programs (an NNX parameter tree, its configs) get the same keys in a second process."""
    script = """
import dataclasses
from serving.runner.engine import Engine
from serving.runner.engine_config import EngineConfig
from jaxrl import executables
from jaxrl.models import ModelConfig
e = Engine(ModelConfig(vocab_size=32, embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                       head_dim=8, mlp_dim=64), EngineConfig(max_concurrent_decodes=4,
                       max_len=64, max_prefill_length=32, prefill_chunk=16, page_size=4))
p, s = e.programs, e.programs.spec
for name, key in p.shapes():
    print(executables.key(("engine", name, key, s.model_cfg, s.cfg, s.num_pages),
                          p.args(name, key)))
"""
    runs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           check=True, env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
            .stdout.split() for _ in range(2)]
    assert len(runs[0]) == 8 and len(set(runs[0])) == len(runs[0]) and runs[0] == runs[1]


def test_the_least_recently_used_executables_go_first(kept, monkeypatch):
    programs = [_program(10.0 + n) for n in range(4)]
    _, args, devices, _ = programs[0]
    for n in range(3):
        executables.load_or_compile(lambda: programs[n][0].lower(*args), ("f", n), args,
                                    devices)
    size = max(p.stat().st_size for p in kept.glob("*.exe"))     # all about the same
    paths = {n: kept / f"{executables.key((('f', n), [d.id for d in devices]), args)}.exe"
             for n in range(3)}
    for n, when in ((0, 100), (1, 300), (2, 200)):
        os.utime(paths[n], (when, when))
    executables.load_or_compile(_never, ("f", 0), args, devices)       # used again: newest
    monkeypatch.setattr(executables, "MAX_BYTES", 2 * size)
    executables.load_or_compile(lambda: programs[3][0].lower(*args), ("f", 3), args, devices)
    paths[3] = kept / f"{executables.key((('f', 3), [d.id for d in devices]), args)}.exe"
    assert {p.name for p in kept.glob("*.exe")} == {paths[0].name, paths[3].name}
