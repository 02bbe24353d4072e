"""A user's own task (jaxrl/rl/tasks/custom.py) and the reward's safety net (jaxrl/rl/rewards.py):
rows and reward functions from files by import path or from Python, TRL's batched form, chat
prompts through the template, and rewards that raise, hang or return junk."""

import json
import threading
import time

import numpy as np
import pytest

from jaxrl.config import ConfigError, load_run_config
from jaxrl.errors import UserError
from jaxrl.rl.config import RLConfig
from jaxrl.rl.rewards import RewardFailure, Scorer, score_samples
from jaxrl.rl.tasks.base import Problem
from jaxrl.rl.tasks.custom import CustomConfig, CustomTask, load_object
from jaxrl.rl.tasks.rows import TaskDataError
from jaxrl.rollout.filters import describe_drops

REWARDS = '''
import json, os

def exact(prompt, completion, answer, level):
    with open(os.environ["CALLS"], "a") as f:
        f.write(json.dumps([prompt, completion, answer, level]) + "\\n")
    return float(completion.strip() == answer)

def length(prompt, completion, **fields):
    return len(completion) / 10

def trl_style(prompts, completions, answer, **kwargs):      # TRL's reward_funcs form
    return [float(c == a) + 0.5 for c, a in zip(completions, answer)]

def shouts(prompt, completion, **fields):
    return "loud"

not_a_function = 3
'''


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def files(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1), "level": i % 3} for i in range(40)]
    monkeypatch.setenv("CALLS", str(tmp_path / "calls.jsonl"))
    monkeypatch.chdir(tmp_path)     # "my_rewards:exact" imports from the working directory
    return {"train": write_jsonl(tmp_path / "train.jsonl", rows[:30]),
            "eval": write_jsonl(tmp_path / "eval.jsonl", rows[30:]), "rows": rows,
            "calls": tmp_path / "calls.jsonl", "dir": tmp_path}


def test_rows_and_rewards_from_files_reach_the_reward_with_their_fields(files):
    cfg = load_run_config(None, ["task.name=custom", f"task.prompts={files['train']}",
                                 f"task.eval_prompts={files['eval']}", "task.answer_key=answer",
                                 "task.reward=my_rewards:exact,my_rewards.py:length",
                                 "task.reward_weights=[1.0, 2.0]"]).task
    task = CustomTask.from_config(cfg)
    assert len(task) == 30 and [p.prompt for p in task.held_out(100)] == \
        [f"{i}+1=" for i in range(30, 40)]
    problem = task.sample(np.random.default_rng(0))
    i = int(problem.prompt.split("+")[0])
    assert problem == Problem(f"{i}+1=", str(i + 1), {"answer": str(i + 1), "level": i % 3})
    rewards = task.score_group(problem, [str(i + 1), "nope", ""])
    # exact (weight 1) + 2 x len/10, written out by hand
    assert rewards == pytest.approx([1 + 2 * len(str(i + 1)) / 10, 0.8, 0.0])
    calls = [json.loads(line) for line in files["calls"].read_text().splitlines()]
    assert calls == [[problem.prompt, c, str(i + 1), i % 3] for c in (str(i + 1), "nope", "")]


def test_trl_batched_rewards_and_the_python_api(files):
    from my_rewards import trl_style  # noqa: E402  (written by the fixture)

    task = CustomTask.from_rows(files["rows"], trl_style, batched=True, held_out=20)
    held = {p.prompt for p in task.held_out(100)}
    assert held and len(held) + len(task) == 40 and not held & {p.prompt for p in task._train}
    problem = task.held_out(1)[0]
    assert task.score_group(problem, [problem.fields["answer"], "x"]) == [1.5, 0.5]
    assert task.score(problem, "x") == 0.5


