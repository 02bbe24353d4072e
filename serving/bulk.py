"""Weights over plain TCP: the bulk path of a weight update (`rl.generation.transfer=tcp`).

The trainer puts its weights (host arrays in the wire dtype) on a bulk server of its own under a
random 63-bit id, and calls the generation server's `PullWeights` RPC (transport "tcp") with
that id, the bulk server's address and every tensor's name, shape and dtype. The generation
server checks them exactly as it checks a streamed update (token, version, every tensor once,
shapes, dtypes) before it connects, then reads the tensors' bytes straight into arrays it
allocated for them: `recv_into`, no Python per byte or per piece, the GIL released while the
kernel copies. It swaps them in between two decode steps, as it swaps streamed weights.

A server asked to relay (`relay_uuid`) offers what arrives, as it arrives, under that id on a
bulk server of its own; the next server of a chain pulls from it while it is still receiving.
The trainer then sends each byte once, and pushing to a chain of servers costs about one push
(the fan-out of checkpoint-engine and Marin).

Per connection, the puller sends the offer's id and the bytes it expects (8 bytes each,
little-endian); the offer's server answers one status byte (1: here they come; 0: no such
offer, or another size) and then every tensor's bytes in order. The id is the only secret of
this path, as the jax transfer path's is (serving/transfer.py): it travels over the
authenticated gRPC call, and the bulk port belongs on a trusted network.
"""

from __future__ import annotations

import secrets
import socket
import struct
import sys
import threading
import time

import numpy as np

from serving.weight_stream import WIRE_DTYPES

CHUNK = 8 << 20              # bytes a send or a receive moves at a time at most
_HEADER = struct.Struct("<QQ")
LATE_S = 10.0                # how long a pull waits for a relay's offer to be registered


def _bytes(a: np.ndarray) -> memoryview:
    """The array's memory as bytes (any dtype, bfloat16 included), without a copy."""
    return memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8))


class Offer:
    """Arrays offered for pulls until `deadline` (time.monotonic). A relay's offer fills as
    its own pull receives (`arrived`); a pull of it sends what has arrived and waits for the
    rest."""

    def __init__(self, arrays: list[np.ndarray], deadline: float, *, complete: bool = True):
        """`complete`: the arrays hold their bytes already (the trainer's offer, pulled any
        number of times until its deadline); else a relay's, which fills as its pull receives
        and is sent once (`done` is set then, or when its pull fails)."""
        self.arrays = arrays
        self.single_use = not complete
        self.claimed = threading.Event()
        self.done = threading.Event()
        self.total = sum(a.nbytes for a in arrays)
        self.deadline = deadline
        self._arrived = self.total if complete else 0
        self._failed: str | None = None
        self.sends = 0              # pulls it has been sent to whole
        self._cond = threading.Condition()

    def arrived(self, n: int) -> None:
        """`n` more bytes have arrived (in order)."""
        with self._cond:
            self._arrived += n
            self._cond.notify_all()

    def fail(self, why: str) -> None:
        """The relay's own pull failed: its pullers stop at what they have."""
        with self._cond:
            self._failed = why
            self._cond.notify_all()
        self.done.set()

    def _wait(self, n: int) -> None:
        with self._cond:
            while self._arrived < n:
                if self._failed is not None:
                    raise ConnectionError(f"the relayed pull failed: {self._failed}")
                left = self.deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("the relayed offer did not fill before its deadline")
                self._cond.wait(left)

    def send(self, sock: socket.socket) -> None:
        """Every array's bytes, in order, as they are there. A single-use offer is `claimed`
        from the first byte and `done` when its one send ends, whole or not."""
        sent = 0
        self.claimed.set()
        try:
            for a in self.arrays:
                view = _bytes(a)
                for start in range(0, len(view), CHUNK):
                    piece = view[start: start + CHUNK]
                    self._wait(sent + len(piece))
                    sock.sendall(piece)
                    sent += len(piece)
            with self._cond:
                self.sends += 1
        finally:
            if self.single_use:
                self.done.set()


class BulkServer:
    """This process's bulk server (one per bind host): a listening socket and a thread per
    pull."""

    _lock = threading.Lock()
    _started: dict[str, "BulkServer"] = {}

    def __init__(self, host: str):
        self._listener = socket.create_server((host, 0))
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        self._offers: dict[int, Offer] = {}
        self._cond = threading.Condition()
        threading.Thread(target=self._accept, name=f"bulk-{self.address}", daemon=True).start()

    @classmethod
    def get(cls, host: str = "127.0.0.1") -> "BulkServer":
        with cls._lock:
            if host not in cls._started:
                cls._started[host] = cls(host)
            return cls._started[host]

    def offer(self, arrays: list[np.ndarray], deadline_s: float, *, uuid: int | None = None,
              complete: bool = True) -> tuple[int, Offer]:
        """Offers `arrays` (in order) for pulls within `deadline_s`: (its id, the offer)."""
        uuid = secrets.randbits(63) if uuid is None else uuid
        offer = Offer(arrays, time.monotonic() + deadline_s, complete=complete)
        with self._cond:
            now = time.monotonic()
            self._offers = {k: o for k, o in self._offers.items() if o.deadline > now}
            self._offers[uuid] = offer
            self._cond.notify_all()
        return uuid, offer

    def withdraw(self, uuid: int) -> None:
        with self._cond:
            self._offers.pop(uuid, None)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(sock,), daemon=True,
                             name="bulk-send").start()

    def _find(self, uuid: int) -> Offer | None:
        """The offer `uuid`, waiting a while for one not registered yet (a relay's, whose own
        pull request may arrive after its downstream's)."""
        deadline = time.monotonic() + LATE_S
        with self._cond:
            while uuid not in self._offers and time.monotonic() < deadline:
                self._cond.wait(deadline - time.monotonic())
            return self._offers.get(uuid)

    def _serve(self, sock: socket.socket) -> None:
        with sock:
            try:
                sock.settimeout(LATE_S)
                uuid, size = _HEADER.unpack(_recv_exactly(sock, _HEADER.size))
                offer = self._find(uuid)
                if offer is None or offer.total != size or offer.deadline < time.monotonic():
                    sock.sendall(b"\0")
                    return
                sock.settimeout(max(offer.deadline - time.monotonic(), 1.0))
                sock.sendall(b"\1")
                if offer.single_use:        # one puller: nobody else is sent it
                    self.withdraw(uuid)
                offer.send(sock)
            except (OSError, ConnectionError, TimeoutError):
                return          # the puller sees the connection end short and says so


