"""One sample of an OpenAI response as the client sees it (`Choice`: its text decoded a token
at a time and cut at a stop string, with its tool calls where the request has tools), and its
JSON (`choice_json`), whole or as a streamed delta."""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from serving.core.stream import Speculated
from serving.frontends.detokenize import IncrementalDecoder
from serving.frontends.tool_calls import ToolTurn


@dataclasses.dataclass(frozen=True)
class Reply:
    """How a request's choices are reported: the object `kind` ("text_completion" or
    "chat.completion"), with per-token `logprobs` or not, `tools` a ToolTurn factory (one per
    choice) when the request has tools, `top` alternatives per position when the choices are
    scored (Scored), and `echo`: each choice's text and log-probs begin with its prompt's."""

    kind: str
    logprobs: bool = False
    tools: Callable | None = None
    top: int | None = None
    echo: bool = False


class Choice:
    """One sample as the client sees it: its text, decoded a token at a time (serving/
    detokenize.py), cut at a stop string. The work per token does not grow with the text: a
    stop string is looked for where it could end (the new text and the `hold` characters before
    it), and text no stop string can reach any more is set aside."""

    def __init__(self, tokenizer, stops: list[str], tools: ToolTurn | None = None):
        self.tokenizer, self.stops, self.tools = tokenizer, stops, tools
        self.tokens, self.logprobs, self.versions = [], [], []
        self.finish: str | None = None
        self.speculation: Speculated | None = None     # what speculative decoding did for it
        self._decoder = IncrementalDecoder(tokenizer)
        self._hold = max((len(s) for s in stops), default=1) - 1
        self._sent: list[str] = []        # handed to the client by `delta`
        self._settled: list[str] = []     # not sent yet; no stop string can start in it
        self._open = ""                   # not sent yet; a stop string may still be forming
        self._parsed = None               # (content, tool_calls) once parsed at the end

    @property
    def text(self) -> str:
        return "".join(self._sent) + "".join(self._settled) + self._open

    def add(self, token: int, logprob: float, version: int = 0) -> None:
        self.tokens.append(token)
        self.logprobs.append(logprob)
        self.versions.append(version)
        self._extend(self._decoder.add(token))

    def end(self, finish: str) -> None:
        """The sample has ended: the decoder's held-back text joins the text."""
        self._extend(self._decoder.flush())
        if self.finish is None:
            self.finish = finish

    def _extend(self, piece: str) -> None:
        if not piece or self.finish is not None:
            return
        start = max(0, len(self._open) - self._hold)    # a stop string ends in the new piece
        self._open += piece
        cut = min((i for i in (self._open.find(s, start) for s in self.stops) if i >= 0),
                  default=-1)
        if cut >= 0:
            self._open, self.finish = self._open[:cut], "stop"
        elif len(self._open) > self._hold + 4096:
            self._settled.append(self._open[: len(self._open) - self._hold])
            self._open = self._open[len(self._open) - self._hold:]

    def delta(self, final: bool) -> str:
        """Text not sent yet; while running, the last characters are held back where a stop
        string might still be forming (an unfinished character the decoder holds itself)."""
        keep = 0 if final or self.finish is not None else min(self._hold, len(self._open))
        out = "".join(self._settled) + self._open[: len(self._open) - keep]
        self._settled, self._open = [], self._open[len(self._open) - keep:]
        self._sent.append(out)
        return out

    def stream_delta(self) -> str:
        """The text to stream now: `delta`'s, less what may be a tool call (held back, and sent
        at the end as text if it holds none)."""
        text = self.delta(final=self.finish is not None)
        if self.tools is None:
            return text
        out = self.tools.stream(text)
        if self.finish is None or self.tool_calls():
            return out
        return out + self.tools.unsent()

    def tool_calls(self) -> list[dict] | None:
        """The calls the sample made, once it has ended (parsed once), or None."""
        if self.tools is None or self.finish is None:
            return None
        if self._parsed is None:
            self._parsed = self.tools.result(self.text) or ((), ())
        return list(self._parsed[1]) or None

    @property
    def content(self) -> str | None:
        """The message's text: before its tool calls if it made any, else all it wrote."""
        if self.tool_calls():
            return self._parsed[0]
        return (self.tools.prefix if self.tools else "") + self.text

    def token_texts(self, tokens: slice = slice(None)) -> list[str]:
        return [self.tokenizer.decode([t]) for t in self.tokens[tokens]]


