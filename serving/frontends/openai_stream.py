"""Reading a request's generation streams into its choices, and the server-sent events of a
streamed response (OpenAI's `stream=true`: chunks, an optional usage chunk, `[DONE]`)."""

from __future__ import annotations

import json
from typing import Callable, Iterator

from serving.core.stream import TokenEvent
from serving.frontends.openai_choices import Choice, Reply, choice_json, usage
from serving.frontends.openai_schema import FINISH, OpenAIError


def sse(streams, choices: list[Choice], n: int, reply: Reply, meta: dict,
        usage_prompt: int | None, done: Callable[[], None]) -> Iterator[str]:
    """The events of a streamed response: each choice's new text as it comes, then (with
    `usage_prompt`, the prompt tokens) the usage, then `[DONE]`; `done` runs once every
    stream has ended. An error after the status line went out is said in-band; the streams
    are cancelled however the response ends (also when the client went away)."""
    kind = reply.kind
    chunk_kind = "chat.completion.chunk" if kind.startswith("chat") else kind
    sent = [0] * len(choices)

    def chunk(payload):
        return f"data: {json.dumps({**meta, 'object': chunk_kind, **payload})}\n\n"

    try:
        if kind.startswith("chat"):
            yield chunk({"choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}
                                     for i in range(len(choices))]})
        for i in read_events(streams, choices, n):
            c = choices[i]
            text = c.stream_delta()
            if text or c.finish is not None:
                piece = choice_json(kind, i, c, reply.logprobs, final=False, text=text,
                                    tokens=slice(sent[i], len(c.tokens)))
                sent[i] = len(c.tokens)
                yield chunk({"choices": [piece]})
        done()
        if usage_prompt is not None:
            yield chunk({"choices": [], "usage": usage(usage_prompt, choices)})
        yield "data: [DONE]\n\n"
    except OpenAIError as e:
        yield f"data: {json.dumps({'error': {'message': e.message, 'type': e.kind}})}\n\n"
    finally:
        for stream in streams:
            stream.cancel()


def read_events(streams, choices: list[Choice], n: int) -> Iterator[int]:
    """Reads every stream to its end, feeding `choices` (stream s, sample j is choice s*n + j);
    yields the index of each choice that changed. A sample cut by a stop string is not fed
    further; a stream whose samples all stopped is cancelled."""
    for s, stream in enumerate(streams):
        for event in stream:
            c = choices[s * n + event.sample_index]
            if not isinstance(event, TokenEvent) and event.speculation is not None:
                c.speculation = event.speculation
            if c.finish is not None:        # cut by a stop string: the rest is not shown
                continue
            if isinstance(event, TokenEvent):
                c.add(event.token, event.logprob, event.version)
            elif event.reason in FINISH:
                c.end(FINISH[event.reason])
            else:
                for other in streams:
                    other.cancel()
                raise OpenAIError(503, f"generation failed ({event.reason}"
                                  f"{': ' + stream.error if stream.error else ''})",
                                  kind="server_error")
            if all(choices[s * n + j].finish for j in range(n)):
                stream.cancel()
            yield s * n + event.sample_index
