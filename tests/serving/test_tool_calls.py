"""Tool calling through /v1/chat/completions, driven by the `openai` package: tools reach the
model through its chat template, its output comes back as `tool_calls` (whole and streamed),
tool_choice none/required/named, the message shapes of an agent loop render, and malformed
output or input is text or a 400, never a 500. The model is scripted (it writes the text the
test gives it), so what is checked is the protocol against OpenAI's own client; the parsers'
formats are checked on their own below."""

import contextlib
import itertools
import json
import string
import threading

import httpx
import openai
import pytest

from jaxrl.models.tokenizer import CharTokenizer
from serving.core.stream import DoneEvent, RequestStream, TokenEvent
from serving.frontends.openai_api import OpenAIApp, start_http
from serving.frontends.tool_calls import PARSERS, normalise_messages, parser_for

# Qwen2.5's tool section, shortened: the tools as JSON in <tools>, calls in <tool_call>.
HERMES = (
    "{%- if tools %}{{- '<|im_start|>system\\n<tools>' }}{% for t in tools %}"
    "{{- '\\n' }}{{ t | tojson }}{% endfor %}{{- '\\n</tools><|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}"
    "{{- '<|im_start|>assistant\\n' + m.content }}"
    "{%- for c in m.tool_calls %}{{- '<tool_call>\\n{\"name\": \"' + c.function.name + "
    "'\", \"arguments\": ' }}{{ c.function.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "a + b",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"},
                                                     "b": {"type": "number"}}}}},
         {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}]


class ScriptedModel:
    """A Generation that writes `script` (text) for every request and keeps the prompts."""

    def __init__(self, tokenizer):
        self.tokenizer, self.script, self.prompts = tokenizer, "", []
        self._ids = itertools.count()

    def validate(self, ids, sampling, key=None):
        pass

    def submit(self, ids, sampling, session=None):
        self.prompts.append(self.tokenizer.decode(ids))
        stream = RequestStream(next(self._ids), sampling.n)

        def write():
            for i in range(sampling.n):
                for t in self.tokenizer.encode(self.script):
                    stream.put(TokenEvent(i, t, -0.5, 0))
                stream.put(DoneEvent(i, "eos"))

        threading.Thread(target=write, daemon=True).start()
        return stream

    def end_session(self, key):
        pass


@contextlib.contextmanager
def scripted_endpoint():
    """(ScriptedModel, port) of the OpenAI endpoint over a scripted model with HERMES's
    template on a character tokenizer, served by uvicorn on 127.0.0.1 while the block runs."""
    tokenizer = CharTokenizer(string.printable)
    tokenizer.chat_template = HERMES
    model = ScriptedModel(tokenizer)
    server, port = start_http(OpenAIApp(model, tokenizer, "tiny", 4096).app, "127.0.0.1", 0)
    try:
        yield model, port
    finally:
        server.should_exit = True


@pytest.fixture(scope="module")
def served():
    with scripted_endpoint() as (model, port):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                               max_retries=0, timeout=60)
        yield client, model, port


CALLS = ('Let me add.<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
         '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')


def test_tools_reach_the_template_and_calls_come_back(served):
    client, model, _ = served
    model.script = CALLS
    out = client.chat.completions.create(model="tiny", messages=[
        {"role": "user", "content": "2+3?"}], tools=TOOLS, max_tokens=200)
    assert '"name": "add"' in model.prompts[-1] and "<tools>" in model.prompts[-1]
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me add."
    calls = choice.message.tool_calls
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("function", "add", {"a": 2, "b": 3}), ("function", "now", {})]
    assert len({c.id for c in calls}) == 2

    one = client.chat.completions.create(model="tiny", messages=[
        {"role": "user", "content": "2+3?"}], tools=TOOLS, parallel_tool_calls=False)
    assert [c.function.name for c in one.choices[0].message.tool_calls] == ["add"]


