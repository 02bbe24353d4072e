"""Tool calling in /v1/chat/completions, as the OpenAI API and vLLM define it.

- The messages of an agent loop are put in the shape Hugging Face chat templates expect:
  content given as a list of text parts is joined, an assistant turn's `content: null` beside its
  `tool_calls` becomes "", and each call's `arguments` (a JSON string on the wire) becomes the
  object templates write with `tojson`. What cannot be rendered is a 400 naming the field.
- `tools` reach the model through its own chat template (its `tools` variable), unless
  `tool_choice` is "none".
- The output is parsed into `tool_calls` by the parser of the model's family, chosen from its
  chat template: `hermes` (Hermes, Qwen2.5, Qwen3: `<tool_call>{"name", "arguments"}</tool_call>`)
  or `llama3_json` (Llama 3.x: one JSON object `{"name", "parameters"}` per call, separated by
  ";", after an optional `<|python_tag|>`). Output that does not parse is returned as text.
- `tool_choice` "required" or a named function opens the call in the prompt (the parser's
  opening, and the function's name when one is named), and the model writes the rest under a
  grammar (serving/frontends/structured.py): the call always parses.
- Streaming sends text until a call may be starting, holds the rest, and sends the parsed calls
  as `tool_calls` deltas when the sample ends.
"""

from __future__ import annotations

import json
import re
import uuid

from serving.frontends.openai_schema import OpenAIError


def normalise_messages(messages: list[dict]) -> list[dict]:
    """`messages` (OpenAI's shapes) as chat templates take them; OpenAIError(400) naming the
    part that cannot be."""
    out = []
    for i, m in enumerate(messages):
        m = dict(m)
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                        part.get("text"), str):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise OpenAIError(400, f"messages[{i}].content[{j}] is a {kind!r} part; "
                                      f"this model takes text parts only",
                                      f"messages.{i}.content")
                texts.append(part["text"])
            m["content"] = "".join(texts)
        elif content is None:
            m["content"] = ""
        if m.get("tool_calls") is not None:
            m["tool_calls"] = [_call_for_template(i, k, c) for k, c in enumerate(m["tool_calls"])]
        out.append(m)
    return out


def _call_for_template(i: int, k: int, call) -> dict:
    where = f"messages.{i}.tool_calls.{k}"
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise OpenAIError(400, f"{where}: a tool call is {{'type': 'function', 'function': "
                          f"{{'name': ..., 'arguments': ...}}}}", where)
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise OpenAIError(400, f"{where}.function.arguments is not JSON ({e.msg})",
                              f"{where}.function.arguments") from None
    return {**call, "function": {**fn, "arguments": args}}


def tools_for(body) -> tuple[list[dict] | None, str | None]:
    """(the tools to render, the named function a call must use); no tools when there are none
    or tool_choice is "none". OpenAIError(400) for a choice naming no given tool."""
    tools, choice = body.tools, body.tool_choice
    named = not isinstance(choice, str | None)
    if not tools or choice == "none":
        if named or choice == "required":
            raise OpenAIError(400, f"tool_choice={choice!r} needs tools", "tool_choice")
        return None, None
    dumped = [t.model_dump(exclude_none=True) for t in tools]
    if named:
        name = choice.function.name
        if name not in {t["function"]["name"] for t in dumped}:
            raise OpenAIError(400, f"tool_choice names function {name!r}, which is not among "
                              f"the tools", "tool_choice")
        return dumped, name
    return dumped, None


class Parser:
    """One model family's tool-call format: `opening(name)` is what the prompt gets for a call
    the model must write; `parse(text)` -> (content or None, [(name, arguments dict)]), or None
    when the text holds no well-formed call; `start` is where a call may begin in streamed text."""

    name: str
    start: str

    def opening(self, name: str | None) -> str:
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str | None, list[tuple[str, dict]]] | None:
        raise NotImplementedError


