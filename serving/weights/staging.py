"""A tcp weight pull onto an accelerator through a few chunks of host memory (serving/weights/bulk.py).

On a CPU device the engine serves straight from the host slab a pull receives into
(serving/weights/slabs.py). On a GPU or TPU the weights live in device memory, and a slab the size
of the model would be host memory held for nothing but the copy. Instead the bytes pass through a
`Stage`: `slots` buffers of `chunk` bytes, each holding one piece of one tensor, a block of its
rows (along its first axis) of at most `chunk` bytes, or one row where a row is larger. A
piece is received into a free slot, written into the tensor's place on the device
(`DeviceTensor`: the tensor is allocated there whole, in its dtype, and each block written in
place), and, when this server relays the update, sent on to the next server from the same
slot; the slot is free again once both are done. A server's host memory for a pull is then
`slots * chunk`, whatever the model's size.

The relay is the one consumer that can hold the pull back (its downstream reads slower than
this server receives). A relay that no server has begun to pull `RELAY_GRACE_S` after the
stage filled up is given up (`Offer.fail`): the pull goes on, and the server that would have
pulled from it is pushed from the trainer instead (jaxrl/rollout/publisher.py).
"""

from __future__ import annotations

import functools
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from serving.weights.weight_stream import WIRE_DTYPES

CHUNK = 32 << 20            # bytes of a piece at most
SLOTS = 4
RELAY_GRACE_S = 5.0         # how long a full stage waits for a relay nobody pulls yet


def pieces(specs, chunk: int) -> list[tuple[int, int, int, int]]:
    """(tensor index, first row, rows, bytes) of every piece of `specs` (name, shape, wire
    dtype), in the order the bytes come: each tensor cut into blocks of rows of at most `chunk`
    bytes (one row if a row is larger). A 0-d tensor is one piece of one row."""
    out = []
    for i, (_, shape, dtype) in enumerate(specs):
        rows = shape[0] if shape else 1
        row = int(np.prod(shape[1:], dtype=np.int64)) * np.dtype(WIRE_DTYPES[dtype]).itemsize
        if row == 0:
            continue
        block = max(1, chunk // row)
        out.extend((i, r, min(block, rows - r), min(block, rows - r) * row)
                   for r in range(0, rows, block))
    return out


class Stage:
    """`slots` host buffers of `chunk` bytes that the pieces of one pull pass through in turn
    (piece k in slot k % slots). Piece k may be written once every consumer is done with piece
    k - slots; `relaying`: a relay reads the pieces too, besides the device copy."""

    def __init__(self, specs, *, chunk: int | None = None, slots: int | None = None):
        chunk, slots = chunk or CHUNK, slots or SLOTS
        self.pieces = pieces(specs, chunk)
        size = max([n for *_, n in self.pieces], default=0)
        self._slots = [np.empty(size, np.uint8) for _ in range(min(slots, len(self.pieces)))]
        self._cond = threading.Condition()
        self._written = 0                       # pieces received
        self._done: dict[str, int] = {"device": 0}   # pieces each consumer is done with
        self._relay_started = False
        self._failed: str | None = None

    def slot(self, k: int) -> np.ndarray:
        """The bytes of piece k (its slot, cut to its length)."""
        return self._slots[k % len(self._slots)][: self.pieces[k][3]]

    def relaying(self) -> None:
        """A relay reads every piece too (`read`, `done`)."""
        with self._cond:
            self._done["relay"] = 0

    def writable(self, k: int, give_up, deadline: float | None) -> np.ndarray:
        """Piece k's slot once every consumer is done with the piece before it there. A relay
        that nobody has begun to pull `RELAY_GRACE_S` after it began holding this back is
        dropped (`give_up()` is called); TimeoutError past `deadline` (time.monotonic)."""
        held = None
        with self._cond:
            while min(self._done.values()) <= k - len(self._slots):
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError("the relay's downstream held the pull back past its "
                                       "deadline")
                if "relay" in self._done and not self._relay_started:
                    held = held or time.monotonic()
                    if time.monotonic() - held >= RELAY_GRACE_S:
                        del self._done["relay"]
                        give_up()
                        continue
                self._cond.wait(0.1)
        return self.slot(k)

    def written(self, k: int) -> None:
        with self._cond:
            self._written = k + 1
            self._cond.notify_all()

    def fail(self, why: str) -> None:
        with self._cond:
            self._failed = why
            self._cond.notify_all()

    def read(self, k: int, deadline: float) -> np.ndarray:
        """Piece k's bytes once received (for the relay)."""
        with self._cond:
            self._relay_started = True
            if "relay" not in self._done:        # given up: its slots are someone else's
                raise ConnectionError("the relay was given up: nobody pulled it in time")
            while self._written <= k:
                if self._failed is not None:
                    raise ConnectionError(f"the relayed pull failed: {self._failed}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("the relayed pull did not go on before its deadline")
                self._cond.wait(left)
        return self.slot(k)

    def done(self, consumer: str, k: int) -> None:
        """`consumer` is done with piece k ("device", or "relay"); a relay that fails is
        `dropped`."""
        with self._cond:
            if consumer in self._done:
                self._done[consumer] = k + 1
            self._cond.notify_all()

    def dropped(self, consumer: str) -> None:
        with self._cond:
            self._done.pop(consumer, None)
            self._cond.notify_all()


class DeviceTensor:
    """One tensor on `device`, allocated whole in its shape and dtype, its blocks of rows
    written into it in place as they come."""

    def __init__(self, shape, dtype: str, device):
        self.shape, self.dtype = tuple(shape), np.dtype(WIRE_DTYPES[dtype])
        self._device = device
        self.array = jnp.zeros(self.shape, self.dtype, device=device)

    def write(self, piece: np.ndarray, row: int) -> None:
        """Copies `piece` (host bytes: whole rows) to rows `row`..., returning once the host
        bytes have been read (the slot they lie in may be refilled then)."""
        block = piece.view(self.dtype).reshape((-1, *self.shape[1:]) if self.shape else ())
        block = jax.device_put(block, self._device)
        self.array = _write(self.array, block, row) if self.shape else block + 0
        self.array.block_until_ready()


@functools.partial(jax.jit, donate_argnums=0)
def _write(array, block, row):
    return jax.lax.dynamic_update_slice(array, block, (row,) + (0,) * (array.ndim - 1))
