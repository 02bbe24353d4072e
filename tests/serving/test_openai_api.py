"""The OpenAI-compatible HTTP endpoint (serving/frontends/openai_api.py) driven by the real `openai`
package over uvicorn on 127.0.0.1: completions and chat equal the engine's greedy tokens with
the same log-probs, streaming gives the same text, stop strings cut, and bad requests get HTTP
400 in OpenAI's error shape."""

import json

import httpx
import numpy as np
import openai
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from jaxrl.models.tokenizer import HFTokenizer
from serving.core.orchestrator import Orchestrator
from serving.frontends.openai_api import OpenAIApp, start_http
from serving.runner.sampling import SamplingParams
from tests.serving.common import CFG, ENGINE

TEMPLATE = ("{% for m in messages %}{{ m.role }} {{ m.content }} {% endfor %}"
            "{% if add_generation_prompt %}assistant{% endif %}")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """32 word-level ids: <unk> <s> </s> user assistant system w0 .. w25, with a chat
    template in tokenizer_config.json."""
    path = tmp_path_factory.mktemp("tokenizer")
    words = ["<unk>", "<s>", "</s>", "user", "assistant", "system"] + [f"w{i}" for i in range(26)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "</s>", "bos_token": "<s>", "chat_template": TEMPLATE}))
    out = HFTokenizer(path)
    assert out.vocab_size == CFG.vocab_size and out.chat_template == TEMPLATE
    return out


@pytest.fixture(scope="module")
def served(engine, tokenizer, params):
    """(openai client, orchestrator, port) over the session's engine."""
    with Orchestrator(engine, params, eos_id=tokenizer.eos_id) as o:
        server, port = start_http(OpenAIApp(o, tokenizer, "tiny", ENGINE.max_len).app,
                                  "127.0.0.1", 0)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                               max_retries=0, timeout=60)
        yield client, o, port
        server.should_exit = True


def _greedy(orchestrator, ids, max_tokens):
    return orchestrator.generate(ids, SamplingParams(temperature=0.0, max_tokens=max_tokens))[0]


def test_completion_equals_the_engines_greedy_tokens_and_logprobs(served, tokenizer):
    client, o, _ = served
    prompt = "w3 w7 w1 w20 w9"
    want = _greedy(o, [tokenizer.bos_id] + tokenizer.encode(prompt), 12)   # BOS first
    got = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                    logprobs=1)
    choice = got.choices[0]
    assert choice.text == tokenizer.decode(want.tokens)
    assert choice.logprobs.tokens == [tokenizer.decode([t]) for t in want.tokens]
    np.testing.assert_allclose(choice.logprobs.token_logprobs, want.logprobs, atol=1e-6)
    assert choice.finish_reason == {"eos": "stop", "length": "length"}[want.finish_reason]
    assert got.usage.prompt_tokens == 6 and got.usage.completion_tokens == len(want.tokens)
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_streamed_completion_gives_the_same_text(served):
    client, _, _ = served
    kwargs = dict(model="tiny", prompt="w2 w4 w6", max_tokens=10, temperature=0)
    whole = client.completions.create(**kwargs).choices[0]
    chunks = list(client.completions.create(**kwargs, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.finish_reason
    assert chunks[-1].usage.completion_tokens == len(whole.text.split())


def test_seeded_samples_repeat_and_n_gives_n_choices(served):
    client, _, _ = served
    kwargs = dict(model="tiny", prompt=["w1 w2", "w3"], max_tokens=8, temperature=1.0,
                  n=2, seed=7)
    first, second = (client.completions.create(**kwargs) for _ in range(2))
    assert [c.index for c in first.choices] == [0, 1, 2, 3]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]


def test_stop_string_cuts_the_text(served, tokenizer):
    client, o, _ = served
    full = tokenizer.decode(_greedy(o, [tokenizer.bos_id] + tokenizer.encode("w5 w11"),
                                    12).tokens).split()
    stop = next(w for w in full[2:] if w not in full[:2])      # first shows at index >= 2
    got = client.completions.create(model="tiny", prompt="w5 w11", max_tokens=12,
                                    temperature=0, stop=[stop]).choices[0]
    assert got.text == " ".join(full[:full.index(stop)]) + " "
    assert got.finish_reason == "stop"


def test_chat_renders_the_template_and_equals_the_engine(served, tokenizer):
    client, o, _ = served
    messages = [{"role": "system", "content": "w1"}, {"role": "user", "content": "w8 w9"}]
    ids = tokenizer.encode("system w1 user w8 w9 assistant")
    want = _greedy(o, ids, 10)
    got = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10,
                                         temperature=0, logprobs=True)
    choice = got.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == tokenizer.decode(want.tokens)
    np.testing.assert_allclose([t.logprob for t in choice.logprobs.content], want.logprobs,
                               atol=1e-6)
    streamed = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10,
                                              temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == choice.message.content