def test_chat_message_prompts_are_written_with_the_models_template():
    class Tok:
        chat_template = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]"
                         "{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}"
                         "[assistant]{% endif %}")
        bos_token, eos_token = "<s>", "</s>"

    rows = [{"prompt": [{"role": "system", "content": "Be brief."},
                        {"role": "user", "content": f"2+{i}?"}], "answer": str(2 + i)}
            for i in range(30)]
    task = CustomTask.from_rows(rows, lambda p, c, **f: 0.0, held_out=rows[:1],
                                tokenizer=Tok(), answer_key="answer")
    # BOS is jaxrl's to add (prompt_ids): the template's is cut.
    assert task.held_out(1)[0].prompt == "[system]Be brief.[user]2+0?[assistant]"
    with pytest.raises(TaskDataError, match="no chat template"):
        CustomTask.from_rows(rows, lambda p, c: 0.0, tokenizer=None)


def test_held_out_is_a_percent_or_rows():
    rows = [{"prompt": f"p{i}"} for i in range(200)]
    share = len(CustomTask.from_rows(rows, lambda p, c: 0.0, held_out=20).held_out(200))
    assert 20 <= share <= 60          # about 40 of 200, by a hash of each prompt
    own = CustomTask.from_rows(rows, lambda p, c: 0.0, held_out=rows[:3])
    assert [p.prompt for p in own.held_out(10)] == ["p0", "p1", "p2"]
    with pytest.raises(ValueError, match="held_out=101: a percent of the rows"):
        CustomTask.from_rows(rows, lambda p, c: 0.0, held_out=101)


def test_the_previous_release_s_held_out_percent_still_works_with_a_warning():
    rows = [{"prompt": f"p{i}"} for i in range(200)]
    with pytest.warns(DeprecationWarning, match=r"held_out_percent=\.\.\.\) is deprecated: "
                                                r"pass held_out=\.\.\."):
        old = CustomTask.from_rows(rows, lambda p, c: 0.0, held_out_percent=20)
    new = CustomTask.from_rows(rows, lambda p, c: 0.0, held_out=20)
    assert [p.prompt for p in old.held_out(200)] == [p.prompt for p in new.held_out(200)]
    with pytest.raises(TypeError, match="both held_out_percent= and held_out="):
        CustomTask.from_rows(rows, lambda p, c: 0.0, held_out=5, held_out_percent=20)


@pytest.mark.parametrize("overrides, match", [
    (["task.reward=my_rewards:exact"], "needs task.prompts"),
    (["task.prompts=train.jsonl"], "task.reward is empty"),
    (["task.prompts=train.jsonl", "task.reward=my_rewards.exact"], "must be 'module:function'"),
    (["task.prompts=train.jsonl", "task.reward=a:b,c:d", "task.reward_weights=[1.0]"],
     "1 values for 2 rewards"),
    (["task.factory=pkg:make", "task.prompts=train.jsonl"], "task.prompts cannot be set"),
])
def test_bad_configs_name_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_run_config(None, ["task.name=custom", *overrides])


def test_bad_files_and_import_paths_name_what_is_wrong(files):
    def build(**kw):
        return CustomTask.from_config(CustomConfig(**{"prompts": files["train"],
                                                      "reward": ("my_rewards:exact",), **kw}))

    with pytest.raises(UserError, match="cannot import 'no_such_module'"):
        build(reward=("no_such_module:f",))
    with pytest.raises(UserError, match="has no 'missing'"):
        build(reward=("my_rewards:missing",))
    with pytest.raises(UserError, match="is a int, not a function"):
        build(reward=("my_rewards:not_a_function",))
    with pytest.raises(UserError, match="no file"):
        load_object("nowhere.py:f", "task.reward")
    bad = write_jsonl(files["dir"] / "bad.jsonl", [{"prompt": "a"}, {"question": "b"}])
    with pytest.raises(TaskDataError, match=r"bad.jsonl row 2 has no 'prompt' prompt.*question"):
        build(prompts=bad)
    clash = write_jsonl(files["dir"] / "clash.jsonl", [{"prompt": "a", "completion": "b"}])
    with pytest.raises(TaskDataError, match="column 'completion'"):
        build(prompts=clash)
    with pytest.raises(TaskDataError, match="lacks the answer column 'solution'"):
        build(answer_key="solution")
    task = CustomTask.from_rows(files["rows"], lambda p, c, **f: 1.0)
    with pytest.raises(UserError, match="task.answer_key"):
        task.warmup_sample(np.random.default_rng(0))


