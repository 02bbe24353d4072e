import os
import threading
import time

from jaxrl.heap import collect_less
from tests.xla import COMPILING

collect_less()      # as every jaxrl process: most of a test's objects are made by tracing

# One CPU device, or eight for the multi-device tier (JAXRL_TEST_DEVICES=8, `make test-multi`),
# compiled at -O0 and without XLA:CPU's MLIR fusion emitters (see the Makefile); set before jax
# is imported anywhere.
DEVICES = int(os.environ.get("JAXRL_TEST_DEVICES", "1"))
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={DEVICES} {COMPILING}")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The persistent XLA compilation cache: JAXRL_TEST_CACHE_DIR (`make test` gives each run a fresh
# one, shared by its workers and the processes tests start); unset: no cache, here and in the
# `jaxrl train` and notebook processes the tests start (jaxrl/platform.py).
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ.get("JAXRL_TEST_CACHE_DIR", "")
if os.environ["JAX_COMPILATION_CACHE_DIR"]:
    from jaxrl.platform import use_compilation_cache
    use_compilation_cache()

import pytest  # noqa: E402

_TABLES: dict[str, list[tuple]] = {}


@pytest.fixture(scope="session")
def report_table():
    """report_table(title, header, row): rows are printed as a table at the end of the run."""

    def add(title: str, header: tuple, row: tuple):
        _TABLES.setdefault(title, [header]).append(row)

    return add


def pytest_terminal_summary(terminalreporter):
    for title, rows in _TABLES.items():
        widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
        terminalreporter.section(title)
        for k, row in enumerate(rows):
            terminalreporter.write_line("  ".join(str(c).ljust(w) for c, w in zip(row, widths)))
            if k == 0:
                terminalreporter.write_line("  ".join("-" * w for w in widths))


# The tiers are declared by markers in each module (`pytestmark`) or on single tests:
# - unit: unmarked; one CPU device; `make test-fast` (the edit-test loop);
# - slow: whole runs (jaxrl train, servers, processes, notebooks); one CPU device in-process,
#   their own device counts in the processes they start;
# - multi_device: meshes, collectives, pipelines; eight CPU devices, their own pytest
#   invocation (`make test-multi`);
# - tpu_aot: compiled for a TPU topology with libtpu (no TPU); gpu: needs an NVIDIA GPU.
# `make test` hands whole modules to its two workers in collection order
# (--no-loadscope-reorder), so the long ones (whole runs, TPU compiles) go first and the unit
# modules fill in behind them: no worker is left alone with a long module at a tier's end.
def pytest_collection_modifyitems(items):
    def long(item):
        return bool(item.get_closest_marker("slow") or item.get_closest_marker("tpu_aot"))

    items.sort(key=lambda item: not long(item))     # stable: collection order kept otherwise


def _device_count() -> int:
    import jax
    return jax.device_count()


@pytest.fixture(autouse=True)
def multi_device_tests_get_their_devices(request):
    """A multi-device test in a one-device run fails (never skips) and says how to run it."""
    if request.node.get_closest_marker("multi_device") and _device_count() < 8:
        pytest.fail("a multi-device test: run it with JAXRL_TEST_DEVICES=8 (make test-multi)")


@pytest.fixture(scope="module", autouse=True)
def no_engine_loop_outlives_its_module(request):
    """Fails a module that leaves a serving engine's loop running. A leaked loop keeps its
    thread, decode state and engine for the rest of the worker, and the crashes inside XLA
    (docs/testing.md, "Time and crashes") all came in workers that held such threads."""
    before = {t.ident for t in threading.enumerate()}
    yield
    deadline = time.monotonic() + 10.0      # a stopping loop finishes its current call first
    while leaked := [t for t in threading.enumerate()
                     if t.name == "engine-loop" and t.ident not in before and t.is_alive()]:
        if time.monotonic() > deadline:
            pytest.fail(f"{request.module.__name__} left {len(leaked)} engine loop(s) running: "
                        "stop every Orchestrator it starts (use it as a context manager)")
        time.sleep(0.05)


# JAXRL_TEST_TIMELINE=file: each test's worker, start and end (setup to teardown) and the CPU
# seconds it took (its worker's and the processes it started and waited for) appended to the
# file, to see how the suite's workers spend their time (idle tails, long fixtures) and what
# each test costs on two shared cores, where wall times stretch with the other worker's load.
if os.environ.get("JAXRL_TEST_TIMELINE"):
    import resource

    def _cpu_s() -> float:
        return sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                                      resource.getrusage(resource.RUSAGE_CHILDREN)))

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        start, cpu = time.time(), _cpu_s()
        yield
        with open(os.environ["JAXRL_TEST_TIMELINE"], "a") as f:
            f.write(f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')} {start:.2f} "
                    f"{time.time():.2f} {_cpu_s() - cpu:.2f} {item.nodeid}\n")
