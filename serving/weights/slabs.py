"""Host memory that tcp weight pulls receive into (serving/weights/bulk.py): one slab per pull, each
tensor a 64-byte-aligned view of it, reused once nothing holds a view any more.

On a CPU device `jax.device_put` takes an aligned numpy array as it is (no copy), so the
engine serves from the very slab its pull received into: an update then costs one copy of the
weights (the receive) and no fresh memory, whose first touch costs a page fault per page (a
2-core VM here: 0.35 s per 512 MB, most of a pull). A slab is free again when the last view of
it is gone: the engine has retired those weights and every program that read them has finished
(jax holds the array until then), a relay has sent them, the pull has returned. So at most two
slabs live in steady state: the weights served and the ones arriving. On an accelerator the
device copy is the engine's own, and the slab is free at once.

A slab lives in a memfd where the OS has them (Linux): another server on this host that is
handed its file descriptor (over a Unix socket) maps the same memory read-only and serves from
it (`MappedSlab`), which is how a relay passes weights to the servers beside it without a copy.
A mapping holds a shared lock (flock) on the memfd for as long as any view of it lives, in
whichever process, and a slab is not reused while one is held; the kernel drops the locks of a
process that dies.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import sys
import threading
import weakref

import numpy as np

from serving.weights.weight_stream import WIRE_DTYPES

ALIGN = 64                   # bytes: XLA:CPU takes a host array this aligned without a copy


def nbytes(specs) -> int:
    """The bytes of the tensors of `specs` (name, shape, wire dtype), back to back."""
    return sum(int(np.prod(shape, dtype=np.int64)) * np.dtype(WIRE_DTYPES[dtype]).itemsize
               for _, shape, dtype in specs)


def layout(specs) -> tuple[list[tuple[int, tuple, np.dtype]], int]:
    """(offset, shape, dtype) of each tensor of `specs` (name, shape, wire dtype) in a slab, and
    the slab's size: the tensors in order, each at a 64-byte-aligned offset."""
    out, at = [], 0
    for _, shape, dtype in specs:
        dtype = np.dtype(WIRE_DTYPES[dtype])
        out.append((at, tuple(shape), dtype))
        at += -(-int(np.prod(shape, dtype=np.int64)) * dtype.itemsize // ALIGN) * ALIGN
    return out, max(at, ALIGN)


F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)    # Linux 5.1


def _seal(fd: int) -> None:
    """From now on only the mapping made already writes the memfd: no process handed it (even
    one reopening it through /proc) can map it writable, write or resize it. Where the kernel
    lacks the seal, the read-only descriptors a relay hands out are the guard."""
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                    fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | F_SEAL_FUTURE_WRITE)
    except OSError:
        pass


class Slab:
    """`size` bytes of page-aligned host memory (`array`, uint8), in a memfd (`fd`) where the
    OS has them, else anonymous (`fd` None)."""

    def __init__(self, size: int):
        self.size = size
        self.fd = None
        if hasattr(os, "memfd_create"):
            try:
                self.fd = os.memfd_create("jaxrl-weights", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
                os.ftruncate(self.fd, size)
                self.array = np.frombuffer(mmap.mmap(self.fd, size), np.uint8)
                weakref.finalize(self, os.close, self.fd)
                _seal(self.fd)
                return
            except OSError:         # no memfds here (a sandbox): anonymous memory
                if self.fd is not None:
                    os.close(self.fd)
                self.fd = None
        raw = np.empty(size + ALIGN, np.uint8)
        start = (-raw.ctypes.data) % ALIGN
        self.array = raw[start: start + size]

    def views(self, specs) -> list[np.ndarray]:
        """The arrays of `specs` in this slab (`layout`)."""
        places, _ = layout(specs)
        return [self.array[at: at + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize]
                .view(dtype).reshape(shape) for at, shape, dtype in places]

    def in_use(self) -> bool:
        """Whether a view of it lives here or a mapping of it elsewhere. Here: numpy gives
        every view the array it was cut from as its base (`array`, or what `array` was cut
        from), whose references then count them: beyond ours (`array` itself, or its base
        attribute), `owner` here and getrefcount's argument. Elsewhere: a `MappedSlab`'s shared
        lock on the memfd, which an exclusive one tried without waiting runs into."""
        owner = self.array if self.fd is not None else self.array.base
        if sys.getrefcount(owner) > 3:
            return True
        if self.fd is None:
            return False
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        return False


class MappedSlab:
    """Another server's slab on this host, mapped read-only from the descriptor `fd` it sent
    (taken over: closed when this is dropped). The mapping holds a shared lock on the memfd
    until the mapping itself goes, with the last view of it (Python's mmap keeps a duplicate of
    the descriptor, and the lock belongs to both), so the slab's owner does not refill memory
    this server still serves from."""

    def __init__(self, fd: int):
        self.fd = fd
        weakref.finalize(self, os.close, fd)
        fcntl.flock(fd, fcntl.LOCK_SH)        # waits out at most an owner's in_use() test
        self.array = np.frombuffer(mmap.mmap(fd, 0, prot=mmap.PROT_READ), np.uint8)
        self.size = self.array.size

    def views(self, offsets: list[int], specs) -> list[np.ndarray]:
        """The arrays of `specs` at `offsets` in the slab; ValueError if one does not fit or
        is not aligned as a slab's are."""
        out = []
        for at, (_, shape, dtype) in zip(offsets, specs):
            dtype = np.dtype(WIRE_DTYPES[dtype])
            size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            if at % ALIGN or at + size > self.size:
                raise ValueError(f"a tensor of {size} bytes at offset {at} of a "
                                 f"{self.size}-byte slab")
            out.append(self.array[at: at + size].view(dtype).reshape(shape))
        return out


class ReceivePool:
    """Slabs for pulls, reused once free (`Slab.in_use`): `keep` of them kept, and every one in
    use."""

    _lock_shared = threading.Lock()
    _shared: "ReceivePool | None" = None

    def __init__(self, keep: int = 2):
        self._lock = threading.Lock()
        self._slabs: list[Slab] = []
        self._keep = keep

    @classmethod
    def shared(cls) -> "ReceivePool":
        """This process's pool, which every server in it pulls into. Which server of a relay
        chain receives from a socket (and which map its slab) changes from update to update,
        and a slab of fresh memory costs a page fault per page on its first fill; one pool
        lets whichever it is refill the slabs already made."""
        with cls._lock_shared:
            if cls._shared is None:
                cls._shared = cls()
            return cls._shared

    def take(self, specs: list[tuple[str, tuple, str]]) -> tuple[list[np.ndarray], Slab]:
        """Arrays for `specs` (name, shape, wire dtype), views of one free slab, and the slab."""
        _, size = layout(specs)
        with self._lock:
            for slab in self._slabs:
                if slab.size == size and not slab.in_use():
                    return slab.views(specs), slab
            slab = Slab(size)
            busy = [s for s in self._slabs if s.in_use()]
            self._slabs = (busy + [slab])[-max(self._keep, len(busy) + 1):]
        return slab.views(specs), slab
