"""The client side of the Generation service: a `jaxrl serve` process as a `Generation`
(serving/fleet/generation.py), plus the weight-piece stream on its own.

A group is one `Generate` stream, read by a thread of its own into a `RequestStream`, so the
caller sees exactly what an in-process orchestrator gives: token events with log-probs and
versions, then one done event per sample. When the connection fails (server killed, network
gone, deadline passed) the samples not finished end with reason "lost" and the stream's snapshot
keeps every token received, so the group can continue on another server (`carry`). A request
the server refuses ends with reason "refused" and the server's message in `stream.error`.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from typing import Sequence

import grpc
import jax
import numpy as np

from serving.core.orchestrator import UpdateResult
from serving.core.requests import StaleVersion
from serving.core.stream import DoneEvent, RequestStream, Sample, Speculated, TokenEvent
from serving.proto import generation_pb2 as gen_pb2
from serving.proto import generation_pb2_grpc as gen_grpc
from serving.runner.sampling import SamplingParams
from sharding.reshard import WeightUpdateError

MAX_MESSAGE = 64 * 2**20
TRANSFERS = ("grpc", "jax", "tcp")
_REFUSED = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
            grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
            grpc.StatusCode.OUT_OF_RANGE)


def weight_pieces(params, version: int, piece_bytes: int = 1 << 20, *, resume: bool = False):
    """`WeightPiece` messages for a nested dict of arrays, each at most `piece_bytes` of data."""
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = _name(path)
        a = np.ascontiguousarray(jax.device_get(x))
        data = a.tobytes()
        for offset in range(0, max(len(data), 1), piece_bytes):
            yield gen_pb2.WeightPiece(version=version, name=name, shape=a.shape,
                                      dtype=a.dtype.name, offset=offset,
                                      data=data[offset: offset + piece_bytes], resume=resume)


def _name(path) -> str:
    """A parameter's path as the wire names it, e.g. "layers/q_proj"."""
    return "/".join(str(getattr(k, "key", k)) for k in path)


def push_weights(channel, params, version: int, token: str, timeout: float = 600.0):
    """Sends `params` as weights `version`; returns the server's UpdateWeightsResponse."""
    stub = gen_grpc.GenerationStub(channel)
    return stub.UpdateWeights(weight_pieces(params, version), timeout=timeout,
                              metadata=[("authorization", f"Bearer {token}")])


def open_channel(address: str, *, tls_ca: bytes | None = None) -> grpc.Channel:
    """A channel to `address` (host:port); over TLS when `tls_ca` (PEM roots) is given."""
    options = [("grpc.max_receive_message_length", MAX_MESSAGE),
               ("grpc.max_send_message_length", MAX_MESSAGE)]
    if tls_ca is not None:
        return grpc.secure_channel(address, grpc.ssl_channel_credentials(tls_ca), options)
    return grpc.insecure_channel(address, options)


class RemoteStream(RequestStream):
    """A RequestStream fed from a Generate call; cancelling it cancels the call."""

    def __init__(self, request_id: int, n: int):
        super().__init__(request_id, n)
        self.call = None

    def cancel(self) -> None:
        super().cancel()
        if self.call is not None:
            self.call.cancel()


