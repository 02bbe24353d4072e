"""pass@k, avg@n and maj@n (jaxrl/eval/sampled.py): the estimator against counting every k-subset,
the majority vote, and an evaluation through the engine against the same samples drawn and
scored one by one."""

import itertools

import numpy as np
import pytest
from flax import nnx

from jaxrl.config import load_run_config
from jaxrl.eval.evaluate import local_engine
from jaxrl.eval.sampled import majority_correct, pass_at_k, sampled_eval
from jaxrl.models import Transformer
from jaxrl.models.tokenizer import prompt_ids
from jaxrl.recipe import build_task, model_config
from serving.runner.sampling import SamplingParams


@pytest.mark.parametrize("n", [1, 2, 5, 6])
def test_pass_at_k_is_the_share_of_k_subsets_with_a_correct_sample(n):
    for c in range(n + 1):
        samples = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(samples, k))
            assert pass_at_k(n, c, k) == pytest.approx(sum(map(any, subsets)) / len(subsets))
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(3, 1, 4)


def test_majority_vote():
    strip = str.strip
    assert majority_correct(["4", " 4", "5"], [True, True, False], strip)
    assert not majority_correct(["5", "4", "5"], [False, True, False], strip)
    assert majority_correct(["4", "5"], [True, False], strip)          # a tie: first seen
    assert not majority_correct(["5", "4"], [False, True], strip)


class EvenLength:
    """The arithmetic task's problems with a reward a random model earns about half the time
    (an even-length completion), so every metric has something to count."""

    name = "even_length"

    def __init__(self, task):
        self.task = task

    def held_out(self, n):
        return self.task.held_out(n)

    def score(self, problem, completion):
        return float(len(completion) % 2 == 0)


def test_sampled_eval_equals_the_samples_scored_one_by_one():
    cfg = load_run_config(None, ["model.num_layers=1", "model.embed_dim=32", "model.mlp_dim=64",
                                 "model.num_heads=2", "model.num_kv_heads=1",
                                 "model.head_dim=16", "model.max_seq_len=32",
                                 "task.max_operand=30", "task.ops=['+']"])
    model_cfg = model_config(cfg)
    arithmetic, tokenizer = build_task(cfg, model_cfg)
    task = EvenLength(arithmetic)
    model = Transformer(model_cfg, rngs=nnx.Rngs(3))
    problems = task.held_out(6)
    n, new = 6, 4
    with local_engine(model, tokenizer.eos_id, 10, new, slots=8) as o:
        got = sampled_eval(o, task, tokenizer, problems,
                           SamplingParams(temperature=1.5, n=n, max_tokens=new), [1, 3, 6])
        correct, answers = [], []
        for i, p in enumerate(problems):     # the same draws, one request at a time
            samples = o.generate(prompt_ids(tokenizer, p.prompt), SamplingParams(
                temperature=1.5, n=n, max_tokens=new, seed=i))
            eos = tokenizer.eos_id
            texts = [tokenizer.decode(s.tokens[: s.tokens.index(eos)] if eos in s.tokens
                                      else s.tokens) for s in samples]
            correct.append([len(t) % 2 == 0 for t in texts])
            answers.append([t.strip() for t in texts])
    c = np.asarray([sum(x) for x in correct])
    assert 0 < c.sum() < n * len(problems)          # a random model: some right, some wrong
    for k in (1, 3, 6):
        want = np.mean([1.0 if n - ci < k else 1 - np.prod([(n - ci - j) / (n - j)
                                                              for j in range(k)]) for ci in c])
        assert got[f"pass@{k}"] == pytest.approx(want)
    assert got["pass@1"] == pytest.approx(got["avg@6"]) == pytest.approx(c.mean() / n)
    votes = [max(set(a), key=lambda x, a=a: (a.count(x), -a.index(x))) for a in answers]
    assert got["maj@6"] == pytest.approx(np.mean([
        any(ok for t, ok in zip(a, cs) if t == v) for a, cs, v in zip(answers, correct, votes)]))
    with pytest.raises(ValueError, match="each k must be in"):
        sampled_eval(None, task, tokenizer, problems,
                     SamplingParams(temperature=1.0, n=2, max_tokens=new), [3])