@dataclasses.dataclass
class Scored:
    """A choice's sequence (prompt and sample) scored by the engine (Orchestrator.score): the
    `top` most likely tokens at each of its positions, and, with `echo`, the prompt's own."""
    prompt: list[int]
    logprobs: np.ndarray       # [n-1]: row i scores token i + 1 of prompt + sample
    top_ids: np.ndarray        # [n-1, 20]
    top_values: np.ndarray
    top: int
    echo: bool

    def alternatives(self, tokenizer, row: int) -> list[tuple[str, float]]:
        return [(tokenizer.decode([int(i)]), float(v))
                for i, v in zip(self.top_ids[row, :self.top], self.top_values[row, :self.top])]


def scored_logprobs(kind, c: Choice, s: Scored) -> dict:
    """The logprobs object of a scored choice: every sampled token's own log-prob (the
    engine's, as sampled) with its position's `top` alternatives; with `echo` (completions),
    the prompt's tokens first, the first with none (nothing precedes it)."""
    n, tok = len(s.prompt), c.tokenizer
    tops = [s.alternatives(tok, n - 1 + j) for j in range(len(c.tokens))]
    if kind.startswith("chat"):
        entry = lambda t, v: {"token": t, "logprob": v, "bytes": list(t.encode())}  # noqa: E731
        return {"content": [{**entry(t, v), "top_logprobs": [entry(a, b) for a, b in top]}
                            for t, v, top in zip(c.token_texts(), c.logprobs, tops)]}
    names, values, alternatives = c.token_texts(), list(c.logprobs), tops
    if s.echo:
        names = [tok.decode([t]) for t in s.prompt] + names
        values = [None] + [float(v) for v in s.logprobs[: n - 1]] + values
        alternatives = [None] + [s.alternatives(tok, i) for i in range(n - 1)] + alternatives
    offsets = np.cumsum([0] + [len(t) for t in names[:-1]]).tolist() if names else []
    return {"tokens": names, "token_logprobs": values, "text_offset": offsets,
            "top_logprobs": [None if a is None else dict(a) for a in alternatives]}


def choice_json(kind, index, c: Choice, logprobs: bool, *, final: bool, text=None,
                 tokens: slice = slice(None), scored: Scored | None = None) -> dict:
    text = c.text if text is None else text
    finish = c.finish if (final or c.finish) else None
    lp = None
    if scored is not None:
        lp = scored_logprobs(kind, c, scored)
    elif logprobs:
        names, values = c.token_texts(tokens), c.logprobs[tokens]
        if kind.startswith("chat"):
            lp = {"content": [{"token": t, "logprob": v, "bytes": list(t.encode()),
                               "top_logprobs": []} for t, v in zip(names, values)]}
        else:
            start = len(c.tokenizer.decode(c.tokens[:tokens.start or 0]))
            offsets = [start + len(c.tokenizer.decode(c.tokens[tokens.start or 0:k]))
                       for k in range((tokens.start or 0), (tokens.start or 0) + len(names))]
            lp = {"tokens": names, "token_logprobs": values, "text_offset": offsets,
                  "top_logprobs": [{t: v} for t, v in zip(names, values)]}
    if kind.startswith("chat"):
        calls = c.tool_calls()
        if calls:
            finish = "tool_calls"
        if final:
            message = {"role": "assistant", "content": c.content if c.tools else text}
            if calls:
                message["tool_calls"] = calls
            return {"index": index, "message": message, "logprobs": lp, "finish_reason": finish}
        delta = ({"tool_calls": [{"index": k, **call} for k, call in enumerate(calls)]}
                 if calls else {"content": text})
        return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
    return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}




def usage(prompt_tokens: int, choices: list[Choice]) -> dict:
    """A response's usage. With speculative decoding the draft tokens the engine verified for
    its choices are reported as OpenAI reports a prediction's (Predicted Outputs):
    `completion_tokens_details.accepted_prediction_tokens` and `rejected_prediction_tokens`."""
    completion = sum(len(c.tokens) for c in choices)
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
           "total_tokens": prompt_tokens + completion}
    speculated = [c.speculation for c in choices if c.speculation is not None]
    if speculated:
        out["completion_tokens_details"] = {
            "accepted_prediction_tokens": sum(s.accepted_tokens for s in speculated),
            "rejected_prediction_tokens": sum(s.rejected_tokens for s in speculated)}
    return out
