"""The OpenAI API's shapes as the endpoint (serving/frontends/openai_api.py) takes them: the request
bodies of /v1/completions and /v1/chat/completions (pydantic models: a field out of range is
HTTP 400 naming it), OpenAI's error body, and the finish reasons."""

from __future__ import annotations

from typing import Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

MAX_STOPS = 16        # stop strings a request may give (code tasks give more than OpenAI's 4)

# Fields of OpenAI's API this server does not implement: a request that sets one is refused
# with HTTP 400 naming it, never answered as if it had not been set. (Their neutral values,
# which change nothing, are accepted.)
UNSUPPORTED = {"functions": None, "function_call": ("none", None), "suffix": ("", None),
               "best_of": (1, None)}


def refuse_unsupported(body) -> None:
    """OpenAIError(400) for the first field of UNSUPPORTED the request sets."""
    extra = body.model_extra or {}
    for name, neutral in UNSUPPORTED.items():
        if name in extra:
            value = extra[name]
            allowed = neutral if isinstance(neutral, tuple) else (neutral,)
            if not any(value == v for v in allowed):
                raise OpenAIError(400, f"{name}={value!r} is not supported by this server "
                                  f"(jaxrl serve): leave it out", name)


# engine finish reasons -> OpenAI's; anything else means the engine failed the request
FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.kind,
                                       "param": self.param, "code": None}},
                            status_code=self.status)


class _Sampling(BaseModel):
    """Fields both endpoints share (vLLM's `top_k` included)."""

    model_config = ConfigDict(extra="allow")     # kept to be checked: refuse_unsupported
    model: str | None = None
    n: int = Field(1, ge=1, le=64)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    seed: int | None = Field(None, ge=0, lt=2**32)
    min_tokens: int = Field(0, ge=0)   # vLLM's: no EOS or stop token id before this many
    logit_bias: dict[str, float] | None = None     # token id (a string, as JSON keys are) -> bias
    presence_penalty: float | None = Field(0.0, ge=-2, le=2)     # None: 0 (OpenAI's clients
    frequency_penalty: float | None = Field(0.0, ge=-2, le=2)    # send null for "not set")
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None
    user: str | None = None            # an end-user id (OpenAI's): accepted, unused
    # jaxrl's: record the request into this trajectory (as the X-Trajectory-Id header does)
    trajectory_id: str | None = Field(None, min_length=1)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)     # 0: with echo, score the prompt only
    logprobs: int | None = Field(None, ge=0, le=20)  # vLLM's limit (OpenAI's is 5)
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None


class FunctionDef(BaseModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDef


class _FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: _FunctionName


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


def logit_bias_pairs(value: dict[str, float] | None, vocab_size: int) -> tuple:
    """OpenAI's logit_bias ({"token id": bias}) as SamplingParams takes it; a 400 naming the
    entry that is not a token id of the vocabulary."""
    pairs = []
    for key, bias in (value or {}).items():
        try:
            token = int(key)
        except ValueError:
            token = -1
        if not 0 <= token < vocab_size:
            raise OpenAIError(400, f"logit_bias: {key!r} is not a token id in [0, {vocab_size})",
                              "logit_bias")
        pairs.append((token, float(bias)))
    return tuple(sorted(pairs))
