"""An OpenAI-compatible HTTP endpoint over a generation service (an Orchestrator or Replicas):
`/v1/completions`, `/v1/chat/completions` (the model's chat template), `/v1/models`, streaming as
server-sent events, and OpenAI's error shape (HTTP 400 for a bad request), so that any client
written for OpenAI's API (the `openai` package, LangChain, smolagents, curl) drives the engine.

Served by `jaxrl serve --http-port N` beside the gRPC services, on the same engines and the
same weights (in-flight updates included). A request that names a trajectory (header
`X-Trajectory-Id`, or the `trajectory_id` field: the `openai` package's `extra_body`) is
recorded into it for training and continues from the
KV pages of its previous turn (serving/frontends/trajectories.py); `GET /v1/trajectories/{id}` reads
a trajectory back and `DELETE` ends it. Every sampled token's log-prob is the engine's own,
the one RL trains with. Prompt log-probs (`echo` with `logprobs`, lm-evaluation-harness's
loglikelihood requests, `max_tokens=0` included) and the alternatives of `logprobs` above 1
(completions) or `top_logprobs` (chat) come from scoring the whole sequence once it is
generated (Orchestrator.score, a server started with `--score`), answered whole, not
streamed. A text prompt
to `/v1/completions` begins with BOS when the tokenizer has one, as jaxrl prompts models
everywhere (and as vLLM does for Llama-style tokenizers); a prompt of token ids is taken as it is.
"""

from __future__ import annotations

import logging
import secrets
import time
import uuid

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from jaxrl.models.chat import ChatTemplateError, render_chat
from jaxrl.models.tokenizer import prompt_ids
from serving.core.orchestrator import EngineStopped, InvalidRequest, QueueFull
from serving.frontends.http_server import start_http, stop_http  # noqa: F401 (the API's server)
from serving.frontends.openai_choices import Choice, Reply, Scored, choice_json, usage
from serving.frontends.openai_schema import (  # noqa: F401
    FINISH,
    MAX_STOPS,
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    OpenAIError,
    logit_bias_pairs,
    refuse_unsupported,
)
from serving.frontends.openai_stream import read_events, sse
from serving.frontends.structured import response_format_grammar, tool_call_grammar
from serving.frontends.tool_calls import (
    PARSERS,
    ToolTurn,
    normalise_messages,
    parser_for,
    tools_for,
)
from serving.runner.sampling import SamplingParams
from serving.runner.steps import SCORE_TOP

_log = logging.getLogger("jaxrl.serve")
from serving.frontends.trajectories import TrajectoryStore