@pytest.mark.parametrize("kwargs,param", [
    ({"temperature": 5.0}, "temperature"),
    ({"logprobs": 3}, "logprobs"),
    ({"prompt": "w1 " * 60}, "prompt"),                      # past max_prefill_length
    ({"max_tokens": 500}, "max_tokens"),                     # past max_len
    ({"stop": [f"w{i}" for i in range(17)]}, "stop"),      # up to 16
    ({"logit_bias": {"5": 101}}, "logit_bias"),             # biases are in [-100, 100]
    ({"presence_penalty": 2.5}, "presence_penalty"),        # penalties are in [-2, 2]
    ({"frequency_penalty": -3.0}, "frequency_penalty"),
    ({"best_of": 3}, "best_of"),
    ({"echo": True, "logprobs": 1}, "logprobs"),             # a server without --score
])
def test_bad_requests_get_400_in_openais_error_shape(served, kwargs, param):
    client, _, _ = served
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(**{"model": "tiny", "prompt": "w1", "max_tokens": 4,
                                     **kwargs})
    assert error.value.status_code == 400
    body = error.value.body
    assert body["type"] == "invalid_request_error" and body["param"] == param
    assert body["message"]


def test_fields_it_does_not_implement_are_refused_by_name_and_neutral_values_pass(served):
    client, _, _ = served
    messages = [{"role": "user", "content": "w1 w2"}]
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    for kwargs, param in (({"tools": [tool]}, "tools"),
                          ({"response_format": {"type": "json_object"}}, "response_format")):
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(model="tiny", messages=messages, max_tokens=3,
                                           **kwargs)
        assert error.value.body["param"] == param and param in error.value.body["message"]
    # Values that change nothing are taken, as are 16 stop strings.
    got = client.completions.create(model="tiny", prompt="w1", max_tokens=3, logit_bias={},
                                    presence_penalty=0, frequency_penalty=0.0,
                                    stop=[f"w{i}" for i in range(16)])
    assert got.choices[0].finish_reason in ("stop", "length")


def test_logit_bias_steers_the_draw_and_bad_entries_are_400s(served, tokenizer):
    client, _, _ = served
    w5 = tokenizer.encode("w5")[0]
    got = client.completions.create(model="tiny", prompt="w1 w2", max_tokens=4, temperature=1,
                                    logit_bias={str(w5): 100})
    assert got.choices[0].text == tokenizer.decode([w5] * 4)
    for bias in ({"nope": 1}, {str(10**6): 1}, {str(w5): 150}):
        with pytest.raises(openai.BadRequestError) as error:
            client.completions.create(model="tiny", prompt="w1", max_tokens=2, logit_bias=bias)
        assert error.value.body["param"] == "logit_bias"


