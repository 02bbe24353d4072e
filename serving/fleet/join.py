"""A generation server offering itself to a trainer's fleet (`jaxrl serve --join TRAINER`):
it calls the trainer's `Fleet.Join` (serving/proto/fleet.proto) with the address the trainer
reaches it at, and again every `every_s` seconds (a no-op while it is a member), so that it
joins once the trainer is up, and joins again a trainer that restarted. When the server stops
it calls `Leave`, and its groups in flight continue on the other members.

Each outcome is logged when it changes: joined, not reachable yet, or refused (a wrong token,
another model), which is repeated at a slower pace in case the trainer's side is mended.
"""

from __future__ import annotations

import logging
import threading

import grpc

from serving.fleet.client import open_channel
from serving.proto import fleet_pb2 as pb
from serving.proto import fleet_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

_REFUSED = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.FAILED_PRECONDITION,
            grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED)


class Joiner:
    def __init__(self, trainer: str, advertise: str, token: str | None, *,
                 every_s: float = 5.0, tls_ca: bytes | None = None):
        self.trainer, self.advertise, self.every_s = trainer, advertise, every_s
        self._metadata = [("authorization", f"Bearer {token or ''}")]
        self._channel = open_channel(trainer, tls_ca=tls_ca)
        self._stub = pb_grpc.FleetStub(self._channel)
        self._stop = threading.Event()
        self.joined = threading.Event()        # set once the trainer has it as a member
        self.last: str | None = None           # the last outcome, as logged
        self._thread = threading.Thread(target=self._run, name="fleet-join", daemon=True)

    def start(self) -> "Joiner":
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            wait = self.every_s
            try:
                reply = self._stub.Join(pb.JoinRequest(address=self.advertise),
                                        timeout=max(self.every_s, 5.0), metadata=self._metadata)
                self._say(f"a member of {self.trainer}'s fleet ({reply.members} members)")
                self.joined.set()
            except grpc.RpcError as e:
                self.joined.clear()
                refused = e.code() in _REFUSED
                self._say(f"{'refused by' if refused else 'cannot reach'} {self.trainer}: "
                          f"{e.code().name}: {e.details()}")
                wait = 6 * self.every_s if refused else self.every_s
            self._stop.wait(wait)

    def _say(self, outcome: str) -> None:
        if outcome != self.last:
            self.last = outcome
            log.info("fleet: %s", outcome)

    def stop(self, leave: bool = True) -> None:
        """Stops joining; with `leave`, tells the trainer this server is going."""
        self._stop.set()
        self._thread.join(30)
        if leave:
            try:
                self._stub.Leave(pb.LeaveRequest(address=self.advertise), timeout=5.0,
                                 metadata=self._metadata)
            except grpc.RpcError as e:
                log.info("fleet: could not tell %s this server is leaving (%s)", self.trainer,
                         e.code().name)
        self._channel.close()