def test_streamed_calls_arrive_as_deltas_after_the_text(served):
    client, model, _ = served
    model.script = CALLS
    chunks = list(client.chat.completions.create(model="tiny", messages=[
        {"role": "user", "content": "2+3?"}], tools=TOOLS, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
    assert text == "Let me add."                       # nothing of the calls as text
    assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in deltas] == [
        (0, "add", {"a": 2, "b": 3}), (1, "now", {})]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_malformed_output_is_text_and_plain_text_streams(served):
    client, model, _ = served
    for script in ('<tool_call>\n{"name": "add", "arguments": {"a": 2,\n</tool_call>',
                   "no call here <tool_ but a lookalike"):
        model.script = script
        whole = client.chat.completions.create(model="tiny", messages=[
            {"role": "user", "content": "hi"}], tools=TOOLS)
        assert whole.choices[0].message.content == script
        assert whole.choices[0].message.tool_calls is None
        assert whole.choices[0].finish_reason == "stop"
        chunks = list(client.chat.completions.create(model="tiny", messages=[
            {"role": "user", "content": "hi"}], tools=TOOLS, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == script


def test_tool_choice_none_required_and_named(served):
    client, model, _ = served
    model.script = CALLS
    none = client.chat.completions.create(model="tiny", messages=[
        {"role": "user", "content": "x"}], tools=TOOLS, tool_choice="none")
    assert "<tools>" not in model.prompts[-1] and none.choices[0].message.tool_calls is None

    model.script = '{"a": 7, "b": 1}}\n</tool_call>'     # the rest of a call it was opened
    named = client.chat.completions.create(model="tiny", messages=[
        {"role": "user", "content": "x"}], tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "add"}})
    assert model.prompts[-1].endswith('<tool_call>\n{"name": "add", "arguments": ')
    [call] = named.choices[0].message.tool_calls
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 7, "b": 1}

    model.script = '{"name": "now", "arguments": {}}\n</tool_call>'
    required = client.chat.completions.create(model="tiny", messages=[
        {"role": "user", "content": "x"}], tools=TOOLS, tool_choice="required")
    assert model.prompts[-1].endswith("<|im_start|>assistant\n<tool_call>\n")
    assert required.choices[0].message.tool_calls[0].function.name == "now"
    for bad in ({"type": "function", "function": {"name": "nope"}}, "sometimes"):
        with pytest.raises(openai.BadRequestError, match="tool_choice"):
            client.chat.completions.create(model="tiny", messages=[
                {"role": "user", "content": "x"}], tools=TOOLS, tool_choice=bad)


def test_an_agent_loops_messages_render(served):
    """content null beside tool_calls, a tool message, content as text parts: 200; an image part
    and arguments that are not JSON: 400 naming them, and the connection serves on."""
    client, model, port = served
    model.script = "5"
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "2+"}, {"type": "text",
                                                                      "text": "3?"}]},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    out = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS)
    assert out.choices[0].message.content == "5"
    assert '<|im_start|>user\n2+3?<|im_end|>' in model.prompts[-1]
    assert '"arguments": {"a": 2, "b": 3}}' in model.prompts[-1]
    assert "<tool_response>\n5\n</tool_response>" in model.prompts[-1]
    with httpx.Client(base_url=f"http://127.0.0.1:{port}/v1") as http:   # one connection
        for broken, where in [
                ({"role": "user", "content": [{"type": "image_url", "image_url": {}}]},
                 "messages.0.content"),
                ({**messages[1], "tool_calls": [{"type": "function", "function": {
                    "name": "add", "arguments": "{a: 2"}}]},
                 "messages.0.tool_calls.0.function.arguments")]:
            r = http.post("/chat/completions", json={"messages": [broken], "tools": TOOLS})
            assert r.status_code == 400 and r.json()["error"]["param"] == where
        assert http.post("/chat/completions", json={"messages": messages}).status_code == 200


def test_a_template_without_tool_calls_refuses_tools():
    tokenizer = CharTokenizer(string.printable)
    tokenizer.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    server, port = start_http(OpenAIApp(ScriptedModel(tokenizer), tokenizer, "tiny", 4096).app,
                              "127.0.0.1", 0)
    try:
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "tools": TOOLS})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
        assert "writes no tool calls" in r.json()["error"]["message"]
    finally:
        server.should_exit = True


def test_the_parsers_formats():
    hermes, llama = PARSERS["hermes"], PARSERS["llama3_json"]
    assert hermes.parse('<tool_call>{"name": "f", "arguments": {"x": [1]}}</tool_call>') == (
        None, [("f", {"x": [1]})])
    assert hermes.parse("plain") is None
    assert hermes.parse('<tool_call>{"arguments": {}}</tool_call>') is None    # no name
    assert llama.parse('<|python_tag|>{"name": "f", "parameters": {"x": 1}}; '
                       '{"name": "g", "parameters": {}}') == (None, [("f", {"x": 1}),
                                                                    ("g", {})])
    assert llama.parse("The answer is 4.") is None
    assert parser_for(HERMES) is hermes
    assert parser_for("{% if tools %}<|python_tag|>{% endif %}") is llama
    assert normalise_messages([{"role": "assistant", "content": None}]) == [
        {"role": "assistant", "content": ""}]
