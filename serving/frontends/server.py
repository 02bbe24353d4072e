"""The gRPC front end: JetStream's `jetstream_proto.Orchestrator` service, unchanged on the wire,
plus `jaxrl.serving.Generation` for logprobs, versions, weight updates and metrics.

Bad requests get INVALID_ARGUMENT with a message that says what is wrong; a full queue gets
RESOURCE_EXHAUSTED; a client that goes away frees its slots. None of these stop the server.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
from concurrent import futures

import grpc
import jax
import numpy as np

from jaxrl.models.tokenizer import Tokenizer
from serving.core.orchestrator import (
    DoneEvent,
    EngineStopped,
    InvalidRequest,
    Orchestrator,
    QueueFull,
    Sample,
    TokenEvent,
)
from serving.frontends.detokenize import IncrementalDecoder
from serving.frontends.health import Health
from serving.frontends.health import add_to_server as add_health
from serving.proto import generation_pb2 as gen_pb2
from serving.proto import generation_pb2_grpc as gen_grpc
from serving.proto import jetstream_pb2 as js_pb2
from serving.proto import jetstream_pb2_grpc as js_grpc
from serving.runner.sampling import SamplingParams
from serving.weights.pulls import Pulls
from serving.weights.transfer import as_tree, check_specs
from serving.weights.weight_stream import (
    StaleVersion,
    WeightAssembler,
    check_version,
    quantized_names,
    tensor_names,
)
from sharding.reshard import WeightUpdateError

log = logging.getLogger("jaxrl.serve")

def _submit(orchestrator: Orchestrator, context, prompt, sampling_fn, carry=None,
            session=None, predicted_len=None):
    """Validates and queues; aborts the RPC with the right status on bad input."""
    try:
        sampling = sampling_fn()
        stream = orchestrator.submit(prompt, sampling, carry=carry, session=session,
                                     predicted_len=predicted_len)
    except (InvalidRequest, ValueError) as e:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    except QueueFull as e:
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
    except EngineStopped as e:
        context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
    context.add_callback(stream.cancel)  # runs when the RPC ends, including a client cancel
    return stream, sampling


class _Detokenizer:
    """Incremental text per sample (serving/frontends/detokenize.py): the text each token completes,
    and what was held back when the sample ends."""

    def __init__(self, tokenizer: Tokenizer | None, n: int):
        self.decoders = [IncrementalDecoder(tokenizer) if tokenizer else None for _ in range(n)]

    def add(self, i: int, token: int) -> str:
        return self.decoders[i].add(token) if self.decoders[i] else ""

    def flush(self, i: int) -> str:
        return self.decoders[i].flush() if self.decoders[i] else ""


def _responses(batch, detok: _Detokenizer):
    """One GenerateResponse per run of a sample's tokens in `batch` (in order), and one per
    sample that ends in it, after its tokens."""
    runs: dict[int, list[TokenEvent]] = {}
    for event in batch:
        if isinstance(event, DoneEvent):
            yield from _tokens(runs.pop(event.sample_index, ()), detok)
            routes = {} if event.routes is None else {
                "routes": np.asarray(event.routes, "<i4").tobytes(),
                "routes_shape": list(event.routes.shape)}
            spec = {} if event.speculation is None else {
                "spec_verify_steps": event.speculation.verify_steps,
                "spec_draft_tokens": event.speculation.draft_tokens,
                "spec_accepted_tokens": event.speculation.accepted_tokens}
            yield gen_pb2.GenerateResponse(sample_index=event.sample_index,
                                           finish_reason=event.reason,
                                           text=detok.flush(event.sample_index), **routes,
                                           **spec)
        else:
            runs.setdefault(event.sample_index, []).append(event)
    for events in runs.values():
        yield from _tokens(events, detok)


def _tokens(events, detok: _Detokenizer):
    if events:
        i = events[0].sample_index
        yield gen_pb2.GenerateResponse(
            sample_index=i, token_ids=[e.token for e in events],
            logprobs=[e.logprob for e in events], versions=[e.version for e in events],
            text="".join(detok.add(i, e.token) for e in events))


def _prompt(tokenizer, context, text: str | None, ids):
    if text is not None:
        if tokenizer is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "this server has no tokenizer; "
                          "send token ids")
        try:
            return tokenizer.encode(text)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"cannot tokenize the text: {e}")
    return list(ids)


class JetStreamService(js_grpc.OrchestratorServicer):
    def __init__(self, orchestrator: Orchestrator, tokenizer: Tokenizer | None):
        self.orchestrator = orchestrator
        self.tokenizer = tokenizer

    def Decode(self, request, context):
        kind = request.WhichOneof("content")
        if kind is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "request has neither text_content nor token_content")
        prompt = _prompt(self.tokenizer, context,
                         request.text_content.text if kind == "text_content" else None,
                         request.token_content.token_ids)
        n = request.num_samples or 1
        # JetStream's request carries no sampling options: the server decodes greedily.
        stream, _ = _submit(self.orchestrator, context, prompt, lambda: SamplingParams(
            max_tokens=request.max_tokens, temperature=0.0, n=n))
        detok = _Detokenizer(self.tokenizer if kind == "text_content" else None, n)
        for event in stream:
            samples = [js_pb2.DecodeResponse.StreamContent.Sample() for _ in range(n)]
            if isinstance(event, DoneEvent):      # text the decoder held back, if any
                samples[event.sample_index].text = detok.flush(event.sample_index)
                if not samples[event.sample_index].text:
                    continue
            elif self._ends(event.token):
                continue  # JetStream streams content only, not the EOS / stop token
            else:
                samples[event.sample_index].token_ids.append(event.token)
                samples[event.sample_index].text = detok.add(event.sample_index, event.token)
            yield js_pb2.DecodeResponse(
                stream_content=js_pb2.DecodeResponse.StreamContent(samples=samples))

    def _ends(self, token: int) -> bool:
        return token == self.orchestrator.eos_id

    def HealthCheck(self, request, context):
        return js_pb2.HealthCheckResponse(is_live=self.orchestrator.error is None)


MAX_PAUSE_LEASE_S = 3600.0      # the longest a Pause may hold the engine


class GenerationService(gen_grpc.GenerationServicer):
    def __init__(self, orchestrator: Orchestrator, tokenizer: Tokenizer | None,
                 update_token: str | None, transfer_host: str = "127.0.0.1"):
        self.orchestrator = orchestrator
        self.tokenizer = tokenizer
        self.update_token = update_token
        self.transfer_host = transfer_host     # where weight pulls leave from
        self._pulls = Pulls(transfer_host, self._devices)
        self._shapes = tensor_names(orchestrator.engine.param_target)
        self._quantized = quantized_names(orchestrator.engine.param_target)

    def _devices(self) -> list:
        """The devices the engine's weights live on, by id (device-to-device pulls land on the
        first)."""
        sharding = jax.tree.leaves(self.orchestrator.engine.param_target)[0].sharding
        return sorted(sharding.device_set, key=lambda d: d.id)

    def Generate(self, request, context):
        kind = request.WhichOneof("prompt")
        prompt = _prompt(self.tokenizer, context, request.text if kind == "text" else None,
                         request.token_ids.ids if kind == "token_ids" else [])
        o = request.sampling
        stream, sampling = _submit(self.orchestrator, context, prompt, lambda: SamplingParams(
            max_tokens=o.max_tokens, temperature=o.temperature, top_k=o.top_k,
            top_p=o.top_p if 0 < o.top_p < 1 else 1.0, seed=o.seed, n=o.n or 1,
            stop_token_ids=tuple(o.stop_token_ids), stop_at_eos=not o.ignore_eos,
            min_tokens=o.min_tokens, grammar=o.grammar or None,
            logit_bias=tuple(zip(o.bias_token_ids, o.bias_values, strict=True)),
            presence_penalty=o.presence_penalty, frequency_penalty=o.frequency_penalty),
            carry=[Sample(list(c.token_ids), list(c.logprobs), list(c.versions))
                   for c in request.carry] or None,
            session=_session(request.sessions, o.n or 1),
            predicted_len=request.predicted_len if request.predicted_len > 0 else None)
        detok = _Detokenizer(self.tokenizer, sampling.n)
        for batch in stream.batches(max(request.stream_interval_ms, 0) / 1000):
            yield from _responses(batch, detok)

    def _authorize(self, context, what: str = "weight updates") -> None:
        if not self.update_token:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"{what} are disabled: the server was started without an "
                          "update token")
        given = dict(context.invocation_metadata()).get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.update_token}".encode()):
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          f"{what} need 'authorization: Bearer <token>' metadata with "
                          "the server's update token")

    def UpdateWeights(self, request_iterator, context):
        self._authorize(context)
        try:
            assembler = WeightAssembler(self._shapes, self.orchestrator.newest_version,
                                        self._quantized)
            for piece in request_iterator:
                assembler.add(piece)
            version, params = assembler.finish()
            result = self.orchestrator.update_params(params, version, resume=assembler.resume)
        except StaleVersion as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except (WeightUpdateError, ValueError) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return self._updated(version, result, "streamed")

    def PullWeights(self, request, context):
        """The pull paths (serving/weights/transfer.py, serving/weights/bulk.py): every check first,
        then the pull, then the swap."""
        self._authorize(context)
        specs = [(t.name, tuple(t.shape), t.dtype) for t in request.tensors]
        try:
            check_version(request.version, request.resume, self.orchestrator.newest_version)
            check_specs(specs, self._shapes, self._quantized)
            if request.transport not in ("", "jax", "tcp"):
                raise WeightUpdateError(f"weight pull: transport {request.transport!r} is not "
                                        f"one of 'jax', 'tcp'")
        except StaleVersion as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except WeightUpdateError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        def apply(named):
            return self.orchestrator.update_params(as_tree(named), request.version,
                                                   resume=request.resume, pulled=True)

        try:
            result = self._pulls.pull(request, specs, context.time_remaining(), apply)
        except StaleVersion as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except (WeightUpdateError, ValueError) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Exception as e:      # the offer is gone, the trainer unreachable, the deadline
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          f"weight pull from {request.address} failed: {e}")
        return self._updated(request.version, result, "pulled")

    def bulk_server(self):
        """This server's bulk TCP server (serving/weights/bulk.py: what it relays is pulled from it)."""
        return self._pulls.bulk_server()

    @staticmethod
    def _updated(version: int, result, how: str):
        log.info("weights version %d %s%s: transfer %.1f ms, pause %.3f ms", version, how,
                 " (LoRA adapters alone)" if result.adapters else "",
                 1e3 * result.transfer_s, 1e3 * result.pause_s)
        return gen_pb2.UpdateWeightsResponse(version=version, transfer_ms=1e3 * result.transfer_s,
                                             pause_ms=1e3 * result.pause_s)

    def GetMetrics(self, request, context):
        return gen_pb2.MetricsResponse(json=json.dumps(
            {**self.orchestrator.metrics(), "bulk_address": self.bulk_server().address,
             **self.bulk_server().stats}))

    def EndSession(self, request, context):
        self.orchestrator.end_session(request.session)
        return gen_pb2.EndSessionResponse()

    def Pause(self, request, context):
        """Partial rollouts' pause, for a trainer on other devices; leased, so a trainer that
        dies while the engine is paused does not leave it paused."""
        self._authorize(context, "pauses")
        if not 0 < request.lease_s <= MAX_PAUSE_LEASE_S:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"lease_s={request.lease_s} must be in (0, {MAX_PAUSE_LEASE_S:g}]")
        remaining = context.time_remaining()
        try:
            self.orchestrator.pause(timeout=60.0 if remaining is None else max(remaining, 0.0),
                                    lease_s=request.lease_s)
        except TimeoutError as e:
            self.orchestrator.resume()      # not paused after a failed call
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(e))
        log.info("paused (lease %g s) at %d tokens generated", request.lease_s,
                 self.orchestrator.metrics()["generated_tokens"])
        return gen_pb2.PauseResponse(paused=self.orchestrator.paused)

    def Resume(self, request, context):
        self._authorize(context, "pauses")
        generated = self.orchestrator.metrics()["generated_tokens"]
        self.orchestrator.resume()
        log.info("resumed at %d tokens generated", generated)
        return gen_pb2.PauseResponse(paused=False)


