import os
import threading
import time

# Eight CPU devices for meshes and collectives, compiled at -O0 as `make test` does (see its
# TEST_XLA_FLAGS); must be set before jax is imported anywhere.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 "
                      "--xla_backend_optimization_level=0")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# No persistent XLA compilation cache: with one, every compile ends in `executable.serialize()`.
# Full runs crashed a worker five times in XLA:CPU: three inside that call (two aborts and a
# segfault, the last in CI on a serving engine's thread), two in compiles on such threads; twice
# pytest-xdist then stalled, once until CI's limit. Tests share compiled functions in-process.
# Empty: also off in the `jaxrl train` and notebook processes the tests start (jaxrl/platform.py).
os.environ["JAX_COMPILATION_CACHE_DIR"] = ""

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


# The longest modules first (measured on the 2-core CI machine, seconds): `make test` hands
# whole modules to its two workers in collection order, so a long module collected last would
# run alone at the end while the other worker idles.
_HEAVY_FIRST = ["sharding/test_tpu_aot.py", "run/test_rl.py", "colab/test_notebooks.py",
                "serving/test_paged.py", "run/test_fleet_rl.py", "test_serve.py",
                "reliability/test_sigkill.py", "reliability/test_load.py",
                "run/test_multihost.py", "sharding/test_pipeline.py", "run/test_tool_calc.py",
                "run/test_long_tail.py", "run/test_warmup_stop.py", "run/test_agents.py"]


def pytest_collection_modifyitems(items):
    def rank(item):
        path = item.nodeid.split("::")[0].removeprefix("tests/")
        return _HEAVY_FIRST.index(path) if path in _HEAVY_FIRST else len(_HEAVY_FIRST)
    items.sort(key=rank)     # stable: the order within a module is kept


@pytest.fixture(scope="module", autouse=True)
def no_engine_loop_outlives_its_module(request):
    """Fails a module that leaves a serving engine's loop running. A leaked loop keeps its
    thread, decode state and engine for the rest of the worker, and the crashes inside XLA
    (README, "Crashes in the suite") all came in workers that held such threads."""
    before = {t.ident for t in threading.enumerate()}
    yield
    deadline = time.monotonic() + 10.0      # a stopping loop finishes its current call first
    while leaked := [t for t in threading.enumerate()
                     if t.name == "engine-loop" and t.ident not in before and t.is_alive()]:
        if time.monotonic() > deadline:
            pytest.fail(f"{request.module.__name__} left {len(leaked)} engine loop(s) running: "
                        "stop every Orchestrator it starts (use it as a context manager)")
        time.sleep(0.05)
