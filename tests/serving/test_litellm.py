"""The OpenAI-compatible endpoint driven by litellm, the client many agent frameworks (CrewAI,
smolagents, OpenHands, DSPy) reach models through: chat with tools comes back as litellm's
tool calls, whole and streamed (rebuilt by litellm's own `stream_chunk_builder`), an agent
loop's assistant and tool messages render, text completions work, and a bad request is
litellm's BadRequestError. The model is scripted (tests/serving/test_tool_calls.py), so what is
checked is the protocol as litellm speaks it."""

import json
import os

import pytest

from tests.serving.test_tool_calls import CALLS, TOOLS, scripted_endpoint


@pytest.fixture(scope="module")
def litellm():
    """The litellm module, imported by the tests that use it: about 2 s that every worker of
    both tiers would otherwise spend collecting this file."""
    # litellm fetches its model price list from GitHub at import unless told to use its own copy.
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm
    return litellm


@pytest.fixture(scope="module")
def served():
    with scripted_endpoint() as (model, port):
        yield model, {"model": "openai/tiny", "api_base": f"http://127.0.0.1:{port}/v1",
                      "api_key": "unused", "num_retries": 0, "timeout": 60}


def _calls(message):
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


def test_tool_calls_whole_and_streamed(served, litellm):
    model, args = served
    model.script = CALLS
    messages = [{"role": "user", "content": "2+3?"}]
    whole = litellm.completion(messages=messages, tools=TOOLS, **args)
    assert whole.choices[0].finish_reason == "tool_calls"
    assert whole.choices[0].message.content == "Let me add."
    assert _calls(whole.choices[0].message) == [("add", {"a": 2, "b": 3}), ("now", {})]
    chunks = list(litellm.completion(messages=messages, tools=TOOLS, stream=True, **args))
    built = litellm.stream_chunk_builder(chunks, messages=messages)
    assert built.choices[0].message.content == "Let me add."
    assert _calls(built.choices[0].message) == _calls(whole.choices[0].message)
    assert built.choices[0].finish_reason == "tool_calls"


def test_an_agent_loop_s_messages_render(served, litellm):
    model, args = served
    model.script = CALLS
    messages = [{"role": "user", "content": "2+3?"}]
    call = litellm.completion(messages=messages, tools=TOOLS, **args).choices[0].message
    messages += [call.model_dump(),
                 {"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": "5"},
                 {"role": "tool", "tool_call_id": call.tool_calls[1].id, "content": "noon"}]
    model.script = "It is 5."
    answer = litellm.completion(messages=messages, tools=TOOLS, **args)
    assert answer.choices[0].message.content == "It is 5."
    assert answer.choices[0].finish_reason == "stop"
    rendered = model.prompts[-1]
    assert "<tool_response>\n5\n</tool_response>" in rendered
    assert '"name": "add", "arguments": {"a": 2, "b": 3}' in rendered


def test_text_completion_and_a_bad_request(served, litellm):
    model, args = served
    model.script = "w1 w2"
    text_args = {**args, "model": "text-completion-openai/tiny"}
    out = litellm.text_completion(prompt="hello", max_tokens=5, **text_args)
    assert out.choices[0].text == "w1 w2"
    with pytest.raises(litellm.BadRequestError, match="temperature"):
        litellm.completion(messages=[{"role": "user", "content": "x"}], temperature=5.0,
                           **args)
