"""Weights over plain TCP: the bulk path of a weight update (`rl.generation.transfer=tcp`).

The trainer puts its weights (host arrays in the wire dtype) on a bulk server of its own under a
random 63-bit id, and calls the generation server's `PullWeights` RPC (transport "tcp") with
that id, the bulk server's address and every tensor's name, shape and dtype. The generation
server checks them exactly as it checks a streamed update (token, version, every tensor once,
shapes, dtypes) before it connects, then reads the tensors' bytes straight into arrays it
allocated for them (serving/weights/bulk_pull.py: `recv_into`, no Python per byte or per piece, the
GIL released while the kernel copies). It swaps them in between two decode steps, as it swaps
streamed weights.

A server asked to relay (`relay_uuid`) offers what arrives, as it arrives, under that id on a
bulk server of its own; the next server of a chain pulls from it while it is still receiving.
The trainer then sends each byte once, and pushing to a chain of servers costs about one push
(the fan-out of checkpoint-engine and Marin).

On one host the copies are the cost of a chain (each socket hop through the kernel twice, on
cores the servers share), so a bulk server also listens on a Unix socket named after its
address (Linux's abstract namespace: only processes on this host, in this network namespace,
reach it), which a puller tries first. There a relay whose arrays lie in a memfd slab
(serving/weights/slabs.py) hands the puller the slab's file descriptor instead of the bytes, then
says how far the slab has filled, and the puller serves from the shared mapping itself once it is
whole and the relay has found no NaN or Inf in it (the relay's check stands for the puller's:
the same bytes, which the puller cannot write): every server after the first on a host costs
no copy, no memory and no check of its own. The puller's shared lock on the memfd keeps the
slab from being refilled while it serves from it.

Per connection, the puller sends the offer's id and the bytes it expects (8 bytes each,
little-endian); the offer's server answers one status byte (0: no such offer, or another size;
1: every tensor's bytes follow in order; 2, over the Unix socket only: the slab's descriptor
with the number of tensors, their offsets in it, then counts of the bytes arrived, the last the
whole size or 2^64-1 if the relay's own pull failed; then one byte, 1 once the relay has
checked every tensor finite, 0 if its pull or check failed; after which the puller sends one
byte once it holds the slab). The id is the only secret of this path, as the jax transfer path's
is (serving/weights/transfer.py): it travels over the authenticated gRPC call, and the bulk port
belongs on a trusted network.
"""

from __future__ import annotations

import os
import secrets
import socket
import struct
import threading
import time

import numpy as np

from serving.weights.slabs import Slab

CHUNK = 8 << 20              # bytes a send or a receive moves at a time at most
HEADER = struct.Struct("<QQ")
COUNT = struct.Struct("<Q")
FAILED = 2 ** 64 - 1         # the count a mapped relay sends when its own pull failed
NONE, STREAM, MAPPED = b"\0", b"\1", b"\2"
LATE_S = 10.0                # how long a pull waits for a relay's offer to be registered


def local_name(address: str) -> str:
    """The Unix socket (abstract namespace) of the bulk server at TCP `address`."""
    return "\0jaxrl-bulk-" + address


def byte_view(a: np.ndarray) -> np.ndarray:
    """The array's memory as uint8 (any dtype, bfloat16 included), without a copy."""
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


