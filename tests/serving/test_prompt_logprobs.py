"""Prompt log-probs and top log-probs on the OpenAI endpoint (`jaxrl serve --score`): what
lm-evaluation-harness's `local-completions` sends for loglikelihood and multiple-choice tasks
(token-id prompts, echo, logprobs=1, max_tokens=1, temperature 0), parsed the way it parses
them, against the model's own float32 forward (the training path, not the engine's pages).
Over real HTTP, with the `openai` package where it models the fields."""

import dataclasses

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest

from serving.core.orchestrator import Orchestrator
from serving.frontends.openai_api import OpenAIApp, start_http
from serving.runner.engine import Engine
from tests.serving.common import CFG, ENGINE
from tests.serving.test_openai_api import tokenizer  # noqa: F401 (the module's fixture)


@pytest.fixture(scope="module")
def reference(model):
    """Log-softmax of the model's float32 forward over a sequence: [n, V]."""
    def logp(tokens):
        logits = model(jnp.asarray([tokens], jnp.int32))[0].astype(jnp.float32)
        return np.asarray(jax.nn.log_softmax(logits, axis=-1))
    return logp


@pytest.fixture(scope="module")
def scoring(tokenizer, params):  # noqa: F811
    """(base URL, orchestrator) of a server whose engine compiled its score programs."""
    engine = Engine(CFG, dataclasses.replace(ENGINE, score=True))
    with Orchestrator(engine, params, eos_id=tokenizer.eos_id) as o:
        server, port = start_http(OpenAIApp(o, tokenizer, "tiny", ENGINE.max_len).app,
                                  "127.0.0.1", 0)
        yield f"http://127.0.0.1:{port}/v1", o
        server.should_exit = True
    assert engine.programs.late_compiles == 0        # every score program compiled at start


def lm_eval_loglikelihood(choice: dict, ctxlen: int) -> tuple[float, bool]:
    """lm-evaluation-harness's parse of a `local-completions` loglikelihood answer
    (LocalCompletionsAPI.parse_logprobs): the continuation's tokens sit at [ctxlen:-1], the
    last being the one token generated."""
    tokens_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    is_greedy = all(tok == max(top.values()) for tok, top in zip(tokens_logprobs, top_logprobs))
    return sum(tokens_logprobs), is_greedy


def test_lm_eval_loglikelihood_requests_equal_the_models_forward(scoring, reference,
                                                                 tokenizer):  # noqa: F811
    url, _ = scoring
    rng = np.random.default_rng(0)
    for context_len, continuation_len in ((5, 3), (12, 1), (30, 9)):
        context = [1] + rng.integers(6, 32, context_len - 1).tolist()
        continuation = rng.integers(6, 32, continuation_len).tolist()
        tokens = context + continuation
        payload = {"model": "tiny", "prompt": tokens, "temperature": 0, "max_tokens": 1,
                   "logprobs": 1, "seed": 1234, "echo": True}
        choice = httpx.post(f"{url}/completions", json=payload, timeout=60).json()["choices"][0]
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(tokens) + 1          # the prompt, then one sampled
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        logp = reference(tokens)
        want = [logp[i - 1, tokens[i]] for i in range(1, len(tokens))]
        np.testing.assert_allclose(lp["token_logprobs"][1:len(tokens)], want, atol=2e-5)
        # Each position's one alternative is the model's most likely token there.
        for i in range(1, len(tokens)):
            (name, value), = lp["top_logprobs"][i].items()
            assert abs(value - logp[i - 1].max()) < 2e-5
        total, greedy = lm_eval_loglikelihood(choice, len(context))
        direct = logp[np.arange(len(context) - 1, len(tokens) - 1), continuation]
        assert abs(total - direct.sum()) < 1e-4
        is_argmax = logp[np.arange(len(context) - 1, len(tokens) - 1)].argmax(-1)
        assert greedy == bool((is_argmax == np.asarray(continuation)).all())
        # The generated token (greedy) is the argmax after the whole sequence.
        assert lp["tokens"][-1] == tokenizer.decode([int(logp[-1].argmax())])


def test_echo_with_max_tokens_zero_scores_the_prompt_and_generates_nothing(scoring,
                                                                          reference,
                                                                          tokenizer):  # noqa: F811
    url, _ = scoring
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
    got = client.completions.create(model="tiny", prompt="w3 w7 w1 w20", max_tokens=0,
                                    echo=True, logprobs=3)
    choice = got.choices[0]
    tokens = [tokenizer.bos_id] + tokenizer.encode("w3 w7 w1 w20")
    assert choice.text == tokenizer.decode(tokens)
    assert choice.logprobs.tokens == [tokenizer.decode([t]) for t in tokens]
    assert got.usage.completion_tokens == 0 and choice.finish_reason == "length"
    logp = reference(tokens)
    for i in range(1, len(tokens)):
        top = choice.logprobs.top_logprobs[i]
        best = np.argsort(-logp[i - 1])[:3]
        assert list(top) == [tokenizer.decode([int(t)]) for t in best]
        np.testing.assert_allclose(list(top.values()), logp[i - 1, best], atol=2e-5)
    # The offsets are where each token's text starts in the echoed text.
    ends = np.cumsum([len(t) for t in choice.logprobs.tokens]).tolist()
    assert choice.logprobs.text_offset == [0] + ends[:-1]


def test_chat_top_logprobs_are_the_most_likely_tokens_at_each_sampled_position(scoring,
                                                                             reference,
                                                                             tokenizer):  # noqa: F811
    url, o = scoring
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "w4 w8 w15"}]
    got = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6,
                                         temperature=1.0, seed=7, logprobs=True,
                                         top_logprobs=4)
    content = got.choices[0].logprobs.content
    prompt = tokenizer.encode("user w4 w8 w15 assistant")     # the template's rendering
    sampled = [tokenizer.encode(c.token)[0] for c in content]
    logp = reference(prompt + sampled)
    for j, entry in enumerate(content):
        row = logp[len(prompt) - 1 + j]
        assert [t.token for t in entry.top_logprobs] == [
            tokenizer.decode([int(t)]) for t in np.argsort(-row)[:4]]
        # The sampled token's own log-prob is the engine's, as it sampled it.
        assert abs(entry.logprob - row[sampled[j]]) < 2e-5


@pytest.mark.parametrize("kwargs,param", [
    ({"echo": True, "logprobs": 1, "stream": True}, "stream"),   # scored: answered whole
    ({"max_tokens": 0}, "max_tokens"),                              # 0 only with echo
    ({"logprobs": 21}, "logprobs"),                                 # at most 20
])
def test_what_cannot_be_scored_gets_400(scoring, kwargs, param):
    url, _ = scoring
    answer = httpx.post(f"{url}/completions",
                        json={"model": "tiny", "prompt": "w1 w2", "max_tokens": 2, **kwargs},
                        timeout=60)
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == param


def test_score_refuses_tokens_outside_the_vocabulary_and_the_engine_keeps_serving(scoring):
    url, o = scoring
    answer = httpx.post(f"{url}/completions", json={"model": "tiny", "prompt": [1, 5, 99],
                                                    "max_tokens": 0, "echo": True,
                                                    "logprobs": 1}, timeout=60)
    assert answer.status_code == 400 and "99" in answer.json()["error"]["message"]
    assert o.running
    lp, ids, values = o.score([1, 5, 7])
    assert lp.shape == (2,) and ids.shape == values.shape == (2, 20)