def _scorer(reward, warnings, **kw):
    task = CustomTask.from_rows([{"prompt": f"p{i}"} for i in range(40)], reward)
    return task, Scorer(task, **{"timeout_s": 5.0, "max_failures": 3, "warn": warnings.append,
                                 **kw})


def test_a_failing_reward_costs_its_group_until_it_fails_too_often():
    calls, warnings = [], []

    def flaky(prompt, completion, **fields):
        calls.append(completion)
        if completion == "boom":
            raise KeyError("the grader lost its key")
        return 1.0

    task, scorer = _scorer(flaky, warnings)
    problem = task.sample(np.random.default_rng(0))
    assert scorer.group(problem, ["boom", "fine"]) is None
    assert len(warnings) == 1 and "raised KeyError: 'the grader lost its key'" in warnings[0]
    assert repr(problem.prompt) in warnings[0] and "'boom'" in warnings[0]
    assert scorer.group(problem, ["boom"]) is None
    np.testing.assert_array_equal(scorer.group(problem, ["fine", "fine"]), [1.0, 1.0])
    assert scorer.group(problem, ["boom"]) is None and scorer.group(problem, ["boom"]) is None
    with pytest.raises(RewardFailure, match=r"3 groups in a row.*rl.max_reward_failures=3"):
        scorer.group(problem, ["boom"])
    assert scorer.failures == 5


def test_a_hung_reward_times_out_and_the_scorer_goes_on():
    release, warnings = threading.Event(), []

    def hangs(prompt, completion, **fields):
        if completion == "hang":
            release.wait(60)
        return 0.5

    task, scorer = _scorer(hangs, warnings, timeout_s=0.2)
    problem = task.sample(np.random.default_rng(0))
    assert scorer.group(problem, ["hang"]) is None
    assert "took longer than rl.reward_timeout_s=0.2 s" in warnings[0]
    np.testing.assert_array_equal(scorer.group(problem, ["ok"]), [0.5])
    release.set()


@pytest.mark.parametrize("value", [None, "loud", float("nan"), float("inf"), True])
def test_a_reward_that_is_not_a_finite_number_is_refused(value):
    task = CustomTask.from_rows([{"prompt": f"p{i}"} for i in range(40)], lambda p, c: value)
    with pytest.raises(ValueError, match="a reward is a"):
        score_samples(task, task.sample(np.random.default_rng(0)), ["x"])


def test_drops_are_described_largest_first_with_what_to_change():
    before = {"scored": 10, "dropped_overlong": 2}
    now = {"scored": 74, "dropped_overlong": 50, "dropped_zero_advantage": 8,
           "dropped_reward_error": 4}
    text = describe_drops(now, before, RLConfig(max_new_tokens=64, pack_len=96))
    assert text.startswith("dropped 48 of 68 samples by rl.filter_overlong (samples cut at "
                           "rl.max_new_tokens=64")
    assert text.index("rl.filter_zero_advantage") < text.index("the reward's failures")
    assert describe_drops(before, before, RLConfig()) == ""


def test_scoring_is_thread_safe_under_concurrent_groups():
    task, scorer = _scorer(lambda p, c: time.sleep(0.001) or float(len(c)), [])
    problem = task.sample(np.random.default_rng(0))
    out = [None] * 16
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(
        i, scorer.group(problem, ["x" * i]))) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [float(o[0]) for o in out] == [float(i) for i in range(16)]
