"""Structured outputs through the OpenAI endpoint with the `openai` client, on a real engine (a
random model, its samples drawn at temperature 1): `response_format` json_schema, and
`tool_choice` "required" or a named function, come back parsed and valid by the schemas
(checked with `json`); a format that cannot be followed is a 400 naming its field."""

import json

import openai
import pytest
from flax import nnx

from jaxrl.models import ModelConfig, Transformer, split_params
from serving.core.orchestrator import Orchestrator
from serving.frontends.openai_api import OpenAIApp, start_http
from serving.runner.constraints import Grammars
from serving.runner.engine import Engine, EngineConfig
from tests.serving.common import byte_bpe_tokenizer
from tests.serving.test_tool_calls import HERMES

PERSON = {"type": "object", "properties": {
    "name": {"enum": ["ann", "bob"]}, "age": {"enum": [7, 30, 61]}, "ok": {"type": "boolean"}},
    "required": ["name", "age", "ok"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"enum": [1, 2, 3]}, "b": {"enum": [4, 5]}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": ADD}},
         {"type": "function", "function": {"name": "now", "parameters": {
             "type": "object", "properties": {}, "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    texts = [json.dumps({"name": n, "age": a, "ok": o}) for n in ("ann", "bob")
             for a in (7, 30, 61) for o in (True, False)]
    texts += ['<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 4}}\n</tool_call>',
              "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"] * 10
    tokenizer = byte_bpe_tokenizer(tmp_path_factory.mktemp("tokenizer"), texts * 5)
    tokenizer.chat_template = HERMES
    return tokenizer


@pytest.fixture(scope="module")
def client(tokenizer):
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, embed_dim=32, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, mlp_dim=64, max_seq_len=512)
    engine = Engine(cfg, EngineConfig(max_concurrent_decodes=8, max_len=512,
                                      max_prefill_length=448, prefill_chunk=64))
    params = split_params(Transformer(cfg, rngs=nnx.Rngs(0)))[1]
    with Orchestrator(engine, params, eos_id=tokenizer.eos_id,
                      grammars=Grammars(tokenizer, cfg.vocab_size)) as o:
        server, port = start_http(OpenAIApp(o, tokenizer, "tiny", 512).app, "127.0.0.1", 0)
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                            max_retries=0, timeout=120)
        server.should_exit = True


def _valid(schema: dict, obj) -> bool:
    """`obj` against the enum/boolean object schemas used here."""
    props = schema["properties"]
    return isinstance(obj, dict) and set(obj) == set(props) and all(
        (isinstance(obj[k], bool) if p.get("type") == "boolean" else obj[k] in p["enum"])
        for k, p in props.items())


def test_response_format_json_schema(client):
    out = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "who?"}], n=4, temperature=1.0,
        max_tokens=120, seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": "person",
                                                                "schema": PERSON}})
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        assert _valid(PERSON, json.loads(choice.message.content)), choice.message.content
    assert len({c.message.content for c in out.choices}) > 1


def test_tool_choice_required_and_named_make_calls_that_parse(client):
    messages = [{"role": "user", "content": "add"}]
    required = client.chat.completions.create(
        model="tiny", messages=messages, tools=TOOLS, tool_choice="required", n=4,
        temperature=1.0, max_tokens=120, seed=2, parallel_tool_calls=False)
    for choice in required.choices:
        assert choice.finish_reason == "tool_calls", choice
        [call] = choice.message.tool_calls
        args = json.loads(call.function.arguments)
        assert (call.function.name, _valid(ADD, args) if call.function.name == "add"
                else args == {}) in (("add", True), ("now", True))
    named = client.chat.completions.create(
        model="tiny", messages=messages, tools=TOOLS, n=3, temperature=1.0, max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "add"}}, seed=3)
    for choice in named.choices:
        [call] = choice.message.tool_calls
        assert call.function.name == "add" and _valid(ADD, json.loads(call.function.arguments))


def test_formats_that_cannot_be_followed_are_400s(client):
    messages = [{"role": "user", "content": "x"}]
    for fmt in ({"type": "xml"}, {"type": "json_schema", "json_schema": {"name": "p"}},
                {"type": "json_schema", "json_schema": {"name": "p", "schema": {
                    "type": "object", "properties": {"a": {"$ref": "#/missing"}}}}}):
        with pytest.raises(openai.BadRequestError, match="response_format") as e:
            client.chat.completions.create(model="tiny", messages=messages, max_tokens=5,
                                           response_format=fmt)
        assert e.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError, match="both constrain"):
        client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS,
                                       tool_choice="required", max_tokens=5,
                                       response_format={"type": "json_object"})
    ok = client.completions.create(model="tiny", prompt="x", max_tokens=3)
    assert ok.choices[0].finish_reason in ("stop", "length")          # still serving


WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}]


def _whitespace_bias(tokenizer) -> dict[str, int]:
    """A model that would rather write whitespace than anything else (a weak or early-RL
    model's newlines after `{`): +100 on every token of spaces, tabs or newlines."""
    blank = [t for t in range(tokenizer.vocab_size)
             if tokenizer.decode([t]) and not tokenizer.decode([t]).strip()]
    return {str(t): 100 for t in blank}


def test_forced_tool_calls_are_compact_json_that_finish(client, tokenizer):
    """Named, required, n=4 sampled and streamed: each ends with its call well within 96 tokens
    though the model prefers whitespace to every other token (no free whitespace in JSON). One
    call each: with parallel calls such a model would go on to the next "\n<tool_call>"."""
    messages = [{"role": "user", "content": "weather in oslo?"}]
    bias = _whitespace_bias(tokenizer)
    assert bias
    for choice_of in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        out = client.chat.completions.create(
            model="tiny", messages=messages, tools=WEATHER, tool_choice=choice_of, n=4,
            temperature=1.0, max_tokens=96, seed=4, logit_bias=bias, parallel_tool_calls=False)
        for choice in out.choices:
            assert choice.finish_reason == "tool_calls", (choice_of, choice.message.content)
            [call] = choice.message.tool_calls
            args = json.loads(call.function.arguments)
            assert call.function.name == "get_weather" and 1 <= args["days"] <= 7
            assert len(args["city"]) <= 12
        assert out.usage.completion_tokens < 4 * 96
    stream = client.chat.completions.create(
        model="tiny", messages=messages, tools=WEATHER, tool_choice="required", temperature=1.0,
        max_tokens=96, seed=5, logit_bias=bias, parallel_tool_calls=False, stream=True)
    finish = [c.choices[0].finish_reason for c in stream if c.choices and
              c.choices[0].finish_reason]
    assert finish == ["tool_calls"]
