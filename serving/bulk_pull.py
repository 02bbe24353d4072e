"""The puller's side of the bulk path (serving/bulk.py): an offer's bytes received straight into
arrays, over the offer server's Unix socket when it is on this host (tried first), else over
TCP; from a relay on this host whose arrays lie in a memfd slab, copied out of the shared
mapping as it fills.
"""

from __future__ import annotations

import mmap
import os
import socket
import time

import numpy as np

from serving.bulk import (CHUNK, COUNT, FAILED, HEADER, MAPPED, STREAM, Offer, byte_view,
                          local_name, recv_exactly)
from serving.weight_stream import WIRE_DTYPES


def pull(address: str, uuid: int, specs: list[tuple[str, tuple, str]],
         timeout_s: float | None, into: list[np.ndarray] | None = None,
         relay: Offer | None = None) -> dict[str, np.ndarray]:
    """The offer `uuid` of the bulk server at `address`, as {name: array} in `specs`' order
    (name, shape, wire dtype: checked by the caller first), received `into` those arrays
    (default: new ones). `relay`: an offer made over these same arrays (`relay_offer`), told
    of each chunk as it arrives."""
    arrays = into or [np.empty(shape, WIRE_DTYPES[dtype]) for _, shape, dtype in specs]
    total = sum(a.nbytes for a in arrays)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        with _connect(address, deadline) as sock:
            sock.sendall(HEADER.pack(uuid, total))
            status = recv_exactly(sock, 1)
            if status == STREAM:
                _receive(sock, arrays, deadline, relay, address)
            elif status == MAPPED:
                _copy_mapped(sock, arrays, deadline, relay, address)
            else:
                raise ConnectionError(f"{address} has no offer {uuid} of {total} bytes (expired, "
                                      f"pulled from elsewhere, or of another model)")
    except BaseException as e:
        if relay is not None:
            relay.fail(str(e))
        if isinstance(e, socket.timeout):
            raise TimeoutError(f"weight pull from {address}: not done in time") from None
        raise
    return {name: a for (name, _, _), a in zip(specs, arrays)}


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
        view = memoryview(byte_view(a))
        got = 0
        while got < len(view):
            sock.settimeout(_left(deadline))
            n = sock.recv_into(view[got: got + CHUNK])
            if n == 0:
                raise ConnectionError(f"{address} ended the offer after "
                                      f"{got} of {len(view)} bytes of a tensor")
            got += n
            if relay is not None:
                relay.arrived(n)


def _copy_mapped(sock, arrays, deadline, relay, address) -> None:
    """A relay's slab mapped from the descriptor it sends, copied out as it says it fills."""
    sock.settimeout(_left(deadline))
    message, fds, _, _ = socket.recv_fds(sock, COUNT.size, 1)
    if len(fds) != 1 or len(message) != COUNT.size:
        for fd in fds:
            os.close(fd)
        raise ConnectionError(f"{address} sent no slab to map")
    # Unmapped once the last array over it is gone (an error's traceback may hold one).
    mapping = mmap.mmap(fds[0], 0, prot=mmap.PROT_READ)
    os.close(fds[0])
    (count,) = COUNT.unpack(message)
    table = recv_exactly(sock, COUNT.size * count) if count else b""
    offsets = [COUNT.unpack_from(table, COUNT.size * i)[0] for i in range(count)]
    targets = [byte_view(a) for a in arrays]
    if count != len(arrays) or any(o + t.size > len(mapping) for o, t in zip(offsets, targets)):
        raise ConnectionError(f"{address} offered a slab of another layout")
    source = np.frombuffer(mapping, np.uint8)
    starts = np.cumsum([0] + [t.size for t in targets]).tolist()
    got, total = 0, starts[-1]
    while got < total:
        sock.settimeout(_left(deadline))
        (told,) = COUNT.unpack(recv_exactly(sock, COUNT.size))
        if told == FAILED:
            raise ConnectionError(f"the relayed pull at {address} failed")
        if not got < told <= total:
            raise ConnectionError(f"{address} said {told} of {total} bytes after {got}")
        for target, start, offset in zip(targets, starts, offsets):
            lo, hi = max(got, start), min(told, start + target.size)
            if lo < hi:
                target[lo - start: hi - start] = source[offset + lo - start: offset + hi - start]
        if relay is not None:
            relay.arrived(told - got)
        got = told
    sock.sendall(STREAM)


def _left(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the weight pull's deadline passed")
    return left