def test_penalties_reach_the_engine(served, tokenizer):
    """frequency_penalty and presence_penalty give the engine's penalized greedy tokens (which
    tests/serving/test_penalties.py checks against a reference), not the plain ones."""
    client, o, _ = served
    prompt = "w3 w3 w8 w3"
    ids = [tokenizer.bos_id] + tokenizer.encode(prompt)
    want = o.generate(ids, SamplingParams(temperature=0.0, max_tokens=12,
                                          frequency_penalty=1.5, presence_penalty=0.5))[0]
    assert want.tokens != _greedy(o, ids, 12).tokens
    got = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                    frequency_penalty=1.5, presence_penalty=0.5)
    assert got.choices[0].text == tokenizer.decode(want.tokens)


def test_another_model_s_name_is_a_404(served):
    client, _, _ = served
    with pytest.raises(openai.NotFoundError) as error:
        client.completions.create(model="gpt-4o", prompt="w1", max_tokens=2)
    assert error.value.status_code == 404 and error.value.body["param"] == "model"
    assert "'tiny'" in error.value.body["message"]
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_malformed_json_and_missing_fields_get_400(served):
    _, _, port = served
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    for content in (b"{not json", json.dumps({"model": "tiny"}).encode()):
        r = httpx.post(url, content=content, headers={"content-type": "application/json"})
        assert r.status_code == 400
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_an_agents_chat_is_recorded_into_its_trajectory(served, tokenizer):
    """A two-turn chat that names a trajectory (header on turn 1, `trajectory_id` on turn 2; never
    `user`, OpenAI's end-user id, which records nothing and allows n > 1): the record
    holds exactly the tokens the model sampled (trained, with the engine's log-probs and
    versions) between the untrained prompt and user tokens; turn 2 continues from turn 1's
    KV pages; DELETE ends it and frees them. Tokens equal the engine's greedy decode of the
    recorded history."""
    client, o, port = served
    messages = [{"role": "user", "content": "w1 w2 w3"}]
    first = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=5, temperature=0, logprobs=True,
        extra_headers={"X-Trajectory-Id": "agent-1"})
    record = httpx.get(f"http://127.0.0.1:{port}/v1/trajectories/agent-1").json()
    prompt = tokenizer.encode("user w1 w2 w3 assistant")
    assert record["prompt"] == prompt and record["turns"] == 1
    want = _greedy(o, prompt, 5)
    assert record["tokens"] == want.tokens and all(record["trained"])
    np.testing.assert_allclose(record["logprobs"], want.logprobs, atol=1e-6)
    np.testing.assert_allclose([c.logprob for c in first.choices[0].logprobs.content],
                               want.logprobs, atol=1e-6)

    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "w9"}]
    before = o.metrics()["prefix_reused_tokens"]
    client.chat.completions.create(model="tiny", messages=messages, max_tokens=4,
                                   temperature=0, user="someone",
                                   extra_body={"trajectory_id": "agent-1"})
    assert o.metrics()["prefix_reused_tokens"] > before
    record = httpx.delete(f"http://127.0.0.1:{port}/v1/trajectories/agent-1").json()
    history = record["prompt"] + record["tokens"]
    trained = [False] * len(record["prompt"]) + record["trained"]
    assert history[:len(prompt) + len(want.tokens)] == prompt + want.tokens
    second = [i for i, t in enumerate(trained) if t][len(want.tokens):]
    assert 1 <= len(second) <= 4
    start = second[0]
    again = _greedy(o, history[:start], len(second))
    assert history[start:] == again.tokens
    assert not any(trained[len(prompt) + len(want.tokens): start])   # the user's turn
    assert httpx.get(f"http://127.0.0.1:{port}/v1/trajectories/agent-1").status_code == 404

    bad = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                     json={"prompt": "w1", "n": 2, "trajectory_id": "agent-2"})
    assert bad.status_code == 400 and "n=1" in bad.json()["error"]["message"]
    plain = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                       json={"prompt": "w1", "n": 2, "max_tokens": 2, "user": "agent-2"})
    assert plain.status_code == 200 and len(plain.json()["choices"]) == 2
    assert httpx.get(f"http://127.0.0.1:{port}/v1/trajectories/agent-2").status_code == 404
