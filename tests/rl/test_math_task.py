import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from jaxrl.rl.tasks.base import Problem
from jaxrl.rl.tasks.math import (DEFAULT_PROMPT, MathConfig, MathTask, TaskDataError,
                                 VerifyWorker, last_boxed)

DATA = Path(__file__).parents[1] / "data"
GSM8K, MATH = str(DATA / "gsm8k_tiny.jsonl"), str(DATA / "math_tiny.jsonl")
# The final answers of the shipped files, written out by hand.
GSM8K_ANSWERS = ["30", "6", "1200", "2640", "350", "36", "882", "53", "360", "625000", "-7", "15"]
MATH_ANSWERS = ["\\frac{1}{2}", "\\frac{\\sqrt{3}}{2}", "6", "9", "2, 3", "5\\sqrt{2}"]


def write_jsonl(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def task() -> MathTask:
    return MathTask(MathConfig(train_path=GSM8K, eval_path=MATH))


def test_loads_both_formats_and_extracts_final_answers(task):
    assert len(task) == 12
    assert [p.answer for p in task._train] == GSM8K_ANSWERS
    assert [p.answer for p in task.held_out(100)] == MATH_ANSWERS
    first = task.held_out(1)[0]
    assert first.prompt == ("What is the value of $\\frac{3}{4} - \\frac{1}{4}$?\n"
                            "Please reason step by step, and put your final answer within "
                            "\\boxed{}.")


def test_parquet_and_json_array_load_the_same_problems(tmp_path):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    rows = [json.loads(line) for line in Path(GSM8K).read_text().splitlines()]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    (tmp_path / "train.json").write_text(json.dumps(rows))
    want = MathTask(MathConfig(train_path=GSM8K, eval_path=MATH))._train
    for name in ("train.parquet", "train.json"):
        got = MathTask(MathConfig(train_path=str(tmp_path / name), eval_path=MATH))
        assert got._train == want


def test_prompt_template_named_keys_and_max_problems(tmp_path):
    rows = [{"q": f"What is {i}+1?", "a": str(i + 1)} for i in range(10)]
    task = MathTask(MathConfig(train_path=write_jsonl(tmp_path / "t.jsonl", rows[:5]),
                               eval_path=write_jsonl(tmp_path / "e.jsonl", rows[5:]),
                               question_key="q", answer_key="a",
                               prompt_template="Q: {question}\nA:", max_problems=3))
    assert task._train == [Problem(f"Q: What is {i}+1?\nA:", str(i + 1)) for i in range(3)]
    assert [p.answer for p in task.held_out(100)] == ["6", "7", "8"]
    assert "{question}" in DEFAULT_PROMPT and "\\boxed{{}}" in DEFAULT_PROMPT


def test_last_boxed_balances_braces():
    assert last_boxed("so $\\boxed{\\frac{a}{\\sqrt{b}}}$.") == "\\frac{a}{\\sqrt{b}}"
    assert last_boxed("\\boxed{1} then \\fbox{2}") == "2"
    assert last_boxed("is $\\boxed 5$.") == "5"
    assert last_boxed("\\boxed{\\frac{1}{2}") is None
    assert last_boxed("no box") is None


def test_held_out_split_is_disjoint_and_deterministic():
    cfg = MathConfig(train_path=GSM8K, held_out_percent=50)
    task = MathTask(cfg)
    held = task.held_out(100)
    assert held == MathTask(cfg).held_out(100) and task.held_out(2) == held[:2]
    rng = np.random.default_rng(0)
    train = {task.sample(rng) for _ in range(300)}
    assert held and not set(held) & train
    assert sorted(p.answer for p in train | set(held)) == sorted(GSM8K_ANSWERS)


def test_eval_file_problems_are_never_trained_on(tmp_path):
    rows = [json.loads(line) for line in Path(GSM8K).read_text().splitlines()]
    task = MathTask(MathConfig(train_path=GSM8K, eval_path=write_jsonl(tmp_path / "e.jsonl",
                                                                       rows[:3])))
    assert len(task) == 9 and not set(task.held_out(3)) & set(task._train)


@pytest.mark.parametrize("answer,completion", [
    ("42", "So the total is $\\boxed{42}$."),
    ("42", "The answer is 42"),
    ("1200", "The answer is 1,200."),
    ("1200", "\\boxed{1,200}"),
    ("1200", "1200"),
    ("\\frac{1}{2}", "0.5"),
    ("0.5", "$\\frac{1}{2}$"),
    ("\\frac{\\sqrt{3}}{2}", "\\boxed{\\frac{\\sqrt3}{2}}"),
    ("-7", "It ends at -7 degrees."),
])
def test_equivalent_answers_score_one(task, answer, completion):
    assert task.score(Problem("", answer), completion) == 1.0


@pytest.mark.parametrize("completion", [
    "\\boxed{43}", "The answer is 41.", "", "I don't know", "}}}{{\\boxed{", "\\frac{",
    "\x00\x01\x02", "\\boxed{" * 200, "9" * 5000 + "/0", "ⅹ∞" * 500,
])
def test_wrong_and_garbage_completions_score_zero(task, completion):
    assert task.score(Problem("", "42"), completion) == 0.0


def test_runaway_expression_is_cut_off_by_the_timeout():
    task = MathTask(MathConfig(train_path=GSM8K, eval_path=MATH, verify_timeout_s=1))
    start = time.monotonic()
    assert task.score(Problem("", "42"), "\\boxed{10^{10^{10}}}") == 0.0
    assert time.monotonic() - start < 60     # the 1 s timeout ended it: the power takes hours


def test_scoring_off_the_main_thread(task):
    completions = ["\\boxed{1,200}", "1201", "}{garbage"]
    scores = [None] * 3

    def work(i):
        scores[i] = task.score(Problem("", "1200"), completions[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert scores == [1.0, 0.0, 0.0]


def test_worker_is_replaced_after_a_check_outlives_its_backstop():
    worker = VerifyWorker(timeout_s=5, backstop_s=0.5)
    assert worker.verify("7", "7") is True
    pid = worker.pid
    assert worker.verify("42", "\\boxed{10^{10^{10}}}") is False
    assert worker.pid is None
    assert worker.verify("7", "\\boxed{7}") is True and worker.pid != pid


@pytest.mark.parametrize("kwargs,match", [
    (dict(prompt_template="Solve it."), r"prompt_template='Solve it.' must contain '\{question\}'"),
    (dict(prompt_template="{question} \\boxed{}"), r"not a valid format string.*doubled"),
    (dict(held_out_percent=0), r"held_out_percent=0 must be in \[1, 50\]"),
    (dict(question_key="q"), r"question_key='q' and task.answer_key='' must both be set"),
    (dict(max_problems=-1), r"max_problems=-1 must be >= 0"),
    (dict(verify_timeout_s=0), r"verify_timeout_s=0 must be >= 1"),
])
def test_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MathConfig(**kwargs)


def test_data_errors_name_the_problem(tmp_path):
    def fails(match, **kwargs):
        with pytest.raises(TaskDataError, match=match):
            MathTask(MathConfig(**{"eval_path": MATH, **kwargs}))

    fails(r"task.train_path is not set", train_path="")
    fails(r"missing.jsonl does not exist", train_path=str(tmp_path / "missing.jsonl"))
    (tmp_path / "d.csv").write_text("question,answer\n")
    fails(r"extension '.csv'; allowed: .jsonl, .json, .parquet", train_path=str(tmp_path / "d.csv"))
    (tmp_path / "empty.jsonl").write_text("\n")
    fails(r"empty.jsonl is empty", train_path=str(tmp_path / "empty.jsonl"))
    (tmp_path / "bad.jsonl").write_text('{"question": "a", "answer": "#### 1"}\n{oops\n')
    fails(r"bad.jsonl row 2 is not valid JSON", train_path=str(tmp_path / "bad.jsonl"))
    rows = [{"question": "a", "answer": "#### 1"}, {"prompt": "b", "response": "2"}]
    fails(r"row 2 lacks 'question' and 'answer' \(its keys: \['prompt', 'response'\]\)",
          train_path=write_jsonl(tmp_path / "k.jsonl", rows))
    fails(r"row 1 lacks 'question'/'answer' or 'problem'/'solution' \(its keys: \['prompt', ",
          train_path=write_jsonl(tmp_path / "k2.jsonl", rows[1:]))
    rows = [{"question": "a", "answer": "#### 1"}, {"question": "b", "answer": "so 2"}]
    fails(r"g.jsonl row 2: the GSM8K answer has no final answer after '####'",
          train_path=write_jsonl(tmp_path / "g.jsonl", rows))
    rows = [{"problem": "a", "solution": "so $x = 3$"}]
    fails(r"m.jsonl row 1: the MATH solution has no complete \\boxed",
          train_path=write_jsonl(tmp_path / "m.jsonl", rows))
    fails(r"holding out 5% of the 12 problems in .*gsm8k_tiny.jsonl leaves no evaluation",
          train_path=GSM8K, eval_path="")
    fails(r"every problem of task.train_path=.* is also in task.eval_path",
          train_path=GSM8K, eval_path=GSM8K)
