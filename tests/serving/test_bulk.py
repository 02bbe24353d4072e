"""The bulk path of weight updates (serving/bulk.py, bulk_pull.py) on its own, over TCP and over
the Unix socket a puller on the same host uses: bytes that arrive equal what was offered, in
every wire dtype; a wrong id or size is refused before any byte moves; a relay passes on what
it receives while it receives (on one host by handing over its memfd slab, copied out as it
fills), and a relay whose own pull stops short stops its puller short too (a ConnectionError,
never a partial array handed on). The receive pool hands out aligned views of a slab and
reuses a slab only once nothing holds a view of it, jax arrays that alias it included."""

import gc
import os
import socket
import threading

import jax
import ml_dtypes
import numpy as np
import pytest

from serving import bulk as bulk_module
from serving import bulk_pull
from serving.bulk import BulkServer, relay_offer
from serving.bulk_pull import pull
from serving.slabs import ALIGN, ReceivePool
from tests.serving.common import until


@pytest.fixture(params=["local", "tcp"])
def path(request, monkeypatch):
    """Each test over the Unix socket (this host) and over TCP (the socket's name made one
    nobody listens on, as for a server on another host)."""
    if request.param == "tcp":
        monkeypatch.setattr(bulk_pull, "local_name", lambda address: "\0jaxrl-nobody-here")
    return request.param


def _arrays():
    rng = np.random.default_rng(0)
    return {"a/w": rng.standard_normal((64, 300)).astype(np.float32),
            "a/b": rng.standard_normal((7,)).astype(ml_dtypes.bfloat16),
            "q": rng.integers(-128, 127, (33, 5)).astype(np.int8),
            "empty": np.zeros((0, 4), np.float32)}


def _specs(arrays):
    return [(n, a.shape, np.dtype(a.dtype).name) for n, a in arrays.items()]


@pytest.fixture(scope="module")
def bulk():
    return BulkServer("127.0.0.1")


def test_what_arrives_is_what_was_offered(bulk, path):
    arrays = _arrays()
    uuid, offer = bulk.offer(list(arrays.values()), 30)
    for _ in range(2):                      # an offer serves every pull until its deadline
        got = pull(bulk.address, uuid, _specs(arrays), 30)
        assert list(got) == list(arrays)
        for name, a in arrays.items():
            assert got[name].dtype == a.dtype and np.array_equal(got[name], a)
    until(lambda: offer.sends == 2, what="both sends counted")   # the sender counts after


def test_a_wrong_id_or_size_is_refused_before_any_byte_moves(bulk, path, monkeypatch):
    monkeypatch.setattr(bulk_module, "LATE_S", 0.5)     # an unknown id: waited for this long
    arrays = _arrays()
    uuid, offer = bulk.offer(list(arrays.values()), 30)
    with pytest.raises(ConnectionError, match="has no offer"):
        pull(bulk.address, uuid + 1, _specs(arrays), 30)
    bigger = _specs(arrays)
    bigger[0] = ("a/w", (64, 301), "float32")
    with pytest.raises(ConnectionError, match="has no offer"):
        pull(bulk.address, uuid, bigger, 30)
    assert offer.sends == 0


def test_a_relay_passes_on_what_it_receives(bulk, path, monkeypatch):
    arrays = _arrays()
    relay = BulkServer("127.0.0.1")             # the first server's own bulk server
    uuid, _ = bulk.offer(list(arrays.values()), 30)
    relay_id = 12345
    second = {}
    # The second server asks first: its source's relay offer does not exist yet (the late
    # registration is waited for).
    downstream = threading.Thread(target=lambda: second.update(
        pull(relay.address, relay_id, _specs(arrays), 30)))
    downstream.start()
    into, slab = ReceivePool().take(_specs(arrays))
    offer = relay_offer(relay, relay_id, into, 30, slab)
    first = pull(bulk.address, uuid, _specs(arrays), 30, into, offer)
    downstream.join(30)
    for name, a in arrays.items():
        assert np.array_equal(first[name], a) and np.array_equal(second[name], a)
    assert offer.done.wait(30) and offer.sends == 1
    # On this host the relay's slab was mapped, not sent through a socket.
    assert offer.mapped == (1 if path == "local" and slab.fd is not None else 0)
    monkeypatch.setattr(bulk_module, "LATE_S", 0.2)
    with pytest.raises(ConnectionError, match="has no offer"):     # a relay is sent once
        pull(relay.address, relay_id, _specs(arrays), 30)


