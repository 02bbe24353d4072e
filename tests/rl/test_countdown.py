"""The long-tailed countdown task: problems, exact and partial scores, the length distribution,
held-out problems never sampled for training."""

import numpy as np

from jaxrl.rl.tasks.countdown import CountdownConfig, CountdownTask


def test_a_problem_and_its_answer():
    p = CountdownTask.problem(a=41, n=4)
    assert p.prompt == "00101101>00101001:"
    assert p.answer == "00101100,00101011,00101010,00101001"
    assert [int(x, 2) for x in p.answer.split(",")] == [44, 43, 42, 41]


def test_scores():
    task = CountdownTask()
    p = CountdownTask.problem(a=41, n=4)
    assert task.score(p, p.answer) == 1.0
    assert task.score(p, "00101100,00101011,00101000") == 0.5 * 2 / 4    # two right, then wrong
    assert task.score(p, "") == 0.0
    # Did not stop: every number past the end costs as much as a wrong one (RL on a reward
    # that paid 0.5 for any run-on answer learnt never to stop).
    assert task.score(p, p.answer + ",00101000") == 0.5 * 4 / 5
    assert task.score(p, p.answer + ",00101000" * 4) == 0.5 * 4 / 8
    exact = CountdownTask(CountdownConfig(partial_credit=False))
    assert exact.score(p, "00101100,00101011,00101000") == 0.0


def test_answer_lengths_have_a_long_tail():
    task = CountdownTask()
    rng = np.random.default_rng(0)
    tokens = np.asarray([len(task.sample(rng).answer) for _ in range(5000)])
    assert 60 <= np.median(tokens) <= 90               # ~8 steps of 9 characters
    assert tokens.max() <= 9 * 180 - 1 and tokens.min() == 8
    assert 0.01 < np.mean(tokens >= 9 * 60) < 0.08     # a few percent run to hundreds of tokens
    assert np.mean(tokens >= 9 * 150) > 0               # and some reach the 1.3k-1.6k token end
    warm = [len(task.warmup_sample(rng).answer) for _ in range(2000)]
    assert max(warm) <= 9 * 24 - 1


def test_held_out_problems_are_never_trained_on():
    task = CountdownTask()
    held = {p.prompt for p in task.held_out(100)}
    assert len(held) == 100
    rng = np.random.default_rng(1)
    assert not held & {task.sample(rng).prompt for _ in range(20000)}
    assert {p.prompt for p in task.held_out(100)} == held
