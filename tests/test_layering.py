"""Imports point down. The parts of jaxrl/, serving/ and sharding/, lowest first; a module may
import its own part and the parts below it, never one above (lazy imports inside functions
included). This list is the one place the layering is written."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LAYERS = [
    ("jaxrl.errors", "jaxrl.platform", "jaxrl.heap", "jaxrl.optim_config",   # no jaxrl imports
     "jaxrl.executables", "jaxrl.deprecation"),
    ("jaxrl.models",),                       # the transformer, HF loading and export
    ("sharding",),                           # meshes, pipelines, offload, resharding, AOT
    # serving/, room by room (serving/__init__.py says what each holds):
    ("serving.proto",),                      # the wire formats, generated
    ("serving.runner",),                     # the Engine: programs, sampling, paged KV, kernels
    ("serving.core",),                       # sequences, scheduler, pages, loop, orchestrator
    ("serving.weights",),                    # weight updates: stream, tcp bulk, jax transfer
    ("serving.frontends",),                  # JetStream gRPC, OpenAI HTTP, health, metrics
    ("serving.fleet",),                      # the Generation interface, client, replicas, join
    ("jaxrl.data", "jaxrl.rl"),              # batches and rollouts; tasks, rewards, losses
    ("jaxrl.train",),                        # one train step, optimizer, checkpoints
    ("jaxrl.tinker",),                       # the Tinker API: LoRA clients, their samplers
    ("jaxrl.config",),                       # the run's configuration, every key
    ("jaxrl.recipe",),                       # what a config builds: model config, task
    ("jaxrl.telemetry",),                    # metrics files, plots, progress
    ("jaxrl.rollout",),                      # fleet, publisher, actor, episodes, agents
    ("jaxrl.eval",),                         # held-out evaluation
    ("jaxrl.trainer",),                      # the warm-up and RL runs
    ("jaxrl.commands",),                     # train, serve, compile, bench
    ("jaxrl.api", "jaxrl.cli"),              # the Python API and the command line
]
RANK = {part: i for i, parts in enumerate(LAYERS) for part in parts}
TOP_LEVEL = ("jaxrl", "serving", "sharding")


def part_of(module: str) -> str | None:
    """The layer part a dotted module name belongs to (its longest listed prefix)."""
    bits = module.split(".")
    for n in range(len(bits), 0, -1):
        if ".".join(bits[:n]) in RANK:
            return ".".join(bits[:n])
    return None


def modules():
    for top in TOP_LEVEL:
        for path in sorted((ROOT / top).rglob("*.py")):
            if "proto" in path.parts:               # generated gRPC stubs
                continue
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            yield name.removesuffix(".__init__"), path


def imported(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from jaxrl import x` names the module jaxrl.x when x is one
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return [(line, name) for line, name in out if name.split(".")[0] in TOP_LEVEL]


def test_every_module_belongs_to_a_listed_part():
    unlisted = [name for name, _ in modules()
                if part_of(name) is None and name not in ("jaxrl", "serving")]
    assert unlisted == [], f"add these to LAYERS: {unlisted}"


def test_serving_holds_no_module_outside_its_rooms():
    loose = sorted(p.name for p in (ROOT / "serving").glob("*.py") if p.name != "__init__.py")
    assert loose == [], f"put these in a subpackage of serving/: {loose}"


def test_no_module_imports_a_part_above_its_own():
    upward = []
    for name, path in modules():
        mine = part_of(name)
        if mine is None:
            continue
        for line, target in imported(path):
            theirs = part_of(target)
            if theirs is not None and RANK[theirs] > RANK[mine]:
                upward.append(f"{path.relative_to(ROOT)}:{line} ({mine}) imports {target} "
                              f"({theirs}, above it)")
    assert upward == [], "\n".join(upward)


def test_the_check_finds_an_upward_import(tmp_path):
    """The checker itself: serving importing the trainer is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text("from jaxrl.trainer import rl\nimport jaxrl.models\n")
    found = [t for _, t in imported(bad) if RANK[part_of(t)] > RANK["serving.fleet"]]
    assert found == ["jaxrl.trainer.rl"]


def _module_of(target: str, known: set[str]) -> str | None:
    """The project module an imported name is (`a.b.c` may name `c` in module `a.b`)."""
    while target and target not in known:
        target = target.rpartition(".")[0]
    return target or None


def import_cycles() -> list[list[str]]:
    """Modules that import each other, directly or around a loop (lazy imports included, since
    a lazy import is how a cycle is held open): the strongly connected components of more than
    one module, by Tarjan's algorithm."""
    paths = dict(modules())
    known = set(paths)
    graph = {name: {m for _, t in imported(path)
                    if (m := _module_of(t, known)) and m != name
                    and not name.startswith(m + ".")}       # a package's own __init__
             for name, path in paths.items()}
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                on.discard(w)
                component.append(w)
            on.discard(v)
            if component:
                out.append(sorted([v, *component]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    assert import_cycles() == []


def test_the_engine_loops_decode_path_names_five_files_that_call_each_other():
    """serving/core/engine_loop.py's docstring lists the files a decode step passes through
    before the model's forward; each exists, there are at most five, and each is reached from
    the one a reader came from (the loop calls the scheduler and the engine itself)."""
    doc = ast.get_docstring(ast.parse((ROOT / "serving/core/engine_loop.py").read_text()))
    block = doc[doc.index("A decode step passes through"):doc.index("tests/test_layering.py")]
    path = [line.split()[0] for line in block.splitlines()
            if line.startswith("    serving/")]
    assert path[0] == "serving/core/engine_loop.py" and len(path) <= 5, path
    assert all((ROOT / p).is_file() for p in path), path

    def module(p):
        return p.removesuffix(".py").replace("/", ".")

    def imports(p, target):
        return any(name == target or name.startswith(target + ".")
                   for _, name in imported(ROOT / p))

    callers = {"serving/runner/engine.py": "serving/core/engine_loop.py"}
    for before, after in zip(path, path[1:]):
        assert imports(callers.get(after, before), module(after)), (before, after)
    assert imports(path[-1], "jaxrl.models"), "the last file runs the model's forward"
    steps = (ROOT / path[-1]).read_text()
    assert "model.extend(" in steps and "PagedKV" in steps and "sample(" in steps