def relay_offer(server: BulkServer, uuid: int, arrays: list[np.ndarray],
                timeout_s: float | None) -> Offer:
    """Offers `arrays`, which a pull is about to fill, under `uuid` on `server`, once."""
    return server.offer(arrays, 600.0 if timeout_s is None else timeout_s, uuid=uuid,
                        complete=False)[1]


ALIGN = 64                   # bytes: XLA:CPU takes a host array this aligned without a copy


class ReceivePool:
    """The memory tcp pulls receive into: one slab per pull, each tensor a 64-byte-aligned view
    of it, and slabs reused once nothing holds a view of them any more.

    On a CPU device `jax.device_put` takes an aligned numpy array as it is (no copy), so the
    engine serves from the very slab its pull received into: an update then costs one copy of
    the weights (the receive) and no fresh memory, whose first touch costs a page fault per page
    (a 2-core VM here: 0.35 s per 512 MB, most of a pull). A slab is free again when the last
    view of it is gone: the engine has retired those weights and every program that read them
    has finished (jax holds the array until then), a relay has sent them, the pull has
    returned. So at most two slabs live in steady state: the weights served and the ones
    arriving. On an accelerator the device copy is the engine's own, and the slab is free at
    once."""

    def __init__(self, keep: int = 2):
        self._lock = threading.Lock()
        self._slabs: list[np.ndarray] = []
        self._keep = keep

    @staticmethod
    def _layout(specs) -> tuple[list[tuple[int, tuple, np.dtype]], int]:
        """(offset, shape, dtype) of each tensor in a slab, and the slab's size."""
        out, at = [], 0
        for _, shape, dtype in specs:
            dtype = np.dtype(WIRE_DTYPES[dtype])
            out.append((at, tuple(shape), dtype))
            at += -(-int(np.prod(shape, dtype=np.int64)) * dtype.itemsize // ALIGN) * ALIGN
        return out, max(at, ALIGN)

    def _slab(self, size: int) -> np.ndarray:
        """A free slab of `size` bytes (64-byte aligned), reused when one is."""
        with self._lock:
            # A slab's memory is in use while a view of it lives: numpy gives every view the
            # array that owns the memory as its base, so the owner's references count them
            # (beyond this list's tuple, the loop's name and getrefcount's argument).
            for raw, start in self._slabs:
                if sys.getrefcount(raw) <= 3 and raw.nbytes == size + ALIGN:
                    return raw[start: start + size]
            raw = np.empty(size + ALIGN, np.uint8)
            start = (-raw.ctypes.data) % ALIGN
            busy = [(r, at) for r, at in self._slabs if sys.getrefcount(r) > 3]
            self._slabs = (busy + [(raw, start)])[-max(self._keep, len(busy) + 1):]
            return raw[start: start + size]

    def take(self, specs: list[tuple[str, tuple, str]]) -> list[np.ndarray]:
        """Arrays for `specs` (name, shape, wire dtype), views of one slab."""
        layout, size = self._layout(specs)
        slab = self._slab(size)
        return [slab[at: at + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize]
                .view(dtype).reshape(shape) for at, shape, dtype in layout]


def pull(address: str, uuid: int, specs: list[tuple[str, tuple, str]],
         timeout_s: float | None, into: list[np.ndarray] | None = None,
         relay: Offer | None = None) -> dict[str, np.ndarray]:
    """The offer `uuid` of the bulk server at `address`, as {name: array} in `specs`' order
    (name, shape, wire dtype: checked by the caller first), received `into` those arrays
    (default: new ones). `relay`: an offer made over these same arrays (`relay_offer`), told
    of each chunk as it arrives."""
    arrays = into or [np.empty(shape, WIRE_DTYPES[dtype]) for _, shape, dtype in specs]
    total = sum(a.nbytes for a in arrays)
    host, port = address.rsplit(":", 1)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        with socket.create_connection((host, int(port)), timeout=_left(deadline)) as sock:
            sock.sendall(_HEADER.pack(uuid, total))
            if _recv_exactly(sock, 1) != b"\1":
                raise ConnectionError(f"{address} has no offer {uuid} of {total} bytes (expired, "
                                      f"pulled from elsewhere, or of another model)")
            for a in arrays:
                view = _bytes(a)
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
    except BaseException as e:
        if relay is not None:
            relay.fail(str(e))
        if isinstance(e, socket.timeout):
            raise TimeoutError(f"weight pull from {address}: not done in time") from None
        raise
    return {name: a for (name, _, _), a in zip(specs, arrays)}


def _left(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the weight pull's deadline passed")
    return left


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        part = sock.recv(n - len(data))
        if not part:
            raise ConnectionError("the connection ended")
        data += part
    return bytes(data)
