"""The bulk TCP path of weight updates (serving/bulk.py) on its own: bytes that arrive equal
what was offered, in every wire dtype; a wrong id or size is refused before any byte moves; a
relay passes on what it receives while it receives, and a relay whose own pull stops short
stops its puller short too (a ConnectionError, never a partial array handed on). The receive
pool hands out aligned views of a slab and reuses a slab only once nothing holds a view of it,
jax arrays that alias it included."""

import gc
import socket
import threading

import jax
import ml_dtypes
import numpy as np
import pytest

from serving import bulk as bulk_module
from serving.bulk import BulkServer, ReceivePool, pull, relay_offer


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


def test_what_arrives_is_what_was_offered(bulk):
    arrays = _arrays()
    uuid, offer = bulk.offer(list(arrays.values()), 30)
    for _ in range(2):                      # an offer serves every pull until its deadline
        got = pull(bulk.address, uuid, _specs(arrays), 30)
        assert list(got) == list(arrays)
        for name, a in arrays.items():
            assert got[name].dtype == a.dtype and np.array_equal(got[name], a)
    assert offer.sends == 2


def test_a_wrong_id_or_size_is_refused_before_any_byte_moves(bulk, monkeypatch):
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


def test_a_relay_passes_on_what_it_receives(bulk, monkeypatch):
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
    into = ReceivePool().take(_specs(arrays))
    offer = relay_offer(relay, relay_id, into, 30)
    first = pull(bulk.address, uuid, _specs(arrays), 30, into, offer)
    downstream.join(30)
    for name, a in arrays.items():
        assert np.array_equal(first[name], a) and np.array_equal(second[name], a)
    assert offer.done.is_set() and offer.sends == 1
    monkeypatch.setattr(bulk_module, "LATE_S", 0.2)
    with pytest.raises(ConnectionError, match="has no offer"):     # a relay is sent once
        pull(relay.address, relay_id, _specs(arrays), 30)


def test_a_relay_cut_short_cuts_its_puller_short(bulk):
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
    offer = relay_offer(relay, 777, ReceivePool().take(specs), 30)
    with pytest.raises(ConnectionError, match="ended the offer"):
        pull(f"127.0.0.1:{listener.getsockname()[1]}", 1, specs, 30, offer.arrays, offer)
    thread.join(30)
    assert errors and "ended the offer" in errors[0]
    assert offer.done.is_set()
    listener.close()


def test_the_receive_pool_reuses_a_slab_only_once_nothing_holds_it():
    arrays = _arrays()
    specs = _specs(arrays)
    pool = ReceivePool()
    first = pool.take(specs)
    assert [(a.shape, a.dtype) for a in first] == [(a.shape, a.dtype) for a in arrays.values()]
    held = [a for a in first if a.size]
    assert all(a.ctypes.data % bulk_module.ALIGN == 0 for a in held)
    for a, b in zip(held, held[1:]):            # disjoint, in order
        assert a.ctypes.data + a.nbytes <= b.ctypes.data
    slab = id(first[0].base)        # its id: a reference here would keep it in use
    # The engine's weights made from the arrays (on a CPU device, the same memory): while they
    # live the slab is not handed out again, whatever else let go of it.
    served = [jax.device_put(a) for a in first]
    first[0][0, 0] = 7.0
    assert float(served[0][0, 0]) == 7.0        # aliased: no copy was made
    del first, held, a, b
    second = pool.take(specs)
    assert id(second[0].base) != slab
    del served, second
    gc.collect()
    third = pool.take(specs)
    assert id(third[0].base) == slab            # free again: reused, no fresh pages
    assert len(pool._slabs) == 2
