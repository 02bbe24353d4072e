"""The installed package's imports are covered by its declared dependencies: every module
jaxrl/, serving/ and sharding/ import (at the top or inside a function) is the standard
library's, the package's own, or provided by a distribution that `pyproject.toml`'s
dependencies require (directly or through their own requirements), unless the import sits in
a `try` that handles ImportError (an optional feature that says what to install). So a venv
built from `pip install .` alone runs every command, the chat endpoint included."""

import ast
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("jaxrl", "serving", "sharding")


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[;\s]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _required_distributions() -> set[str]:
    """The declared dependencies and, recursively, their own (extras left out)."""
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    seen, todo = set(), [_name(d) for d in declared]
    while todo:
        dist = todo.pop()
        if dist in seen:
            continue
        seen.add(dist)
        try:
            requires = metadata.requires(dist) or []
        except metadata.PackageNotFoundError:
            continue
        todo += [_name(r) for r in requires if "extra ==" not in r]
    return seen


def _guarded(node, parents) -> bool:
    """Whether `node` sits in a try block that handles ImportError."""
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.Try) and any(
                h.type is not None and "ImportError" in ast.unparse(h.type)
                for h in node.handlers):
            return True
    return False


def _imports():
    """(top-level module, file:line) of every unguarded absolute import in the packages."""
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text())
            parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                if not _guarded(node, parents):
                    for name in names:
                        yield name.split(".")[0], f"{path.relative_to(ROOT)}:{node.lineno}"


def test_every_import_is_provided_by_a_declared_dependency():
    required = _required_distributions()
    provided_by = metadata.packages_distributions()
    missing = []
    for module, where in _imports():
        if module in sys.stdlib_module_names or module in PACKAGES:
            continue
        dists = {d.lower().replace("_", "-") for d in provided_by.get(module, [])}
        if not dists & required:
            missing.append(f"{module} ({where}; from {sorted(dists) or 'nothing installed'})")
    assert not missing, "imports no declared dependency provides: " + ", ".join(missing)