class Offer:
    """Arrays offered for pulls until `deadline` (time.monotonic). A relay's offer fills as
    its own pull receives (`arrived`); a pull of it sends what has arrived and waits for the
    rest."""

    def __init__(self, arrays: list[np.ndarray] | None, deadline: float, *,
                 slab: Slab | None = None, total: int = 0):
        """`arrays`: bytes there already (the trainer's offer, pulled any number of times
        until its deadline), views of `slab` if given. None: a relay's offer of `total` bytes,
        placed over what its own pull receives into once that pull knows its source (`place`),
        filled as that pull receives, and sent once (`done` is set then, or when its pull
        fails)."""
        self.single_use = arrays is None
        self.total = total if arrays is None else sum(a.nbytes for a in arrays)
        self.arrays: list[np.ndarray] | None = None
        self.slab = None
        self.stage = None           # a relay's pieces, when its pull stages them
        self.placed = threading.Event()
        self.done = threading.Event()
        self.deadline = deadline
        self._arrived = 0 if arrays is None else self.total
        self._needed = float("inf")  # the fewest bytes a waiting send waits for
        self._failed: str | None = None
        self._vouched = False       # its pull ended and found every tensor finite
        self.sends = 0              # pulls it has been sent to whole ...
        self.mapped = 0             # ... of which by a mapping of its slab
        self._cond = threading.Condition()
        if arrays is not None:
            self.place(arrays, slab)

    def place(self, arrays: list[np.ndarray], slab=None) -> None:
        """The arrays the offer's bytes are (or arrive) in: views of `slab`
        (serving/weights/slabs.py: a `Slab`, or a `MappedSlab` of the relay's own source) if given,
        which a puller on this host maps if it has a memfd (`send_mapped`)."""
        self.arrays = arrays
        self.slab = slab if slab is not None and slab.fd is not None else None
        self.placed.set()

    def place_stage(self, stage) -> None:
        """The relay's pull passes its bytes through `stage` (serving/weights/staging.py), which the
        offer sends from, piece by piece, as they come."""
        self.stage = stage
        self.placed.set()

    def arrived(self, n: int) -> None:
        """`n` more bytes have arrived (in order). A waiting send is woken only once what it
        waits for is there: a receive moves ~150 KB at a time, a send a chunk."""
        with self._cond:
            self._arrived += n
            if self._arrived >= self._needed:
                self._needed = float("inf")
                self._cond.notify_all()

    def vouch(self) -> None:
        """The relay's pull has ended and its server found every tensor finite: a puller that
        maps its slab serves the same bytes without checking them again."""
        with self._cond:
            self._vouched = True
            self._cond.notify_all()

    def _verdict(self) -> bool:
        """Whether it is vouched for, once it is or its pull or check has failed."""
        with self._cond:
            while not self._vouched and self._failed is None:
                left = self.deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("the relay's check did not end before its deadline")
                self._cond.wait(left)
            return self._vouched

    def fail(self, why: str) -> None:
        """The relay's own pull failed: its pullers stop at what they have."""
        with self._cond:
            self._failed = why
            self._needed = float("inf")
            self._cond.notify_all()
        self.placed.set()
        self.done.set()

    def _wait(self, n: int) -> None:
        with self._cond:
            while self._arrived < n:
                if self._failed is not None:
                    raise ConnectionError(f"the relayed pull failed: {self._failed}")
                left = self.deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("the relayed offer did not fill before its deadline")
                self._needed = min(self._needed, n)
                self._cond.wait(left)

    def send(self, sock: socket.socket) -> None:
        """Every array's bytes, in order, as they are there. A single-use offer is `done`
        when its one send ends, whole or not."""
        sent = 0
        try:
            if self.stage is not None:
                return self._send_staged(sock)
            if self.arrays is None:             # its pull failed before it was placed
                raise ConnectionError(f"the relayed pull failed: {self._failed}")
            for a in self.arrays:
                view = memoryview(byte_view(a))
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

    def _send_staged(self, sock: socket.socket) -> None:
        """Every piece from the relay's stage as it comes, each slot let go once sent."""
        stage = self.stage
        try:
            for k in range(len(stage.pieces)):
                sock.sendall(stage.read(k, self.deadline))
                stage.done("relay", k)
        except BaseException:
            stage.dropped("relay")
            raise
        with self._cond:
            self.sends += 1

    def _filled(self, past: int) -> int:
        """How many bytes have arrived, once a chunk more than `past` has (or the rest)."""
        self._wait(min(past + CHUNK, self.total))
        with self._cond:
            return self._arrived

    def send_mapped(self, sock: socket.socket) -> None:
        """The slab's descriptor, the arrays' offsets in it, how far it has filled until it is
        whole, then whether the relay vouches for it (`vouch`); `done` once the puller says it
        holds the slab (its mapping, and the lock that keeps the slab's owner from refilling
        it: serving/weights/slabs.py)."""
        try:
            # A read-only descriptor of the same memory, sealed against any writer but our own
            # mapping (serving/weights/slabs.py): the puller cannot write into the weights this
            # server serves from.
            readonly = os.open(f"/proc/self/fd/{self.slab.fd}", os.O_RDONLY | os.O_CLOEXEC)
            try:
                socket.send_fds(sock, [COUNT.pack(len(self.arrays))], [readonly])
            finally:
                os.close(readonly)
            base = self.slab.array.ctypes.data
            sock.sendall(b"".join(COUNT.pack(a.ctypes.data - base) for a in self.arrays))
            told = 0
            while told < self.total:
                try:
                    told = self._filled(told)
                except ConnectionError:
                    sock.sendall(COUNT.pack(FAILED))
                    raise
                sock.sendall(COUNT.pack(told))
            if not self._verdict():
                sock.sendall(NONE)
                raise ConnectionError(f"the relayed update was refused: {self._failed}")
            sock.sendall(STREAM)
            if recv_exactly(sock, 1) != STREAM:
                raise ConnectionError("the puller did not confirm its mapping")
            with self._cond:
                self.sends += 1
                self.mapped += 1
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
        self.stats = {"bulk_sends": 0, "bulk_mapped_sends": 0}   # offers sent whole, by kind
        threading.Thread(target=self._accept, args=(self._listener, False), daemon=True,
                         name=f"bulk-{self.address}").start()
        try:
            local = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            local.bind(local_name(self.address))
            local.listen()
        except (OSError, AttributeError):     # no abstract Unix sockets here: TCP alone
            return
        threading.Thread(target=self._accept, args=(local, True), daemon=True,
                         name=f"bulk-local-{self.address}").start()

    @classmethod
    def get(cls, host: str = "127.0.0.1") -> "BulkServer":
        with cls._lock:
            if host not in cls._started:
                cls._started[host] = cls(host)
            return cls._started[host]

    def offer(self, arrays: list[np.ndarray], deadline_s: float, *,
              slab: Slab | None = None) -> tuple[int, Offer]:
        """Offers `arrays` (in order; views of `slab` if given) for pulls within `deadline_s`:
        (its id, the offer)."""
        uuid = secrets.randbits(63)
        return uuid, self.add(uuid, Offer(arrays, time.monotonic() + deadline_s, slab=slab))

    def add(self, uuid: int, offer: Offer) -> Offer:
        """Offers `offer` under `uuid` (expired offers are dropped)."""
        with self._cond:
            now = time.monotonic()
            self._offers = {k: o for k, o in self._offers.items() if o.deadline > now}
            self._offers[uuid] = offer
            self._cond.notify_all()
        return offer

    def withdraw(self, uuid: int) -> None:
        with self._cond:
            self._offers.pop(uuid, None)

    def _accept(self, listener: socket.socket, local: bool) -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(sock, local), daemon=True,
                             name="bulk-send").start()

    def _find(self, uuid: int) -> Offer | None:
        """The offer `uuid`, waiting a while for one not registered yet (a relay's, whose own
        pull request may arrive after its downstream's)."""
        deadline = time.monotonic() + LATE_S
        with self._cond:
            while uuid not in self._offers and time.monotonic() < deadline:
                self._cond.wait(deadline - time.monotonic())
            return self._offers.get(uuid)

    def _serve(self, sock: socket.socket, local: bool) -> None:
        """One pull: the offer's bytes, or over the Unix socket a relay's slab to map."""
        with sock:
            try:
                sock.settimeout(LATE_S)
                uuid, size = HEADER.unpack(recv_exactly(sock, HEADER.size))
                offer = self._find(uuid)
                if offer is None or offer.total != size or offer.deadline < time.monotonic():
                    sock.sendall(NONE)
                    return
                sock.settimeout(max(offer.deadline - time.monotonic(), 1.0))
                # A relay's arrays are known once its own pull has heard from its source.
                offer.placed.wait(max(offer.deadline - time.monotonic(), 0.0))
                mapped = local and offer.slab is not None and offer.single_use
                sock.sendall(MAPPED if mapped else STREAM)
                if offer.single_use:        # one puller: nobody else is sent it
                    self.withdraw(uuid)
                offer.send_mapped(sock) if mapped else offer.send(sock)
                with self._cond:
                    self.stats["bulk_sends"] += 1
                    self.stats["bulk_mapped_sends"] += mapped
            except (OSError, ConnectionError, TimeoutError):
                return          # the puller sees the connection end short and says so


def relay_offer(server: BulkServer, uuid: int, total: int, timeout_s: float | None) -> Offer:
    """Offers the `total` bytes a pull is about to receive under `uuid` on `server`, once (the
    pull places the offer over its arrays: serving/weights/bulk_pull.py)."""
    deadline = time.monotonic() + (600.0 if timeout_s is None else timeout_s)
    return server.add(uuid, Offer(None, deadline, total=total))


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        part = sock.recv(n - len(data))
        if not part:
            raise ConnectionError("the connection ended")
        data += part
    return bytes(data)
