"""train.stop_at_accuracy: the warm-up stops at the first check whose greedy accuracy on the fixed
training problems reaches the target, saves the weights of that step as step train.steps, and RL
numbers its steps on from there. Checked against a plain forward-pass greedy decode, and against
a warm-up of exactly that many steps with no stop (the same weights, bit for bit)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jaxrl.config import ConfigError, RunConfig, from_dict, load_run_config
from jaxrl.trainer.warmup import restore_for_eval
from jaxrl.trainer.warmup_stop import AccuracyStop
from tests.run import one_device

pytestmark = pytest.mark.slow

STEPS, EVERY, TARGET = 300, 10, 0.5
# test_rl.py's 0.1M-parameter model on sums of operands 0..4; its own cosine length
# (optim.decay_steps) so that a run with another train.steps follows the same schedule.
BASE = ["model.num_layers=2", "model.embed_dim=64", "model.mlp_dim=192", "model.num_heads=4",
        "model.num_kv_heads=2", "model.head_dim=16", "model.max_seq_len=32",
        "task.max_operand=4", "task.ops=['+']", "train.batch_size=32", "train.seq_len=8",
        "train.eval_problems=2", "train.check_problems=32", "train.log_every=10", "optim.lr=3e-3",
        "optim.warmup_steps=10", f"optim.decay_steps={STEPS}", "checkpoint.every=1000",
        "log.progress=false", "rl.prompts_per_step=4", "rl.group_size=4",
        "rl.max_prompt_len=8", "rl.max_new_tokens=4", "rl.engine.max_concurrent_decodes=16",
        "rl.pack_len=48",
        "rl.microbatch_rows=16", "rl.filter_overlong=false", "rl.filter_zero_advantage=false",
        "rl.eval_every=0", "rl.mode=sync"]


def rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def greedy_accuracy(model, task, tokenizer, problems, max_new_tokens):
    """Plain full-sequence forward passes, one token at a time: no engine, no KV cache."""
    right = 0
    for problem in problems:
        ids = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
        ids += tokenizer.encode(problem.prompt)
        out = []
        for _ in range(max_new_tokens):
            token = int(jnp.argmax(model(jnp.asarray([ids + out]))[0, -1]))
            if token == tokenizer.eos_id:
                break
            out.append(token)
        right += task.score(problem, tokenizer.decode(out)) >= 1.0
    return right / len(problems)


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("stopped") / "run"
    one_device.train("configs/demo_cpu.yaml", BASE + [
        f"train.steps={STEPS}", f"train.stop_at_accuracy={TARGET}",
        f"train.check_every={EVERY}", "rl.steps=2"], run_dir)
    return run_dir


def test_the_warm_up_stops_at_the_first_check_that_reaches_the_target(stopped):
    metrics = rows(stopped)
    checks = [(r["step"], r["check_accuracy"]) for r in metrics if "check_accuracy" in r]
    stop = checks[-1][0]
    assert [s for s, _ in checks] == list(range(EVERY, stop + 1, EVERY))
    assert all(a < TARGET for _, a in checks[:-1]) and checks[-1][1] >= TARGET, checks
    assert stop < STEPS   # the model learns these sums in well under 300 steps
    warm = [r["step"] for r in metrics if r.get("phase") == "warm-up" and "loss" in r]
    assert warm == list(range(1, stop + 1))
    # RL numbers its steps on from train.steps, and scores held-out problems before it starts.
    rl = [r["step"] for r in metrics if r.get("phase") == "rl" and "loss" in r]
    assert rl == [STEPS + 1, STEPS + 2]


def test_the_stop_is_checked_on_what_the_saved_weights_answer(stopped):
    model, task, tokenizer, step = restore_for_eval(stopped / "checkpoints", STEPS)
    cfg = from_dict(RunConfig, json.loads((stopped / "config.json").read_text()))
    problems = AccuracyStop(cfg, task, tokenizer, None).problems
    held_out = {p.prompt for p in task.held_out(1)}
    assert len(problems) == 32 and not held_out & {p.prompt for p in problems}
    logged = [r["check_accuracy"] for r in rows(stopped) if "check_accuracy" in r][-1]
    reference = greedy_accuracy(model, task, tokenizer, problems, cfg.rl.max_new_tokens)
    assert abs(reference - logged) <= 1 / 32, (reference, logged)


def test_the_saved_weights_are_those_of_a_warm_up_that_long(stopped, tmp_path):
    stop = [r["step"] for r in rows(stopped) if "check_accuracy" in r][-1]
    plain = tmp_path / "plain"
    one_device.train("configs/demo_cpu.yaml", BASE + [f"train.steps={stop}", "rl.steps=0",
                                                      "train.stop_at_accuracy=0"], plain)

    def params(run_dir, step):
        with ocp.CheckpointManager(run_dir / "checkpoints") as manager:
            return manager.restore(step, args=ocp.args.Composite(
                params=ocp.args.StandardRestore())).params

    a, b = params(stopped, STEPS), params(plain, stop)
    flat_a, flat_b = (dict(leaves(t)) for t in (a, b))
    assert flat_a.keys() == flat_b.keys()
    for name in flat_a:
        np.testing.assert_array_equal(flat_a[name], flat_b[name], err_msg=name)


def leaves(tree):
    return [(jax.tree_util.keystr(path), np.asarray(leaf))
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)]


@pytest.mark.parametrize("overrides, message", [
    (["train.stop_at_accuracy=1.5"], r"train.stop_at_accuracy=1.5 must be in \[0, 1\]"),
    (["train.check_every=0"], r"train.check_every=0 must be >= 1"),
    (["train.check_problems=0"], r"train.check_problems=0 must be >= 1"),
])
def test_bad_stop_settings_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_run_config("configs/demo_cpu.yaml", overrides)
