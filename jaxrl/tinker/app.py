"""The Tinker API's routes (`/api/v1/...`) as the official `tinker` SDK calls them.

JSON bodies everywhere but forward_backward (protobuf, jaxrl/tinker/wire.py); training and
sampling requests answer with a future (`request_id`) at once and the SDK polls
`retrieve_future`, which holds the poll until the result is ready or POLL_S passes (then "try
again"). Errors: 400 for a bad request (BadRequestError in the SDK), 401 for a bad key
(AuthenticationError), 404 for an unknown id (NotFoundError); a request that fails after it
was accepted fails its future with category "user" or "server" (RequestFailedError). Nothing
a client sends can stop the service or touch another client's state.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import random

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from jaxrl.tinker.errors import NotFound, UserFault
from jaxrl.tinker.sampler import Job
from jaxrl.tinker.service import Service
from jaxrl.tinker.state import checkpoint_lora
from jaxrl.tinker.training import check_adam
from jaxrl.tinker.wire import (Sequence, WireError, decode_forward_backward,
                               decode_forward_backward_json, encode_sample, sample_json)
from serving.core.requests import InvalidRequest
from serving.runner.sampling import SamplingParams

PROTO = "application/x-protobuf"
OPEN = ("/api/v1/healthz",)            # answered without a key


def make_app(service: Service, api_key: str | None) -> FastAPI:
    app = FastAPI(title="jaxrl tinker", docs_url=None, redoc_url=None)

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        if api_key is not None and request.url.path not in OPEN:
            given = request.headers.get("x-api-key", "")
            if not hmac.compare_digest(given.encode(), api_key.encode()):
                return JSONResponse({"detail": "invalid API key (X-API-Key)"}, 401)
        return await call_next(request)

    @app.exception_handler(UserFault)
    @app.exception_handler(WireError)
    @app.exception_handler(InvalidRequest)
    async def bad_request(request: Request, e: Exception):
        return JSONResponse({"detail": str(e)}, 400)

    @app.exception_handler(NotFound)
    async def not_found(request: Request, e: Exception):
        return JSONResponse({"detail": str(e)}, 404)

    for routes in (_client_routes, _model_routes, _weights_routes, _sampling_routes,
                   _future_routes):
        routes(app, service)
    return app


async def _body(request: Request) -> dict:
    try:
        data = await request.json()
    except ValueError:
        raise UserFault("the body is not JSON") from None
    if not isinstance(data, dict):
        raise UserFault("the body is not a JSON object")
    return data


def _need(data: dict, key: str, kind=str):
    value = data.get(key)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
        raise UserFault(f"{key}: a {kind.__name__} is needed, got {value!r}")
    return value


def _client_routes(app: FastAPI, service: Service) -> None:
    """What the SDK asks before its first request: health, flags, capabilities, sessions."""

    @app.get("/api/v1/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.post("/api/v1/client/config")
    async def client_config():
        return {"pjwt_auth_enabled": False, "parallel_fwdbwd_chunks": True,
                "proto_compress_fwdbwd": False, "sample_use_retrieve_futures": False,
                "custom_loss_server_side": False, "sample_join_sampling_session": False}

    @app.post("/api/v1/client/dynamic_config")
    async def client_dynamic_config():
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities():
        return {"supported_models": [{"model_name": service.base_name,
                                      "max_context_length": service.trainer.max_len,
                                      "trainable": True, "sampleable": True}]}

    @app.post("/api/v1/create_session")
    async def create_session():
        return {"type": "create_session", "session_id": service.create_session()}

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat(request: Request):
        service.heartbeat(_need(await _body(request), "session_id"))
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish(session_id: str):
        service.finish_session(session_id)
        return {}

    @app.post("/api/v1/telemetry")
    async def telemetry():
        return {"status": "accepted"}


def _model_routes(app: FastAPI, service: Service) -> None:
    """Training clients: create, describe, forward(_backward), optim_step."""

    @app.post("/api/v1/create_model")
    async def create_model(request: Request):
        data = await _body(request)
        lora = data.get("lora_config")
        if lora is not None and not isinstance(lora, dict):
            raise UserFault(f"lora_config: an object, got {lora!r}")
        optimizer = (data.get("optimizer_config") or {}).get("type", "adamw")
        if optimizer != "adamw":
            raise UserFault(f"optimizer_config.type {optimizer!r}: this service runs adamw")
        model_id = service.create_model(_need(data, "session_id"),
                                        _need(data, "model_seq_id", int),
                                        _need(data, "base_model"), lora)
        f = service.new_future()
        f.succeed(json={"type": "create_model", "model_id": model_id})
        return {"request_id": f.request_id, "model_id": model_id}

    @app.post("/api/v1/get_info")
    async def get_info(request: Request):
        return service.info(_need(await _body(request), "model_id"))

    async def enqueue(request: Request, forward_only: bool):
        if PROTO in request.headers.get("content-type", ""):
            fb = decode_forward_backward(await request.body(),
                                         request.headers.get("content-encoding"))
        else:       # SDKs before 0.18: JSON, and forward on a route of its own
            fb = decode_forward_backward_json(await _body(request), forward_only)
        f = service.enqueue(fb.model_id, fb.seq_id or None, "forward_backward", fb,
                            service.check_forward_backward(fb))
        return {"request_id": f.request_id, "model_id": fb.model_id}

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request):
        return await enqueue(request, False)

    @app.post("/api/v1/forward")
    async def forward(request: Request):
        return await enqueue(request, True)

    @app.post("/api/v1/optim_step")
    async def optim_step(request: Request):
        data = await _body(request)
        adam = data.get("adam_params", data.get("optimizer_params", {}))
        if not isinstance(adam, dict):
            raise UserFault(f"adam_params: an object, got {adam!r}")
        try:
            adam = check_adam(adam)
        except ValueError as e:
            raise UserFault(str(e)) from None
        f = service.enqueue(_need(data, "model_id"), data.get("seq_id"), "optim_step", adam)
        return {"request_id": f.request_id}


def _weights_routes(app: FastAPI, service: Service) -> None:
    """Weights for samplers, and state (Orbax checkpoints) saved and loaded."""

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_weights_for_sampler(request: Request):
        data = await _body(request)
        kind = data.get("kind", "snapshot")
        if kind not in ("snapshot", "inflight"):
            raise UserFault(f"kind {kind!r}: snapshot or inflight")
        f = service.enqueue(_need(data, "model_id"), data.get("seq_id"), "save_for_sampler",
                            (data.get("path"), kind))
        return {"request_id": f.request_id}

    @app.post("/api/v1/save_weights")
    async def save_weights(request: Request):
        data = await _body(request)
        f = service.enqueue(_need(data, "model_id"), data.get("seq_id"), "save_state",
                            data.get("path"))
        return {"request_id": f.request_id}

    @app.post("/api/v1/load_weights")
    async def load_weights(request: Request):
        data = await _body(request)
        path, optimizer = _need(data, "path"), bool(data.get("optimizer", False))
        model_id = data.get("model_id")
        if model_id is None:          # create-via-load: the load is the new model's first op
            base, lora = checkpoint_lora(service.state_dir, path)
            model_id = service.create_model(_need(data, "session_id"),
                                            _need(data, "model_seq_id", int),
                                            data.get("base_model") or base, lora, first_seq=0)
            seq = 0
        else:
            seq = data.get("seq_id")
        f = service.enqueue(model_id, seq, "load_state", (path, optimizer))
        return {"request_id": f.request_id, "model_id": model_id}


def _sampling_routes(app: FastAPI, service: Service) -> None:
    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request):
        data = await _body(request)
        sid = service.create_sampling_session(data.get("model_path"), data.get("base_model"))
        return {"type": "create_sampling_session", "sampling_session_id": sid}

    @app.post("/api/v1/asample")
    async def asample(request: Request):
        data = await _body(request)
        if data.get("sampling_session_id"):
            key = service.sampling_key(data["sampling_session_id"])
        else:
            key = service.weights_key(data.get("model_path"), data.get("base_model"))
        prompt = _prompt(data.get("prompt"))
        n = _need(data, "num_samples", int) if "num_samples" in data else 1
        sampling, stops = _sampling(data.get("sampling_params") or {}, n,
                                    service.trainer.max_len - len(prompt))
        f = service.new_future()

        def done(seqs: list[Sequence] | None, prompt_lp, error):
            if error is not None:
                category = "user" if isinstance(error, (InvalidRequest, ValueError)) else "server"
                f.fail(f"{type(error).__name__}: {error}", category)
            else:
                f.succeed(render=(functools.partial(encode_sample, seqs, prompt_lp),
                                  functools.partial(sample_json, seqs, prompt_lp)))

        try:
            service.sampler.submit(Job(key, prompt, sampling, stops,
                                       bool(data.get("prompt_logprobs")), done))
        except ValueError as e:
            raise UserFault(str(e)) from None
        return {"request_id": f.request_id,
                "sample_sequence_ids": [f"{f.request_id}-{i}" for i in range(n)]}


def _future_routes(app: FastAPI, service: Service) -> None:
    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request):
        rid = _need(await _body(request), "request_id")
        f = await asyncio.to_thread(service.wait, rid)
        if f is None:
            return {"type": "try_again", "request_id": rid, "queue_state": "active"}
        if f.error is not None:
            return {"error": f.error, "category": f.category}
        if f.render is not None:
            if PROTO in request.headers.get("accept", ""):
                return Response(f.render[0](), media_type=PROTO)
            return f.render[1]()
        return f.json


def _prompt(prompt) -> list[int]:
    if not isinstance(prompt, dict) or not isinstance(prompt.get("chunks"), list):
        raise UserFault(f"prompt: a ModelInput ({{'chunks': [...]}}), got {prompt!r}")
    tokens: list[int] = []
    for chunk in prompt["chunks"]:
        kind = chunk.get("type", "encoded_text") if isinstance(chunk, dict) else None
        if kind != "encoded_text":
            raise UserFault(f"prompt chunk of type {kind!r}: this service takes encoded_text")
        ids = chunk.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise UserFault("prompt chunk tokens: a list of token ids")
        tokens += ids
    if not tokens:
        raise UserFault("prompt has no tokens")
    return tokens


def _sampling(p: dict, n: int, room: int) -> tuple[SamplingParams, list[str]]:
    """The engine's SamplingParams for the SDK's (max_tokens None: up to the context), and the
    stop strings."""
    stop = p.get("stop")
    stop_ids, stops, at_eos = (), [], True
    if isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list):
        if all(isinstance(s, int) for s in stop):
            stop_ids, at_eos = tuple(stop), False        # given ids replace EOS ([]: none)
        elif all(isinstance(s, str) for s in stop):
            stops = list(stop)
        else:
            raise UserFault(f"stop: a string, strings or token ids, got {stop!r}")
    elif stop is not None:
        raise UserFault(f"stop: a string, strings or token ids, got {stop!r}")
    seed = p.get("seed")
    top_k = p.get("top_k", -1)
    try:
        return SamplingParams(
            max_tokens=p.get("max_tokens") or max(room, 1),
            temperature=float(p.get("temperature", 1.0)),
            top_k=0 if top_k is None or top_k < 0 else int(top_k),
            top_p=float(p.get("top_p", 1.0)),
            seed=random.randrange(2**32) if seed is None else int(seed) % 2**32,
            n=n, stop_token_ids=stop_ids, stop_at_eos=at_eos), stops
    except (TypeError, ValueError) as e:
        raise UserFault(f"sampling_params: {e}") from None
