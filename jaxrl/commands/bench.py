"""`jaxrl bench NAME [args...]`: the scripts in the repository's bench/ folder, each printing
ratios measured side by side. They live beside the package, not in it (they need the test
extras and the repository's configs), so they are found from the source tree: an editable
install (`pip install -e .`) has them, a wheel does not."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import jaxrl
from jaxrl.errors import UserError

BENCH_DIR = Path(jaxrl.__file__).resolve().parent.parent / "bench"


def benchmarks() -> dict[str, str]:
    """{name: the first line of its docstring} for every bench/NAME.py, by name."""
    if not BENCH_DIR.is_dir():
        raise UserError(f"no bench/ folder at {BENCH_DIR}: the benchmarks come with the "
                        f"repository, not the wheel; run them from a clone installed with "
                        f"`pip install -e .`")
    found = {}
    for path in sorted(BENCH_DIR.glob("[!_]*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        found[path.stem] = doc.splitlines()[0] if doc else ""
    return found


def listing(found: dict[str, str] | None = None) -> str:
    """The benchmarks, one a line; without `found`, those in bench/ or why there are none."""
    if found is None:
        try:
            found = benchmarks()
        except UserError as e:
            return str(e)
    width = max(map(len, found), default=0)
    return "\n".join(f"  {name:<{width}}  {line}" for name, line in found.items()) \
        or f"  none in {BENCH_DIR}"


def run_benchmark(name: str, args: list[str]) -> int:
    """Runs bench/NAME.py with `args` and returns its exit status. A fresh Python process, so
    that the benchmark parses its own arguments and sets JAX up its own way before importing it
    (bench/engine.py picks the CPU platform unless JAX_PLATFORMS says otherwise)."""
    known = benchmarks()
    if name not in known:
        raise UserError(f"unknown benchmark {name!r}; choose one of: {', '.join(known)}")
    try:
        return subprocess.run([sys.executable, str(BENCH_DIR / f"{name}.py"), *args]).returncode
    except KeyboardInterrupt:  # the benchmark got the same Ctrl-C and has stopped
        return 130
