"""OpenAI's structured outputs as grammars for constrained decoding (serving/runner/constraints.py):
`response_format` (`json_object`, `json_schema`) and the tool call a `tool_choice` of
"required" or a named function forces, in the format of the model's family
(serving/frontends/tool_calls.py). What cannot be turned into a grammar is a 400 naming the field:
here, or when the engine checks the grammar (serving/frontends/openai_api.py maps its error to the
field)."""

from __future__ import annotations

import json

from serving.frontends.openai_schema import OpenAIError
from serving.frontends.tool_calls import Hermes, Llama3Json, Parser
from serving.runner.constraints import compact_json, json_schema_grammar, lark_grammar


def response_format_grammar(value) -> str | None:
    """The grammar of a request's `response_format`, None for free text."""
    if value is None or value == {"type": "text"}:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "json_object":
        return _schema_grammar({"type": "object"}, "response_format")
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict | bool):
            raise OpenAIError(400, "response_format: a json_schema response format is "
                              "{'type': 'json_schema', 'json_schema': {'name': ..., 'schema': "
                              "{...}}}", "response_format")
        return _schema_grammar(schema, "response_format")
    raise OpenAIError(400, f"response_format={value!r}: the types are 'text', 'json_object' "
                      f"and 'json_schema'", "response_format")


def tool_call_grammar(parser: Parser, tools: list[dict], name: str | None,
                      parallel: bool) -> str:
    """What the model writes after the forced opening (`parser.opening(name)`, already in its
    prompt): the named function's arguments, or (`required`) one call of any of `tools`, or
    several when `parallel`, each matching its function's parameter schema."""
    by_name = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"}
               for t in tools}
    if isinstance(parser, Hermes):
        args_key, close, more = "arguments", "}\n</tool_call>", ("\n</tool_call>",
                                                                 "\n<tool_call>\n")
    elif isinstance(parser, Llama3Json):
        args_key, close, more = "parameters", "}", ("", "; ")
    else:
        raise OpenAIError(400, f"tool_choice: no grammar for {parser.name} tool calls",
                          "tool_choice")
    if name is not None:
        rules = [f"start: args {_lark(close)}", f"args: %json {compact_json(by_name[name])}"]
    else:
        call = {"anyOf": [{"type": "object",
                           "properties": {"name": {"const": n}, args_key: schema},
                           "required": ["name", args_key], "additionalProperties": False}
                          for n, schema in by_name.items()]}
        end, between = more
        repeat = f" ({_lark(between)} call{f' {_lark(end)}' if end else ''})*" if parallel else ""
        rules = [f"start: call{f' {_lark(end)}' if end else ''}{repeat}",
                 f"call: %json {compact_json(call)}"]
    return lark_grammar("\n".join(rules))


def _schema_grammar(schema, field: str) -> str:
    """The schema's grammar; its own errors (an unresolved $ref, say) surface when the engine
    checks it (Orchestrator.validate, once per grammar), as a 400 naming `field`."""
    try:
        return json_schema_grammar(schema)
    except ValueError as e:
        raise OpenAIError(400, f"{field}: the schema cannot be followed ({e})", field) from None


def _lark(text: str) -> str:
    """`text` as a Lark string literal."""
    return json.dumps(text)
