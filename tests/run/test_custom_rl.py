"""RL on a user's own task through `jaxrl train`'s path (jaxrl.commands.job.run), from a tiny random
Qwen2 folder: the shipped example (examples/custom_reward) trains with its rewards named by file
path, each call getting its row's fields; a reward that keeps raising stops the run with the
sample that broke it; filters that drop everything stop the run with the filter's name instead
of stalling."""

import json
from pathlib import Path

import pytest

from jaxrl.commands import job
from jaxrl.config import load_run_config
from jaxrl.rl.rewards import RewardFailure
from jaxrl.rollout.filters import FilterStall
from jaxrl.telemetry.metrics import read_metrics
from tests.tiny_hf import tiny_qwen

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "custom_reward"
RECORD = '''
import json, os

def record(prompt, completion, **fields):
    with open(os.environ["JAXRL_TEST_CALLS"], "a") as f:
        f.write(json.dumps({"prompt": prompt, "completion": completion, "fields": fields}) + "\\n")
    return 0.0

def constant(prompt, completion, **fields):
    return 0.5

def broken(prompt, completion, word):
    return {"score": 1}[word]
'''
SHRINK = ["model.dtype=float32", "log.progress=false", "train.eval_problems=4",
          "rl.steps=2", "rl.mode=sync", "rl.prompts_per_step=2", "rl.group_size=4",
          "rl.engine.max_concurrent_decodes=8",
          "rl.max_new_tokens=6", "rl.pack_len=96", "rl.microbatch_rows=8",
          # A random model answers nothing right and rarely stops: keep its samples anyway.
          "rl.filter_zero_advantage=false", "rl.filter_overlong=false"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("custom")
    rows = [json.loads(line) for line in (EXAMPLE / "prompts.jsonl").read_text().splitlines()]
    hf = tmp / "qwen"
    hf.mkdir()
    tiny_qwen(hf, [m["content"] + " " + r["word"][::-1] for r in rows for m in r["prompt"]]
              + ["user assistant"])
    (tmp / "record.py").write_text(RECORD)
    return {"hf": hf, "tmp": tmp, "rows": {r["word"]: r for r in rows}}


def _config(setup, name, *overrides):
    keys = {o.split("=")[0] for o in overrides}
    return load_run_config(EXAMPLE / "config.yaml", [
        f"hf_path={setup['hf']}", f"run_dir={setup['tmp'] / name}",
        *[o for o in SHRINK if o.split("=")[0] not in keys], *overrides])


def test_the_example_trains_on_its_own_rewards_with_each_rows_fields(setup, monkeypatch):
    calls = setup["tmp"] / "calls.jsonl"
    monkeypatch.setenv("JAXRL_TEST_CALLS", str(calls))
    monkeypatch.chdir(ROOT)     # the example names its rewards relative to the repository
    record = setup["tmp"] / "record.py"
    cfg = _config(setup, "example",
                  f"task.reward=[examples/custom_reward/rewards.py:correct, "
                  f"examples/custom_reward/rewards.py:short, {record}:record]",
                  "task.reward_weights=[1.0, 1.0, 0.0]")
    summary = job.run(cfg, log=lambda _: None)
    assert summary["rl"]["rl_steps"] == 2 and "eval_after" in summary["rl"]

    seen = [json.loads(line) for line in calls.read_text().splitlines()]
    # At least the two steps' samples and the held-out problems before and after RL.
    assert len(seen) >= 2 * 2 * 4 + 2 * 4
    for call in seen:
        word = call["fields"]["word"]
        question = setup["rows"][word]["prompt"][0]["content"]
        # The prompt is the row's chat messages as the template writes them (tests/tiny_hf.py).
        assert call["prompt"] == f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
        assert call["fields"] == {"word": word} and isinstance(call["completion"], str)
    rows = [r for r in read_metrics(setup["tmp"] / "example") if "reward" in r]
    assert [r["step"] for r in rows] == [1, 2]
    # Every reward here is 0, 0.1 or 1.1 (correct + short): the means are sums of those.
    assert all(0.0 <= r["reward"] <= 1.1 for r in rows)


def test_a_reward_that_keeps_raising_stops_the_run_naming_the_sample(setup, monkeypatch):
    lines = []
    cfg = _config(setup, "broken", f"task.reward={setup['tmp'] / 'record.py'}:broken",
                  "task.reward_weights=[]", "rl.max_reward_failures=2",
                  "train.eval_problems=0")
    with pytest.raises(RewardFailure) as e:
        job.run(cfg, log=lines.append)
    assert "raised KeyError" in str(e.value) and "rl.max_reward_failures=2" in str(e.value)
    assert "Spell the word" in str(e.value) and "fields" in str(e.value)
    assert any(line.startswith("reward: the reward raised KeyError") for line in lines)


def test_filters_that_drop_everything_stop_the_run_naming_the_filter(setup):
    # Equal rewards in every group: rl.filter_zero_advantage drops them all.
    cfg = _config(setup, "stall", f"task.reward={setup['tmp'] / 'record.py'}:constant",
                  "task.reward_weights=[]", "rl.filter_zero_advantage=true", "rl.filter_wait_s=3",
                  "train.eval_problems=0")
    with pytest.raises(FilterStall, match=r"rl.filter_wait_s=3\): dropped (\d+) of \1 samples "
                                          r"by rl.filter_zero_advantage"):
        job.run(cfg, log=lambda _: None)