class Hermes(Parser):
    name, start = "hermes", "<tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)

    def opening(self, name):
        return "<tool_call>\n" + (f'{{"name": "{name}", "arguments": ' if name else "")

    def parse(self, text):
        if self.start not in text:
            return None
        calls = [_call(body, "arguments") for body in self._CALL.findall(text)]
        if not calls or None in calls:
            return None
        content = text[: text.index(self.start)].strip()
        return content or None, calls


class Llama3Json(Parser):
    name, start = "llama3_json", "{"

    def opening(self, name):
        return f'{{"name": "{name}", "parameters": ' if name else ""

    def parse(self, text):
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return None
        calls = [_call(part, "parameters") for part in _split_objects(body)]
        if not calls or None in calls:
            return None
        return None, calls


def _call(body: str, args_key: str) -> tuple[str, dict] | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", {}))
    return (obj["name"], args) if isinstance(args, dict) else None


def _split_objects(body: str) -> list[str]:
    """Top-level JSON objects separated by ';' (Llama 3's parallel calls)."""
    decoder, out, i = json.JSONDecoder(), [], 0
    while i < len(body):
        try:
            _, end = decoder.raw_decode(body, i)
        except json.JSONDecodeError:
            return [body]               # not objects: parse() refuses it whole
        out.append(body[i:end])
        i = end
        while i < len(body) and body[i] in " \n\t;":
            i += 1
    return out


PARSERS = {"hermes": Hermes(), "llama3_json": Llama3Json()}


def parser_for(template: str | None) -> Parser | None:
    """The parser of a chat template's family, or None if it writes no tool calls we know."""
    if not template or "tools" not in template:
        return None
    if "<tool_call>" in template:
        return PARSERS["hermes"]
    if "<|python_tag|>" in template or "ipython" in template:
        return PARSERS["llama3_json"]
    return None


def calls_json(calls: list[tuple[str, dict]], parallel: bool) -> list[dict]:
    """OpenAI's `tool_calls` (the first call only unless `parallel`)."""
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}
            for name, args in (calls if parallel else calls[:1])]


class ToolTurn:
    """One choice's tool handling: the opening put in the prompt (`prefix`, part of the output
    the parser reads), the text to stream, and the parsed result at the end."""

    def __init__(self, parser: Parser, forced: bool, name: str | None, parallel: bool):
        self.parser, self.parallel = parser, parallel
        self.prefix = parser.opening(name) if forced else ""
        self._held = bool(self.prefix)    # a call has begun (a forced one: from the start)
        self._pending = ""                # not sent: a call, or what may be the start of one
        self._begun = False               # text other than spaces seen (llama3_json's test)

    def stream(self, piece: str) -> str:
        """Of the next `piece` of the choice's text, what may be sent as content now. The work
        is the piece's (and a few held characters'), not the whole text's."""
        self._pending += piece
        if self._held:
            return ""
        if self.parser is PARSERS["llama3_json"] and not self._begun:
            head = self._pending.lstrip()
            if not head:
                return ""
            self._begun = True
            if head.startswith(("{", "<|")):     # its calls are the whole output
                self._held = True
                return ""
        start, pending = self.parser.start, self._pending
        at = pending.find(start)
        if at >= 0:
            self._held = True
        else:              # hold a suffix that may be the start of the opening
            at = next((k for k in range(max(0, len(pending) - len(start) + 1), len(pending))
                       if start.startswith(pending[k:])), len(pending))
        out, self._pending = pending[:at], pending[at:]
        return out

    def result(self, text: str) -> tuple[str | None, list[dict]] | None:
        """(content, tool_calls) when the output parses as calls, else None."""
        parsed = self.parser.parse(self.prefix + text)
        if parsed is None:
            return None
        content, calls = parsed
        return content, calls_json(calls, self.parallel)

    def unsent(self) -> str:
        """What was held back from streaming, sent as content when the output holds no call
        (a forced call's opening included: it is part of what the model wrote)."""
        return self.prefix + self._pending