class OpenAIApp:
    """The FastAPI app (`.app`) over `generation` (submit, validate) and its tokenizer."""

    def __init__(self, generation, tokenizer, model_name: str, max_len: int, *,
                 trained_temperature: float | None = None):
        """`max_len`: the most tokens a sequence may hold, its prompt included.
        `trained_temperature`: requests recorded into a trajectory must sample the policy a
        trainer trains (this temperature, top_p 1, top_k 0), or their log-probs would not be
        its behaviour log-probs; refused with 400 otherwise. None: any sampling."""
        self.generation, self.tokenizer = generation, tokenizer
        self.model_name, self.max_len = model_name, max_len
        self.trained_temperature = trained_temperature
        self.trajectories = TrajectoryStore(tokenizer)
        self.app = app = FastAPI(title="jaxrl", docs_url=None, redoc_url=None)
        app.add_exception_handler(OpenAIError, lambda _, e: e.response())
        app.add_exception_handler(RequestValidationError, _validation_error)
        app.add_exception_handler(Exception, _server_error)
        app.get("/v1/models")(self.models)
        app.post("/v1/completions")(self.completions)
        app.post("/v1/chat/completions")(self.chat)
        app.get("/v1/trajectories/{key}")(self.trajectory)
        app.delete("/v1/trajectories/{key}")(self.end_trajectory)

    async def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model",
                                            "created": 0, "owned_by": "jaxrl"}]}

    # -- endpoints (plain functions: FastAPI runs them in its thread pool, as they wait on the
    # engine's streams) ---------------------------------------------------------------------
    def trajectory(self, key: str) -> dict:
        record = self.trajectories.get(key)
        if record is None:
            raise OpenAIError(404, f"no trajectory {key!r}", "id", "not_found_error")
        return record

    def end_trajectory(self, key: str) -> dict:
        """The trajectory, now ended: its KV pages are freed and it is forgotten."""
        record = self.trajectories.end(key)
        if record is None:
            raise OpenAIError(404, f"no trajectory {key!r}", "id", "not_found_error")
        self.generation.end_session(key)
        return record

    def _check_model(self, body) -> None:
        """Another model's name is a 404, as OpenAI's and vLLM's servers answer it."""
        if body.model is not None and body.model != self.model_name:
            raise OpenAIError(404, f"the model {body.model!r} does not exist: this server serves "
                              f"{self.model_name!r} (GET /v1/models)", "model",
                              "not_found_error")

    def completions(self, body: CompletionRequest, request: Request):
        self._check_model(body)
        refuse_unsupported(body)
        for name in ("tools", "tool_choice"):
            if name in (body.model_extra or {}):
                raise OpenAIError(400, f"{name}: tool calls are made through "
                                  f"/v1/chat/completions", name)
        # Prompt log-probs and alternatives come from scoring the sequence (Orchestrator.score).
        score = body.logprobs is not None and (body.echo or body.logprobs > 1)
        if body.max_tokens == 0 and not body.echo:
            raise OpenAIError(400, "max_tokens=0 generates nothing: it scores the prompt, with "
                              "echo=true", "max_tokens")
        self._check_scoring(body, score, "logprobs" if body.logprobs else "echo")
        prompts = self._prompts(body.prompt)
        key = self._trajectory(body, request, len(prompts))
        if key is not None:
            text = body.prompt if isinstance(body.prompt, str) else None
            prompts = [self.trajectories.align(key, prompts[0], text)]
        grammar = response_format_grammar((body.model_extra or {}).get("response_format"))
        reply = Reply("text_completion", logprobs=body.logprobs is not None,
                       top=body.logprobs if score else None, echo=body.echo)
        return self._respond(body, prompts, body.max_tokens, reply, key,
                             grammar=(grammar, "response_format"))

    def chat(self, body: ChatRequest, request: Request):
        self._check_model(body)
        refuse_unsupported(body)
        if body.top_logprobs and not body.logprobs:
            raise OpenAIError(400, f"top_logprobs={body.top_logprobs} needs logprobs=true",
                              "top_logprobs")
        score = bool(body.logprobs and body.top_logprobs)
        self._check_scoring(body, score, "top_logprobs")
        template = getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise OpenAIError(400, f"model {self.model_name!r} has no chat template (its "
                              f"tokenizer_config.json names none): use /v1/completions",
                              "messages")
        tools, named = tools_for(body)
        parser = parser_for(template) if tools else None
        if tools and parser is None:
            raise OpenAIError(400, f"tools: the chat template of model {self.model_name!r} "
                              f"writes no tool calls this server parses ({', '.join(PARSERS)})",
                              "tools")
        messages = normalise_messages([m.model_dump(exclude_none=True) for m in body.messages])
        try:
            text = render_chat(template, messages, self.tokenizer, tools=tools)
        except ChatTemplateError as e:
            raise OpenAIError(400, str(e), "messages") from None
        turn = None
        grammar = (response_format_grammar((body.model_extra or {}).get("response_format")),
                   "response_format")
        if parser is not None:
            forced = body.tool_choice == "required" or named is not None
            turn = lambda: ToolTurn(parser, forced, named, body.parallel_tool_calls)  # noqa: E731
            text += turn().prefix
            if forced:
                if grammar[0] is not None:
                    raise OpenAIError(400, f"response_format and tool_choice="
                                      f"{body.tool_choice!r} both constrain the output: give "
                                      f"one", "response_format")
                grammar = (tool_call_grammar(parser, tools, named, body.parallel_tool_calls),
                           "tool_choice")
        limit = body.max_completion_tokens or body.max_tokens
        ids = self.tokenizer.encode(text)
        key = self._trajectory(body, request, 1)
        if key is not None:
            ids = self.trajectories.align(key, ids, text)
        reply = Reply("chat.completion", logprobs=body.logprobs, tools=turn,
                       top=body.top_logprobs if score else None)
        return self._respond(body, [ids], limit, reply, key, grammar)

    def _check_scoring(self, body, score: bool, field: str) -> None:
        """A request that needs its sequences scored: refused where the engine cannot, or
        when it streams (scored choices are answered whole)."""
        if not score:
            return
        if body.stream:
            raise OpenAIError(400, "prompt log-probs (echo with logprobs) and top log-probs "
                              "are answered whole: use stream=false", "stream")
        if not self.generation.can_score:
            raise OpenAIError(400, f"{field}: prompt and top log-probs need the engine's "
                              f"score programs: start the server with `jaxrl serve --score`",
                              field)

    def _trajectory(self, body, request: Request, prompts: int) -> str | None:
        """The trajectory the request is recorded into, if it names one."""
        # Never `user`: OpenAI documents it as an end-user id, which clients set for their own
        # reasons; a request is recorded for training only when it asks to be.
        key = request.headers.get("x-trajectory-id") or body.trajectory_id
        if key is None:
            return None
        if body.n != 1 or prompts != 1:
            raise OpenAIError(400, f"a request recorded into trajectory {key!r} has one prompt "
                              f"and n=1 (got {prompts} prompts, n={body.n})", "n")
        t = self.trained_temperature
        if t is not None and (body.temperature != t or body.top_p != 1 or body.top_k != 0):
            raise OpenAIError(400, f"trajectory {key!r} is recorded for training, which samples "
                              f"at temperature={t}, top_p=1, top_k=0 (the trained policy); got "
                              f"temperature={body.temperature}, top_p={body.top_p}, "
                              f"top_k={body.top_k}", "temperature")
        return key

    # -- shared --------------------------------------------------------------------------------
    def _prompts(self, prompt) -> list[list[int]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        if prompt and all(isinstance(t, int) for t in prompt):
            prompt = [prompt]
        if not prompt:
            raise OpenAIError(400, "prompt is empty", "prompt")
        out = []
        for p in prompt:
            try:
                ids = prompt_ids(self.tokenizer, p) if isinstance(p, str) else list(p)
            except ValueError as e:
                raise OpenAIError(400, f"prompt: {e}", "prompt") from None
            if not ids:
                raise OpenAIError(400, "a prompt has no tokens", "prompt")
            out.append(ids)
        return out

    def _submit(self, body, prompts, max_tokens, key=None, grammar=(None, None)):
        """One stream per prompt (each with body.n samples), all validated before any runs.
        `grammar`: (the grammar every sample must match or None, the field it came from)."""
        seed = body.seed if body.seed is not None else secrets.randbelow(2**32)
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stops) > MAX_STOPS or any(not s for s in stops):
            raise OpenAIError(400, f"stop={body.stop!r}: up to {MAX_STOPS} non-empty strings",
                              "stop")
        bias = logit_bias_pairs(body.logit_bias, self.tokenizer.vocab_size)
        samplings = []
        for ids in prompts:
            limit = max_tokens or max(self.max_len - len(ids), 1)
            try:
                sampling = SamplingParams(max_tokens=limit, temperature=body.temperature,
                                          top_p=body.top_p, top_k=body.top_k, seed=seed,
                                          n=body.n, min_tokens=body.min_tokens,
                                          grammar=grammar[0], logit_bias=bias,
                                          presence_penalty=body.presence_penalty or 0.0,
                                          frequency_penalty=body.frequency_penalty or 0.0)
                self.generation.validate(ids, sampling, key)
            except (ValueError, InvalidRequest) as e:
                message = str(e)
                if grammar[0] is not None and ("grammar" in message or "constrain" in message):
                    raise OpenAIError(400, f"{grammar[1]}: {message}", grammar[1]) from None
                raise OpenAIError(400, message, next(
                    (f for f in ("logit_bias", "max_tokens") if f in message), "prompt")) from None
            if len(ids) + limit > self.max_len:     # below the engine's own limit
                raise OpenAIError(400, f"max_tokens={limit} is over the limit: a {len(ids)}-"
                                  f"token prompt leaves room for {self.max_len - len(ids)} "
                                  f"(sequences end at {self.max_len} tokens)",
                                  "max_tokens" if len(ids) < self.max_len else "prompt")
            samplings.append(sampling)
        try:
            streams = [self.generation.submit(ids, s, session=key)
                       for ids, s in zip(prompts, samplings)]
        except QueueFull as e:
            raise OpenAIError(429, str(e), kind="rate_limit_error") from None
        except EngineStopped as e:
            raise OpenAIError(503, str(e), kind="server_error") from None
        return streams, stops

    def _respond(self, body, prompts, max_tokens, reply: Reply, key=None,
                 grammar=(None, None)):
        """The response to a request, reported as `reply` says. max_tokens=0 (with echo)
        generates nothing."""
        kind, logprobs, tools, top, echo = (reply.kind, reply.logprobs, reply.tools, reply.top,
                                            reply.echo)
        streams, stops = (self._submit(body, prompts, max_tokens, key, grammar)
                          if max_tokens != 0 else ([], []))
        choices = [Choice(self.tokenizer, stops, tools() if tools else None)
                   for _ in range(len(prompts) * body.n)]
        if max_tokens == 0:
            for c in choices:
                c.end("length")
        meta = {"id": f"{'chatcmpl' if kind.startswith('chat') else 'cmpl'}-"
                      f"{uuid.uuid4().hex}", "created": int(time.time()),
                "model": body.model or self.model_name}
        usage_prompt = sum(len(p) for p in prompts) * body.n
        if body.stream:
            with_usage = bool((body.stream_options or {}).get("include_usage"))
            events = sse(streams, choices, body.n, reply, meta,
                         usage_prompt if with_usage else None,
                         lambda: self._record(key, choices))
            return StreamingResponse(events, media_type="text/event-stream")
        for _ in read_events(streams, choices, body.n):
            pass
        self._record(key, choices)
        prompt_of = lambda i: prompts[i // body.n]  # noqa: E731
        out = [choice_json(kind, i, c, logprobs, final=True,
                           text=self.tokenizer.decode(prompt_of(i)) + c.text if echo else None,
                           scored=None if top is None else self._scored(prompt_of(i), c, top,
                                                                        echo))
               for i, c in enumerate(choices)]
        return {**meta, "object": kind, "choices": out, "usage": usage(usage_prompt, choices)}

    def _scored(self, prompt: list[int], c: Choice, top: int, echo: bool) -> Scored:
        sequence = list(prompt) + list(c.tokens)
        if len(sequence) < 2:           # one token: nothing before it to score it by
            empty = np.zeros((0, SCORE_TOP))
            return Scored(list(prompt), np.zeros(0), empty.astype(np.int32), empty, top, echo)
        try:
            logprobs, ids, values = self.generation.score(sequence)
        except InvalidRequest as e:
            raise OpenAIError(400, str(e), "prompt") from None
        except EngineStopped as e:
            raise OpenAIError(503, str(e), kind="server_error") from None
        return Scored(list(prompt), logprobs, ids, values, top, echo)

    def _record(self, key: str | None, choices: list[Choice]) -> None:
        if key is not None:
            c = choices[0]
            self.trajectories.record(key, c.tokens, c.logprobs, c.versions)


async def _server_error(_: Request, exc: Exception) -> JSONResponse:
    """A bug: OpenAI's error shape with status 500 (not plain text), the connection kept."""
    _log.exception("request failed", exc_info=exc)
    return OpenAIError(500, f"internal error: {type(exc).__name__}: {exc}",
                       kind="server_error").response()


async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {}
    where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
    message = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ())[1:]) or 'body'}: "
                        f"{e.get('msg')}" for e in errors) or "invalid request"
    return OpenAIError(400, message, where).response()
