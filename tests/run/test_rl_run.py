"""The RL run owns what it builds: when any of its parts fails to build, every part built before
it is closed (no engine loop, actor, pipeline or checkpointer thread outlives the failure); and
a run whose loop fails leaves nothing running either."""

import gc
import threading
import time

import pytest

from jaxrl.commands import job
from jaxrl.recipe import model_config
from jaxrl.rollout import generation
from jaxrl.rollout.generation import engine_config
from jaxrl.trainer import rl as rl_run
from jaxrl.trainer import rl_leader
from serving.runner.engine import Engine
from tests.run.test_rl import config, quiet, rl_run_dir

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("warm")
    job.run(config(run_dir, "rl.steps=0", "train.steps=2"), log=quiet)
    return run_dir / "checkpoints"


def threads_after(before: set, timeout: float = 20.0) -> list[str]:
    """Threads alive now that were not before (waiting up to `timeout` for stragglers)."""
    deadline = time.monotonic() + timeout
    while True:
        extra = [t for t in threading.enumerate() if t not in before and t.is_alive()]
        if not extra or time.monotonic() > deadline:
            return [t.name for t in extra]
        time.sleep(0.1)


class Boom(RuntimeError):
    pass


def failing(*args, **kwargs):
    raise Boom("a part failed to build")


def failing_like(original):
    """`original` (a class or a function) failing when called; a class keeps its other
    attributes."""
    if isinstance(original, type):
        return type(original.__name__, (original,), {"__init__": failing})
    return failing


# Each part of the run, in the order it is built (the module attribute the run builds it by).
PARTS = [(rl_run, "RLTrainer"), (generation, "start"), (rl_leader, "RolloutLog"),
         (rl_leader, "Actor"), (rl_leader, "rl_batches"), (rl_leader, "MetricsLogger"),
         (rl_leader, "Progress")]


@pytest.mark.parametrize("module,name", PARTS, ids=[n for _, n in PARTS])
def test_a_part_that_fails_to_build_leaves_nothing_running(warm, tmp_path, monkeypatch,
                                                           module, name):
    cfg = config(rl_run_dir(warm, tmp_path), "train.steps=2", "rl.steps=2", "rl.mode=async",
                 "train.eval_problems=0")
    before = set(threading.enumerate())
    monkeypatch.setattr(module, name, failing_like(getattr(module, name)))
    with pytest.raises(Boom):
        rl_run.reinforce(cfg, log=quiet)
    assert threads_after(before) == []


def test_a_loop_that_fails_leaves_nothing_running(warm, tmp_path, monkeypatch):
    cfg = config(rl_run_dir(warm, tmp_path), "train.steps=2", "rl.steps=3", "rl.mode=async",
                 "train.eval_problems=0")
    before = set(threading.enumerate())
    steps = []
    train = rl_run.RLTrainer.train

    def train_then_fail(self, arrays):
        steps.append(self.step)
        if len(steps) == 2:
            raise Boom("the second step failed")
        return train(self, arrays)

    monkeypatch.setattr(rl_run.RLTrainer, "train", train_then_fail)
    with pytest.raises(Boom):
        rl_run.reinforce(cfg, log=quiet)
    assert len(steps) == 2
    assert threads_after(before) == []


@pytest.mark.parametrize("compile", ["as_needed", "all"])
def test_the_engine_compiles_what_rl_generation_compile_says(warm, tmp_path, compile):
    """as_needed: the programs of the largest batches and chunks before the first step, the
    rest only once calls ask (serving/runner/programs.py); all: every program first, as `jaxrl
    serve` does. No thread of either outlives the run."""
    cfg = config(rl_run_dir(warm, tmp_path), "train.steps=2", "rl.steps=1", "rl.mode=sync",
                 "train.eval_problems=0", f"rl.generation.compile={compile}")
    gc.collect()                      # no engine of an earlier test shares its programs
    before = set(threading.enumerate())
    lines = []
    rl_run.reinforce(cfg, log=lines.append)
    [line] = [x for x in lines if x.startswith("engine: compiled")]
    programs = int(line.split()[2])
    engine = Engine(model_config(cfg), engine_config(cfg, model_config(cfg)))
    shapes = engine.programs.shapes()
    if compile == "all":
        assert programs == len(shapes) and "every shape it can run" in line
    else:
        assert programs == sum(map(engine.programs._first, shapes)) < len(shapes)
    assert threads_after(before) == []