class RemoteGeneration:
    """A `jaxrl serve` process at `address`, as a Generation.

    `token`: the server's weight-update token (needed by `update_params`).
    `rpc_timeout_s`: the deadline of metrics calls (a hung server fails them).
    `transfer`: how `update_params` sends weights: "grpc" streams them in pieces over the gRPC
    call; "jax" has the server pull them device to device from a jax.experimental.transfer
    server of this process (serving/weights/transfer.py); "tcp" has it pull them from a bulk TCP
    server of this process (serving/weights/bulk.py). Both pull paths bind `transfer_host`, which
    the server must reach.
    `stream_interval_ms`: 0, each token as it is drawn; N, a sample's tokens gathered for up to
    N ms per message (an RL trainer's: fewer messages for its process to read)."""

    def __init__(self, address: str, *, token: str | None = None, tls_ca: bytes | None = None,
                 rpc_timeout_s: float = 10.0, transfer: str = "grpc",
                 transfer_host: str = "127.0.0.1", stream_interval_ms: int = 0):
        if transfer not in TRANSFERS:
            raise ValueError(f"transfer={transfer!r} is not one of {', '.join(TRANSFERS)}")
        self.address = address
        self.transfer, self.transfer_host = transfer, transfer_host
        self.stream_interval_ms = stream_interval_ms
        self._token = token
        self._channel = open_channel(address, tls_ca=tls_ca)
        self._stub = gen_grpc.GenerationStub(self._channel)
        self._rpc_timeout_s = rpc_timeout_s
        self._ids = itertools.count()

    def __repr__(self) -> str:
        return f"RemoteGeneration({self.address!r})"

    def close(self) -> None:
        self._channel.close()

    # -- Generation ------------------------------------------------------------------------------
    def submit(self, prompt: Sequence[int], sampling: SamplingParams, *,
               predicted_len: float | None = None, carry: Sequence[Sample] | None = None,
               session: str | Sequence[str] | None = None) -> RemoteStream:
        """Opens the group's Generate stream and returns at once; `predicted_len` (None: the
        server predicts it) orders admission on a server that admits the longest first."""
        request = gen_pb2.GenerateRequest(
            token_ids=gen_pb2.TokenIds(ids=[int(t) for t in prompt]),
            sampling=gen_pb2.SamplingOptions(
                max_tokens=sampling.max_tokens, temperature=sampling.temperature,
                top_k=sampling.top_k, top_p=sampling.top_p, seed=sampling.seed, n=sampling.n,
                stop_token_ids=list(sampling.stop_token_ids),
                ignore_eos=not sampling.stop_at_eos, min_tokens=sampling.min_tokens,
                grammar=sampling.grammar or "",
                bias_token_ids=[t for t, _ in sampling.logit_bias],
                bias_values=[b for _, b in sampling.logit_bias],
                presence_penalty=sampling.presence_penalty,
                frequency_penalty=sampling.frequency_penalty),
            carry=[gen_pb2.CarriedSample(token_ids=s.tokens, logprobs=s.logprobs,
                                         versions=s.versions) for s in carry or ()],
            sessions=[session] if isinstance(session, str) else list(session or ()),
            stream_interval_ms=self.stream_interval_ms, predicted_len=predicted_len or 0.0)
        stream = RemoteStream(next(self._ids), sampling.n)
        stream.call = self._stub.Generate(request)
        threading.Thread(target=self._read, args=(stream,), daemon=True,
                         name=f"generate-{self.address}").start()
        return stream

    @staticmethod
    def _read(stream: RemoteStream) -> None:
        try:
            for r in stream.call:
                if r.finish_reason:
                    routes = (np.frombuffer(r.routes, "<i4").reshape(r.routes_shape).astype(
                        np.int32) if r.routes_shape else None)
                    speculated = Speculated(r.spec_verify_steps, r.spec_draft_tokens,
                                            r.spec_accepted_tokens) \
                        if r.spec_verify_steps else None
                    stream.put(DoneEvent(r.sample_index, r.finish_reason, routes, speculated))
                for token, logprob, version in zip(r.token_ids, r.logprobs, r.versions):
                    stream.put(TokenEvent(r.sample_index, token, logprob, version))
            reason = "lost"        # the call ended with samples still open
        except grpc.RpcError as e:
            code = e.code()
            stream.error = f"{code.name}: {e.details()}"
            reason = ("cancelled" if stream.cancelled else
                      "refused" if code in _REFUSED else "lost")
        stream.end(reason)

    def update_params(self, params, version: int, timeout: float | None = None, *,
                      resume: bool = False, pull_from: tuple[str, int] | None = None,
                      relay_as: int = 0) -> UpdateResult:
        """Sends `params` as weights `version` (`transfer`). With tcp, `pull_from` = (the bulk
        address of a server pulling the same update, the id it relays it under): this server
        pulls from that one, not from this process (`params` only describe the tensors); with
        `relay_as`, it offers what it pulls under that id in turn. Raises StaleVersion (the
        server already has this version or a newer one, and not `resume`), WeightUpdateError
        (refused: shapes, dtypes, token), TimeoutError (the deadline passed: the server keeps
        its old weights) or ConnectionError (the server cannot be reached)."""
        t0 = time.perf_counter()
        metadata = [("authorization", f"Bearer {self._token or ''}")]
        try:
            if self.transfer == "grpc":
                reply = self._stub.UpdateWeights(
                    weight_pieces(params, version, resume=resume), timeout=timeout,
                    metadata=metadata)
            else:
                request = self._offer(params, version, resume, timeout, pull_from, relay_as)
                try:
                    reply = self._stub.PullWeights(request, timeout=timeout, metadata=metadata)
                finally:        # pulled, or failed: a retry makes an offer of its own
                    if self.transfer == "tcp" and pull_from is None:
                        from serving.weights.bulk import BulkServer

                        BulkServer.get(self.transfer_host).withdraw(request.uuid)
        except grpc.RpcError as e:
            code, details = e.code(), e.details()
            where = f"weights version {version} to {self.address}"
            if code == grpc.StatusCode.FAILED_PRECONDITION and "not newer" in (details or ""):
                raise StaleVersion(f"{where}: {details}") from None
            if code in _REFUSED:
                raise WeightUpdateError(f"{where} refused: {details}") from None
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise TimeoutError(f"{where}: not done within {timeout} s") from None
            raise ConnectionError(f"{where}: {code.name}: {details}") from None
        return UpdateResult(reply.version, time.perf_counter() - t0, reply.pause_ms / 1e3)

    def _offer(self, params, version: int, resume: bool, timeout: float | None, pull_from,
               relay_as: int):
        """Offers `params` on this process's transfer or bulk server (or, with `pull_from`,
        names the server that relays them); the request that pulls them."""
        named = {_name(path): x for path, x in jax.tree_util.tree_flatten_with_path(params)[0]}
        tensors = [gen_pb2.TensorSpec(name=n, shape=list(x.shape), dtype=np.dtype(x.dtype).name)
                   for n, x in named.items()]
        request = gen_pb2.PullRequest(version=version, resume=resume, tensors=tensors,
                                      transport=self.transfer, relay_uuid=relay_as)
        if pull_from is not None:
            request.address, request.uuid = pull_from
        elif self.transfer == "tcp":
            from serving.weights.bulk import BulkServer

            bulk = BulkServer.get(self.transfer_host)
            request.address = bulk.address
            request.uuid = bulk.offer([np.asarray(x) for x in named.values()],
                                      deadline_s=timeout or 600.0)[0]
        else:
            from serving.weights.transfer import Endpoint

            endpoint = Endpoint.get(host=self.transfer_host)
            request.address = endpoint.address
            request.uuid = endpoint.offer(named, deadline_s=timeout or 600.0)
        return request

    def metrics(self, timeout: float | None = None) -> dict:
        """The server's counters. Raises ConnectionError if it does not answer within
        `timeout` (default `rpc_timeout_s`)."""
        try:
            reply = self._stub.GetMetrics(gen_pb2.MetricsRequest(),
                                          timeout=timeout or self._rpc_timeout_s)
        except grpc.RpcError as e:
            raise ConnectionError(f"{self.address}: {e.code().name}: {e.details()}") from None
        return json.loads(reply.json)

    def pause(self, timeout: float = 60.0, lease_s: float | None = None) -> None:
        """Pauses the server's engine (partial rollouts; Orchestrator.pause) and returns once it
        is idle. The server resumes by itself after `lease_s` (default 600 s) unless `resume`
        is called first. Raises ConnectionError when it cannot be reached or refuses (token)."""
        self._call("Pause", gen_pb2.PauseRequest(lease_s=lease_s or 600.0), timeout)

    def resume(self) -> None:
        self._call("Resume", gen_pb2.ResumeRequest(), self._rpc_timeout_s)

    def _call(self, rpc: str, request, timeout: float):
        try:
            return getattr(self._stub, rpc)(
                request, timeout=timeout,
                metadata=[("authorization", f"Bearer {self._token or ''}")])
        except grpc.RpcError as e:
            raise ConnectionError(f"{rpc} {self.address}: {e.code().name}: {e.details()}"
                                  ) from None

    def end_session(self, key: str) -> None:
        try:
            self._stub.EndSession(gen_pb2.EndSessionRequest(session=key),
                                  timeout=self._rpc_timeout_s)
        except grpc.RpcError as e:
            raise ConnectionError(f"{self.address}: {e.code().name}: {e.details()}") from None

    @property
    def newest_version(self) -> int:
        return int(self.metrics()["version"])
