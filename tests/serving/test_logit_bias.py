"""OpenAI's logit_bias in the engine, against a full forward of the same weights (an independent
reference): a +100 bias makes its token every draw while the log-probs stay the model's own, a
-100 bias on the greedy token gives the model's second choice, and bad biases are refused by
name; the same through the `openai` client."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from serving.core.requests import InvalidRequest
from serving.runner.sampling import MAX_LOGIT_BIAS, SamplingParams
from tests.serving.common import CFG, prompts


def _logp(model, ids) -> np.ndarray:
    """log-softmax of the model's logits at every position of `ids` [T, V]."""
    return np.asarray(jax.nn.log_softmax(model(jnp.asarray([ids]))[0].astype(jnp.float32)))


def test_a_positive_bias_forces_its_token_with_the_model_s_log_probs(model, orchestrator):
    prompt = prompts(7, seed=4)[0]
    samples = orchestrator.generate(prompt, SamplingParams(
        temperature=1.0, max_tokens=5, n=3, seed=5, stop_at_eos=False,
        logit_bias=((9, 100.0), (4, -3.0))))
    for s in samples:
        assert s.tokens == [9] * 5
        want = _logp(model, prompt + s.tokens[:-1])[len(prompt) - 1:, 9]
        np.testing.assert_allclose(s.logprobs, want, atol=2e-5)


def test_a_negative_bias_on_the_greedy_token_gives_the_second_choice(model, orchestrator):
    prompt = prompts(11, seed=6)[0]
    first = _logp(model, prompt)[-1]
    best, second = np.argsort(-first)[:2]
    [s] = orchestrator.generate(prompt, SamplingParams(
        temperature=0.0, max_tokens=1, logit_bias=((int(best), -100.0),)))
    assert s.tokens == [int(second)]


def test_bad_biases_are_refused_by_name(orchestrator):
    with pytest.raises(ValueError, match="logit_bias has 301 entries; at most 300"):
        SamplingParams(logit_bias=tuple((i, 1.0) for i in range(MAX_LOGIT_BIAS + 1)))
    with pytest.raises(ValueError, match=r"logit_bias of token 3 is 101.0: biases are in"):
        SamplingParams(logit_bias=((3, 101.0),))
    with pytest.raises(InvalidRequest, match=f"logit_bias: token id {CFG.vocab_size} is "):
        orchestrator.submit([3, 4], SamplingParams(logit_bias=((CFG.vocab_size, 1.0),)))
