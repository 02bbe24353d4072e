"""Modules a reader can hold: no file of jaxrl/, serving/ or sharding/ over 500 lines, no
function over 60 and none with more than 8 parameters (shared/STYLE.md); generated gRPC stubs
and a Pallas kernel's list of refs aside. The file limit is a guide, not a squeeze: most files
stay near 400 (STYLE.md), and one concept is not split in two, nor one file padded out with
another's, to meet it. Group parameters into the object they describe rather than raise the
parameter limit."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_FILE, MAX_FUNCTION, MAX_PARAMETERS = 500, 60, 8


def sources():
    for top in ("jaxrl", "serving", "sharding"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if "proto" not in path.parts:
                yield path


def test_no_file_is_over_the_limit():
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in sources()
            if (n := len(p.read_text().splitlines())) > MAX_FILE]
    assert long == [], long


def test_no_function_is_over_the_limit():
    long = []
    for path in sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {n} lines")
    assert long == [], long


def _parameters(node) -> list[str]:
    """A function's parameters, self/cls and a Pallas kernel's refs (`*_ref`, which Pallas
    passes positionally, one per operand) aside."""
    a = node.args
    names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
    names += [x.arg for x in (a.vararg, a.kwarg) if x is not None]
    return [n for n in names if n not in ("self", "cls") and not n.endswith("_ref")]


def test_no_function_takes_more_than_eight_parameters():
    wide = []
    for path in sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = len(_parameters(node))
                if n > MAX_PARAMETERS:
                    wide.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {n}")
    assert wide == [], wide
