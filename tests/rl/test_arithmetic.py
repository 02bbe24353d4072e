import numpy as np

from jaxrl.models.tokenizer import CharTokenizer
from jaxrl.data.sft import sft_dataset
from jaxrl.rl.tasks.arithmetic import ArithmeticConfig, ArithmeticTask


def test_held_out_problems_are_never_sampled_for_training():
    task = ArithmeticTask(ArithmeticConfig(max_operand=20, ops=("+", "-", "*")))
    held = {p.prompt for p in task.held_out(20)}
    assert len(held) == 20
    rng = np.random.default_rng(0)
    train = {task.sample(rng).prompt for _ in range(3000)}
    assert not held & train
    assert task.held_out(20) == task.held_out(20)


def test_answers_and_scoring():
    task = ArithmeticTask()
    p = task._problem(37, "+", 45)
    assert (p.prompt, p.answer) == ("37+45=", "82")
    assert task._problem(3, "-", 45).answer == "-42"
    assert task.score(p, "82") == 1.0 and task.score(p, "") == 0.0
    # Partial credit: half the share of characters matching, aligned from the units digit.
    assert task.score(p, "83") == 0.25          # "8" matches, "3" does not: 0.5 * 1/2
    assert task.score(p, "182") == 0.5 * 2 / 3  # "82" matches, one extra character
    assert task.score(p, "28") == 0.0
    exact = ArithmeticTask(ArithmeticConfig(partial_credit=False))
    assert exact.score(p, "83") == 0.0 and exact.score(p, "82") == 1.0


def test_sft_batches_mask_only_the_answer_and_are_deterministic():
    task = ArithmeticTask()
    tok = CharTokenizer(task.alphabet)
    ds = sft_dataset(task, tok, batch_size=4, seq_len=12, seed=3)
    batch = ds[5]
    np.testing.assert_array_equal(batch["input_ids"], ds[5]["input_ids"])
    assert not np.array_equal(batch["input_ids"], ds[6]["input_ids"])
    for ids, targets, mask in zip(batch["input_ids"], batch["targets"], batch["loss_mask"]):
        np.testing.assert_array_equal(ids[1:], targets[:-1])
        text = tok.decode(ids)
        prompt, answer = text.split("=")
        counted = [t for t, m in zip(targets, mask) if m]
        assert tok.decode(counted) == answer and counted[-1] == tok.eos_id
        a, op, b = prompt.replace("-", " - ").replace("+", " + ").split()
        assert int(answer) == (int(a) + int(b) if op == "+" else int(a) - int(b))