def test_a_relay_cut_short_cuts_its_puller_short(bulk, path):
    arrays = _arrays()
    specs = _specs(arrays)
    total = sum(a.nbytes for a in arrays.values())
    listener = socket.create_server(("127.0.0.1", 0))

    def half_then_gone():                       # a source that dies half-way
        sock, _ = listener.accept()
        with sock:
            sock.recv(16)
            sock.sendall(b"\1" + bytes(total // 2))

    threading.Thread(target=half_then_gone, daemon=True).start()
    relay = BulkServer("127.0.0.1")
    errors = []

    def downstream():
        try:
            pull(relay.address, 777, specs, 30)
        except ConnectionError as e:
            errors.append(str(e))

    thread = threading.Thread(target=downstream)
    thread.start()
    into, slab = ReceivePool().take(specs)
    offer = relay_offer(relay, 777, into, 30, slab)
    with pytest.raises(ConnectionError, match="ended the offer"):
        pull(f"127.0.0.1:{listener.getsockname()[1]}", 1, specs, 30, offer.arrays, offer)
    thread.join(30)
    # Streamed: the bytes stop short; mapped: the relay says its pull failed.
    assert errors and ("ended the offer" in errors[0] or "relayed pull" in errors[0]), errors
    assert offer.done.wait(30)
    listener.close()


@pytest.mark.parametrize("memfd", [True, False], ids=["memfd", "anonymous"])
def test_the_receive_pool_reuses_a_slab_only_once_nothing_holds_it(memfd, monkeypatch):
    if not memfd:                   # a host without memfds: anonymous memory, same rules
        monkeypatch.delattr("os.memfd_create", raising=False)
    arrays = _arrays()
    specs = _specs(arrays)
    pool = ReceivePool()
    first, made = pool.take(specs)
    assert (made.fd is not None) == (memfd and hasattr(os, "memfd_create"))
    del made
    assert [(a.shape, a.dtype) for a in first] == [(a.shape, a.dtype) for a in arrays.values()]
    held = [a for a in first if a.size]
    assert all(a.ctypes.data % ALIGN == 0 for a in held)
    for a, b in zip(held, held[1:]):            # disjoint, in order
        assert a.ctypes.data + a.nbytes <= b.ctypes.data
    slab = id(first[0].base)        # its id: a reference here would keep it in use
    # The engine's weights made from the arrays (on a CPU device, the same memory): while they
    # live the slab is not handed out again, whatever else let go of it.
    served = [jax.device_put(a) for a in first]
    first[0][0, 0] = 7.0
    assert float(served[0][0, 0]) == 7.0        # aliased: no copy was made
    del first, held, a, b
    second, _ = pool.take(specs)
    assert id(second[0].base) != slab
    del served, second
    gc.collect()
    third, _ = pool.take(specs)
    assert id(third[0].base) == slab            # free again: reused, no fresh pages
    assert len(pool._slabs) == 2


def test_a_mapped_relay_hands_over_a_descriptor_that_cannot_write(bulk):
    """The slab a relay maps out is the weights its own server serves from: the descriptor the
    puller gets is read-only."""
    import mmap

    arrays = _arrays()
    into, slab = ReceivePool().take(_specs(arrays))
    assert slab.fd is not None      # Linux: slabs are memfds
    relay = BulkServer("127.0.0.1")
    offer = relay_offer(relay, 4242, into, 30, slab)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(bulk_module.local_name(relay.address))
    sock.sendall(bulk_module.HEADER.pack(4242, offer.total))
    assert bulk_module.recv_exactly(sock, 1) == bulk_module.MAPPED
    _, fds, _, _ = socket.recv_fds(sock, 8, 1)
    with pytest.raises(PermissionError):
        mmap.mmap(fds[0], 0, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    with pytest.raises(OSError):
        os.write(fds[0], b"x")
    os.close(fds[0])
    sock.close()
