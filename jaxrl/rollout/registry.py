"""The trainer's door for an elastic fleet (`rl.generation.join`): a gRPC `Fleet` service
(serving/proto/fleet.proto) where `jaxrl serve --join TRAINER` processes offer themselves and
leave, at any time during a run.

A server that joins is checked first (it answers, and serves the run's model: the same checks
as a listed server's), then added to the fleet as joining: the weight publisher brings it to the
newest weights, after which it takes work. A server that leaves is set aside (its groups in
flight continue on the others) and dropped. Both calls need the servers' update token, which
the trainer holds to push weights anyway; every join and leave is logged.
"""

from __future__ import annotations

import hmac
from concurrent import futures
from typing import Callable

import grpc

from jaxrl.config import ConfigError
from jaxrl.rollout.fleet import Fleet, Member
from jaxrl.rollout.publisher import WeightPublisher
from serving.proto import fleet_pb2 as pb
from serving.proto import fleet_pb2_grpc as pb_grpc


class Registry(pb_grpc.FleetServicer):
    """`admit(address) -> Member` reaches and checks a server (ConnectionError: it does not
    answer; ConfigError: it cannot serve this run)."""

    def __init__(self, fleet: Fleet, publisher: WeightPublisher,
                 admit: Callable[[str], Member], token: str | None, address: str):
        self.fleet, self.publisher, self.admit, self.token = fleet, publisher, admit, token
        self._server = grpc.server(futures.ThreadPoolExecutor(8, thread_name_prefix="registry"))
        pb_grpc.add_FleetServicer_to_server(self, self._server)
        host, _, port = address.rpartition(":")
        bound = self._server.add_insecure_port(f"{host}:{port}")
        if not bound:
            raise ConfigError(f"rl.generation.join={address!r}: cannot listen there")
        self.address = f"{host}:{bound}"
        self._server.start()

    def _authorize(self, context) -> None:
        if self.token is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          "this trainer has no update token (rl.generation.token_file or "
                          "$JAXRL_UPDATE_TOKEN): no server can join it")
        given = dict(context.invocation_metadata()).get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          "joining needs 'authorization: Bearer <token>' metadata with the "
                          "servers' update token")

    def _member(self, address: str) -> Member | None:
        return next((m for m in self.fleet.members if m.name == address), None)

    def Join(self, request, context):
        self._authorize(context)
        address = request.address
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit():
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"address {address!r} is not host:port")
        if self._member(address) is not None:
            return pb.JoinResponse(added=False, members=len(self.fleet.members))
        try:
            member = self.admit(address)
        except ConnectionError as e:     # most often a wrong --advertise: said as a refusal
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"the trainer cannot reach {address} (is --advertise an address "
                          f"the trainer can reach?): {e}")
        except ConfigError as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        added = self.fleet.join(member)
        if added:
            self.publisher.watch(member)
        else:                       # joined twice at once: the other call added it
            member.generation.close()
        return pb.JoinResponse(added=added, members=len(self.fleet.members))

    def Leave(self, request, context):
        self._authorize(context)
        member = self._member(request.address)
        if member is None:
            return pb.LeaveResponse(removed=False)
        # Its connection stays open until the run closes its generation: a group placed on it
        # a moment ago may still be reading from it (and then moves to another member).
        self.fleet.leave(member, "it left the fleet")
        return pb.LeaveResponse(removed=True)

    def close(self) -> None:
        self._server.stop(0)
