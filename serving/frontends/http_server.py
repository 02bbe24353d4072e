"""The HTTP endpoints' server: uvicorn on a socket bound here (port 0: any free one), run from
a thread this module starts and `stop_http` joins."""

from __future__ import annotations

import threading
import time
from typing import Any

from serving.core import threads


def start_http(app: Any, host: str, port: int):
    """Serves `app` with uvicorn from a daemon thread; returns (server, port bound). Stop it
    with `stop_http(server)`."""
    import socket

    import uvicorn

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True,
                              name="openai-http")
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    if not server.started:
        raise RuntimeError(f"the HTTP endpoint did not start on {host}:{port}")
    server.thread = thread
    return server, sock.getsockname()[1]


def stop_http(server, timeout: float = 10.0) -> None:
    """Stops a server `start_http` started and returns once its thread has ended (open
    streams get `timeout_graceful_shutdown`); raises TimeoutError naming the thread if not."""
    server.should_exit = True
    threads.join(server.thread, timeout)
