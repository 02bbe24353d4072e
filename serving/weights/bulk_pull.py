"""The puller's side of the bulk path (serving/weights/bulk.py): an offer's bytes received straight
into arrays, over the offer server's Unix socket when it is on this host (tried first), else over
TCP; from a relay on this host whose arrays lie in a memfd slab, that slab itself, mapped
read-only and served from without a copy (serving/weights/slabs.py: `MappedSlab`).
"""

from __future__ import annotations

import os
import socket
import time

import numpy as np

from serving.weights.bulk import (
    CHUNK,
    COUNT,
    FAILED,
    HEADER,
    MAPPED,
    STREAM,
    Offer,
    byte_view,
    local_name,
    recv_exactly,
)
from serving.weights.slabs import MappedSlab, nbytes
from serving.weights.staging import DeviceTensor, Stage
from serving.weights.weight_stream import WIRE_DTYPES


def pull(address: str, uuid: int, specs: list[tuple[str, tuple, str]],
         timeout_s: float | None, receive=None, relay: Offer | None = None, onto=None
         ) -> tuple[dict[str, np.ndarray], bool]:
    """The offer `uuid` of the bulk server at `address`, as {name: array} in `specs`' order
    (name, shape, wire dtype: checked by the caller first), and whether a relay beside this
    server vouched for it (checked every tensor finite; else the caller checks). Bytes that
    come over a socket are received into the arrays `receive()` returns with the slab they are
    views of (default: new arrays, no slab); a slab mapped from a relay on this host is
    returned as it is. `relay`: an offer of these bytes (`relay_offer`), placed over whichever
    it is and told of each chunk as it arrives. `onto`: a device that socket bytes go to
    through a few chunks of host memory instead (serving/weights/staging.py: the arrays returned are
    on it)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        with _connect(address, deadline) as sock:
            sock.sendall(HEADER.pack(uuid, nbytes(specs)))
            status = recv_exactly(sock, 1)
            if status == STREAM and onto is not None:
                arrays = _receive_staged(sock, specs, onto, deadline, relay, address)
                vouched = False
            elif status == STREAM:
                arrays, slab = receive() if receive is not None else (_new(specs), None)
                if relay is not None:
                    relay.place(arrays, slab)
                _receive(sock, arrays, deadline, relay, address)
                vouched = False
            elif status == MAPPED:
                arrays, vouched = _map(sock, specs, deadline, relay, address), True
            else:
                raise ConnectionError(f"{address} has no offer {uuid} of {nbytes(specs)} bytes "
                                      f"(expired, pulled from elsewhere, or of another model)")
    except BaseException as e:
        if relay is not None:
            relay.fail(str(e))
        if isinstance(e, socket.timeout):
            raise TimeoutError(f"weight pull from {address}: not done in time") from None
        raise
    return {name: a for (name, _, _), a in zip(specs, arrays)}, vouched


def _new(specs) -> list[np.ndarray]:
    return [np.empty(shape, WIRE_DTYPES[dtype]) for _, shape, dtype in specs]


def _connect(address: str, deadline: float | None) -> socket.socket:
    """A connection to the bulk server at `address`: its Unix socket if it is on this host,
    else TCP."""
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    except (OSError, AttributeError):
        sock = None
    if sock is not None:
        try:
            sock.settimeout(_left(deadline))
            sock.connect(local_name(address))
            return sock
        except OSError:             # not on this host (or no abstract sockets): TCP
            sock.close()
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=_left(deadline))


def _receive(sock, arrays, deadline, relay, address) -> None:
    """Every array's bytes, in order, straight off the socket."""
    for a in arrays:
        _fill(sock, memoryview(byte_view(a)), deadline, address, "a tensor",
              relay.arrived if relay is not None else None)


def _fill(sock, view: memoryview, deadline, address: str, what: str, arrived=None) -> None:
    """`view` filled straight off the socket, a chunk at a time at most (`arrived(n)` told of
    each); ConnectionError naming `what` if the offer ends first."""
    got = 0
    while got < len(view):
        sock.settimeout(_left(deadline))
        n = sock.recv_into(view[got: got + CHUNK])
        if n == 0:
            raise ConnectionError(f"{address} ended the offer after {got} of {len(view)} "
                                  f"bytes of {what}")
        got += n
        if arrived is not None:
            arrived(n)


def _receive_staged(sock, specs, device, deadline, relay, address) -> list:
    """Every tensor's bytes through a `Stage` onto `device`, relayed from the stage as they
    come."""
    stage = Stage(specs)
    if relay is not None:
        stage.relaying()
        relay.place_stage(stage)
    tensors = [DeviceTensor(shape, dtype, device) for _, shape, dtype in specs]
    give_up = (lambda: relay.fail("no server pulled the relay in time")) if relay else None
    try:
        for k, (i, row, _, _) in enumerate(stage.pieces):
            _fill(sock, memoryview(stage.writable(k, give_up, deadline)), deadline, address,
                  f"a piece of {specs[i][0]}")
            stage.written(k)
            tensors[i].write(stage.slot(k), row)
            stage.done("device", k)
    except BaseException as e:
        stage.fail(str(e))
        raise
    return [t.array for t in tensors]


def _map(sock, specs, deadline, relay, address) -> list[np.ndarray]:
    """A relay's slab, mapped from the descriptor it sends, returned once it says the slab is
    whole and vouches for it (and relayed on meanwhile as it says it fills)."""
    sock.settimeout(_left(deadline))
    message, fds, _, _ = socket.recv_fds(sock, COUNT.size, 1)
    if len(fds) != 1 or len(message) != COUNT.size:
        for fd in fds:
            os.close(fd)
        raise ConnectionError(f"{address} sent no slab to map")
    slab = MappedSlab(fds[0])
    (count,) = COUNT.unpack(message)
    table = recv_exactly(sock, COUNT.size * count) if count else b""
    offsets = [COUNT.unpack_from(table, COUNT.size * i)[0] for i in range(count)]
    if count != len(specs):
        raise ConnectionError(f"{address} offered a slab of {count} tensors, not {len(specs)}")
    try:
        arrays = slab.views(offsets, specs)
    except ValueError as e:
        raise ConnectionError(f"{address} offered a slab of another layout: {e}") from None
    if relay is not None:
        relay.place(arrays, slab)
    got, total = 0, nbytes(specs)
    while got < total:
        sock.settimeout(_left(deadline))
        (told,) = COUNT.unpack(recv_exactly(sock, COUNT.size))
        if told == FAILED:
            raise ConnectionError(f"the relayed pull at {address} failed")
        if not got < told <= total:
            raise ConnectionError(f"{address} said {told} of {total} bytes after {got}")
        if relay is not None:
            relay.arrived(told - got)
        got = told
    if recv_exactly(sock, 1) != STREAM:
        raise ConnectionError(f"the relay at {address} refused the update (its own pull or "
                              f"its check for NaN/Inf failed)")
    sock.sendall(STREAM)
    return arrays


def _left(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the weight pull's deadline passed")
    return left
