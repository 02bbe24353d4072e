"""gRPC's standard health service (`grpc.health.v1.Health`) beside JetStream's HealthCheck, so
Kubernetes' gRPC probes, `grpc_health_probe` and load balancers can ask a `jaxrl serve`
process whether it serves.

The server listens only once its engines have compiled, so a probe that connects finds it
ready; it answers SERVING while the engine loop runs and NOT_SERVING once the loop has failed
or the server is stopping, for the whole server ("") and for each of its services by name.
`Check` reads the engine's state at the call; `Watch` streams each change (once), which a
thread looks for every `poll_s`."""

from __future__ import annotations

import threading
from typing import Callable

from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from serving.core import threads

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Health(health.HealthServicer):
    """The health of `services` (names, besides the server's "") as `serving()` says."""

    def __init__(self, serving: Callable[[], bool], services: list[str], poll_s: float = 1.0):
        super().__init__()
        self._serving, self._names = serving, ["", *services]
        self._stop = threading.Event()
        self._status, self._status_lock = None, threading.Lock()
        self._refresh()
        self._thread = threading.Thread(target=self._poll, args=(poll_s,), daemon=True,
                                        name="health")
        self._thread.start()

    def Check(self, request, context):
        self._refresh()
        return super().Check(request, context)

    def _refresh(self) -> None:
        """Sets every name's status when it changed (a set sends each watcher a message)."""
        status = SERVING if not self._stop.is_set() and self._serving() else NOT_SERVING
        with self._status_lock:
            if status == self._status:
                return
            self._status = status
            for name in self._names:
                self.set(name, status)

    def _poll(self, poll_s: float) -> None:
        while not self._stop.wait(poll_s):
            self._refresh()

    def stop(self) -> None:
        """NOT_SERVING from now on (the server is shutting down), told to every watcher; the
        polling thread has ended when it returns."""
        self._stop.set()
        self._refresh()
        self.enter_graceful_shutdown()
        threads.join(self._thread, 10.0)


def add_to_server(servicer: Health, server) -> None:
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
