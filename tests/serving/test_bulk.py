"""The bulk path of weight updates (serving/weights/bulk.py, bulk_pull.py) on its own, over TCP and
over the Unix socket a puller on the same host uses: bytes that arrive equal what was offered, in
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

from serving.weights import bulk as bulk_module
from serving.weights import bulk_pull
from serving.weights.bulk import BulkServer, relay_offer
from serving.weights.bulk_pull import pull
from serving.weights.slabs import ALIGN, ReceivePool, nbytes
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
        got, vouched = pull(bulk.address, uuid, _specs(arrays), 30)
        assert list(got) == list(arrays) and not vouched     # the trainer checks nothing
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
    second = []
    # The second server asks first: its source's relay offer does not exist yet (the late
    # registration is waited for).
    downstream = threading.Thread(target=lambda: second.extend(
        pull(relay.address, relay_id, _specs(arrays), 30)))
    downstream.start()
    pool = ReceivePool()
    offer = relay_offer(relay, relay_id, nbytes(_specs(arrays)), 30)
    first, _ = pull(bulk.address, uuid, _specs(arrays), 30, lambda: pool.take(_specs(arrays)),
                    offer)
    offer.vouch()                               # the relay's server found it finite
    downstream.join(30)
    for name, a in arrays.items():
        assert np.array_equal(first[name], a) and np.array_equal(second[0][name], a)
    assert offer.done.wait(30) and offer.sends == 1
    # On this host the relay's slab was mapped, not sent through a socket, and its check
    # stands for the second server's; through a socket the second checks for itself.
    mapped = path == "local" and offer.slab is not None
    assert offer.mapped == int(mapped) and second[1] == mapped
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
    offer = relay_offer(relay, 777, total, 30)
    with pytest.raises(ConnectionError, match="ended the offer"):
        pull(f"127.0.0.1:{listener.getsockname()[1]}", 1, specs, 30,
             lambda: ReceivePool().take(specs), offer)
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
    offer = relay_offer(relay, 4242, nbytes(_specs(arrays)), 30)
    offer.place(into, slab)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(bulk_module.local_name(relay.address))
    sock.sendall(bulk_module.HEADER.pack(4242, offer.total))
    assert bulk_module.recv_exactly(sock, 1) == bulk_module.MAPPED
    _, fds, _, _ = socket.recv_fds(sock, 8, 1)
    with pytest.raises(PermissionError):
        mmap.mmap(fds[0], 0, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    with pytest.raises(OSError):
        os.write(fds[0], b"x")
    # Nor can a process reopen it writable: the memfd is sealed against writes but through the
    # relay's own mapping (Linux 5.1's F_SEAL_FUTURE_WRITE).
    again = os.open(f"/proc/self/fd/{fds[0]}", os.O_RDWR)
    with pytest.raises(PermissionError):
        mmap.mmap(again, 0, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    with pytest.raises(PermissionError):
        os.write(again, b"x")
    os.close(again)
    os.close(fds[0])
    into[0][0, 0] = 3.0                     # the relay's own mapping still writes
    assert into[0][0, 0] == 3.0
    sock.close()


def test_a_relay_whose_pull_fails_before_it_starts_fails_its_puller(bulk, path, monkeypatch):
    """The relay's own source has no such offer: its puller, waiting for the relay to learn
    where its bytes come from, fails too instead of waiting out the deadline."""
    monkeypatch.setattr(bulk_module, "LATE_S", 0.5)
    arrays = _arrays()
    specs = _specs(arrays)
    relay = BulkServer("127.0.0.1")
    errors = []
    thread = threading.Thread(target=lambda: errors.append(
        pytest.raises(ConnectionError, pull, relay.address, 99, specs, 30)))
    thread.start()
    offer = relay_offer(relay, 99, nbytes(specs), 30)
    with pytest.raises(ConnectionError, match="has no offer"):
        pull(bulk.address, 123456, specs, 30, lambda: ReceivePool().take(specs), offer)
    thread.join(30)
    assert not thread.is_alive() and "ended the offer after 0" in str(errors[0].value)


_HOLDER = """
import hashlib, json, sys
from serving.weights.bulk_pull import pull
address, uuid, specs = json.loads(sys.argv[1])
got, vouched = pull(address, uuid, [(n, tuple(s), d) for n, s, d in specs], 30)
assert vouched
assert not any(a.flags.writeable for a in got.values())       # the relay's memory, read-only
print(hashlib.sha256(b"".join(a.tobytes() for a in got.values())).hexdigest(), flush=True)
sys.stdin.read()                                                # serve until killed
"""


def test_a_server_beside_a_relay_serves_from_its_slab_which_waits_for_it(bulk):
    """Another process on this host pulls a relay's update and serves from the relay's own slab
    (the same bytes, read-only, no copy): the relay does not refill that slab while the process
    holds it, and can once the process is SIGKILLed (the kernel drops its lock)."""
    import hashlib
    import json
    import signal
    import subprocess
    import sys
    from pathlib import Path

    arrays = _arrays()
    specs = _specs(arrays)
    uuid, _ = bulk.offer(list(arrays.values()), 30)
    relay = BulkServer("127.0.0.1")
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, json.dumps([relay.address, 5150, specs])],
        cwd=Path(__file__).resolve().parents[2], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    try:
        pool = ReceivePool()
        offer = relay_offer(relay, 5150, nbytes(specs), 30)
        first, _ = pull(bulk.address, uuid, specs, 30, lambda: pool.take(specs), offer)
        offer.vouch()
        served = id(first["a/w"].base)
        digest = hashlib.sha256(b"".join(a.tobytes() for a in first.values())).hexdigest()
        assert holder.stdout.readline().strip() == digest
        # The puller confirms its mapping before it prints; the relay counts the send once it
        # has read that confirmation, on its own thread.
        until(lambda: offer.mapped == 1, 30, "the relay counting the mapped send")
        del first, offer
        gc.collect()
        again, _ = pool.take(specs)
        assert id(again[0].base) != served          # still mapped by the other process
        del again
        holder.send_signal(signal.SIGKILL)
        holder.wait(30)
        gc.collect()
        third, _ = pool.take(specs)
        assert id(third[0].base) == served          # its lock died with it: reused
    finally:
        holder.kill()
        holder.wait(30)


def test_a_relay_that_refuses_the_update_stops_a_puller_beside_it(bulk, path):
    """The relay's server found a NaN in what it pulled: a server mapping its slab does not
    serve it (a ConnectionError); one it streamed to has the bytes, unvouched, to check."""
    arrays = _arrays()
    specs = _specs(arrays)
    uuid, _ = bulk.offer(list(arrays.values()), 30)
    relay = BulkServer("127.0.0.1")
    outcome = []

    def downstream():
        try:
            outcome.append(pull(relay.address, 31337, specs, 30)[1])
        except ConnectionError as e:
            outcome.append(str(e))

    thread = threading.Thread(target=downstream)
    thread.start()
    offer = relay_offer(relay, 31337, nbytes(specs), 30)
    pull(bulk.address, uuid, specs, 30, lambda: ReceivePool().take(specs), offer)
    offer.fail("weight update rejected: a/w contains NaN or Inf")
    thread.join(30)
    if path == "local":
        assert "refused the update" in outcome[0], outcome
    else:
        assert outcome == [False]


def test_every_server_of_a_relay_chain_refuses_a_non_finite_update(bulk, path):
    """A trainer's offer with a NaN, pulled by two servers' `Pulls` as a relay chain (the second
    pulls from the first while it receives): neither applies it. Over the Unix socket the second
    maps the relay's slab and trusts its verdict, so this holds only if the relay checks before
    it vouches (serving/weights/pulls.py)."""
    import types

    from serving.weights.pulls import Pulls
    from sharding.reshard import WeightUpdateError

    arrays = _arrays()
    arrays["a/w"][5, 17] = np.nan
    specs = _specs(arrays)
    uuid, _ = bulk.offer(list(arrays.values()), 30)
    applied, refused = [], []

    def serve(request):
        try:
            Pulls("127.0.0.1", lambda: jax.devices()[:1]).pull(request, specs, 30,
                                                               applied.append)
        except (WeightUpdateError, ConnectionError) as e:
            refused.append(str(e))

    relay_uuid = 4242 if path == "local" else 4243
    relay_at = BulkServer.get("127.0.0.1").address
    downstream = threading.Thread(target=serve, args=(types.SimpleNamespace(
        transport="tcp", address=relay_at, uuid=relay_uuid, relay_uuid=0),))
    downstream.start()
    serve(types.SimpleNamespace(transport="tcp", address=bulk.address, uuid=uuid,
                                relay_uuid=relay_uuid))
    downstream.join(30)
    assert not downstream.is_alive()
    assert applied == [] and len(refused) == 2, (applied, refused)
    assert "a/w contains NaN or Inf" in refused[0]