def _session(keys, n: int):
    """GenerateRequest.sessions as Orchestrator.submit takes them: one key is a turn of that
    session (n=1), n keys open n sessions."""
    keys = list(keys)
    if not keys:
        return None
    return keys[0] if len(keys) == 1 and n == 1 else keys


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the server on this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class Server:
    """Both services, and gRPC's health service (serving/frontends/health.py), on one port. `port=0`
    picks a free one (see `.port` after `start`).

    `tls`: (certificate chain, private key) as PEM bytes; without it the port is plaintext.
    `max_concurrent_rpcs`: RPCs in progress at once; more get RESOURCE_EXHAUSTED at once. Each
    has a thread of its own (a sync gRPC server serves a stream on one thread throughout), so
    no admitted stream waits for another to end.
    A non-loopback `host` is refused unless `allow_remote`, and then logs a warning (louder
    without TLS: the weight-update token would cross the network in clear)."""

    def __init__(self, orchestrator: Orchestrator, tokenizer: Tokenizer | None = None, *,
                 host: str = "127.0.0.1", port: int = 9000, update_token: str | None = None,
                 max_concurrent_rpcs: int = 1024,
                 tls: tuple[bytes, bytes] | None = None, allow_remote: bool = False):
        if not is_loopback(host):
            if not allow_remote:
                raise ValueError(f"host {host!r} is reachable from other machines; pass "
                                 f"allow_remote (jaxrl serve --allow-remote) to bind it")
            log.warning("serving on %s, reachable from other machines%s", host,
                        "" if tls else " WITHOUT TLS: requests, outputs and the weight-update "
                        "token cross the network in clear (use --tls-cert/--tls-key)")
        self.orchestrator = orchestrator
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_concurrent_rpcs),
                                   maximum_concurrent_rpcs=max_concurrent_rpcs,
                                   options=[("grpc.max_receive_message_length", 64 * 2**20)])
        js_grpc.add_OrchestratorServicer_to_server(
            JetStreamService(orchestrator, tokenizer), self._server)
        gen_grpc.add_GenerationServicer_to_server(
            GenerationService(orchestrator, tokenizer, update_token, transfer_host=host),
            self._server)
        self.address = f"{host}:{port}"
        if tls is not None:
            credentials = grpc.ssl_server_credentials([(tls[1], tls[0])])
            self.port = self._server.add_secure_port(self.address, credentials)
        else:
            self.port = self._server.add_insecure_port(self.address)
        if self.port == 0:
            raise OSError(f"cannot listen on {self.address}")
        self.address = f"{host}:{self.port}"
        self.health = Health(lambda: orchestrator.error is None, [
            s.full_name for proto in (js_pb2, gen_pb2)
            for s in proto.DESCRIPTOR.services_by_name.values()])
        add_health(self.health, self._server)

    def start(self) -> "Server":
        self._server.start()
        return self

    def stop(self, grace: float = 5.0) -> None:
        self.health.stop()
        self._server.stop(grace).wait()
        self.orchestrator.stop()

    def wait(self) -> None:
        self._server.wait_for_termination()
