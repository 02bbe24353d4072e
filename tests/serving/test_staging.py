"""Staged tcp pulls (serving/weights/staging.py), as a GPU or TPU server makes them, here onto a CPU
device: every wire dtype lands on the device equal to what was offered, through a few chunks
of host memory whatever the model's size; a relay sends on what passes through its stage and
holds the pull back while its downstream reads; a relay nobody pulls is given up without
stopping the pull; a server forced to stage serves what it pulled."""

import threading
import time
import tracemalloc

import jax
import ml_dtypes
import numpy as np
import pytest

from serving.weights import bulk as bulk_module
from serving.weights import staging
from serving.weights.bulk import BulkServer, relay_offer
from serving.weights.bulk_pull import pull
from serving.weights.slabs import nbytes


@pytest.fixture(autouse=True)
def small_pieces(monkeypatch):
    """Pieces of 4 KiB, two slots: every tensor but the smallest in several pieces, and a
    relay's downstream holding the pull back."""
    monkeypatch.setattr(staging, "CHUNK", 4096)
    monkeypatch.setattr(staging, "SLOTS", 2)


def _arrays():
    rng = np.random.default_rng(1)
    return {"w": rng.standard_normal((257, 300)).astype(np.float32),      # 308,400 bytes
            "b": rng.standard_normal((4099,)).astype(ml_dtypes.bfloat16),  # a short last block
            "wide": rng.standard_normal((3, 1500)).astype(np.float32),     # rows over 4 KiB
            "s": np.float32(2.5).reshape(()),
            "q": rng.integers(-128, 127, (33, 5)).astype(np.int8),
            "f8": rng.standard_normal((96,)).astype(ml_dtypes.float8_e4m3fn),
            "empty": np.zeros((0, 4), np.float32)}


def _specs(arrays):
    return [(n, a.shape, np.dtype(a.dtype).name) for n, a in arrays.items()]


def test_pieces_are_blocks_of_rows_of_at_most_a_chunk():
    specs = [("a", (10,), "float32"), ("b", (0, 7), "float32"), ("c", (3, 3), "int8"),
             ("wide", (2, 40), "bfloat16"), ("s", (), "float32")]
    assert staging.pieces(specs, 16) == [
        (0, 0, 4, 16), (0, 4, 4, 16), (0, 8, 2, 8),     # 4 rows of 4 bytes a piece
        (2, 0, 3, 9),                                   # (b has no bytes)
        (3, 0, 1, 80), (3, 1, 1, 80),                   # a row over the chunk: a row a piece
        (4, 0, 1, 4)]


def test_a_staged_pull_lands_every_dtype_on_the_device_through_small_chunks():
    arrays = _arrays()
    bulk = BulkServer("127.0.0.1")
    uuid, _ = bulk.offer(list(arrays.values()), 30)
    device = jax.devices()[0]
    pull(bulk.address, uuid, _specs(arrays), 30, onto=device)          # compiles the writes
    tracemalloc.start()
    got, vouched = pull(bulk.address, uuid, _specs(arrays), 30, onto=device)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert not vouched
    for name, a in arrays.items():
        assert isinstance(got[name], jax.Array) and got[name].devices() == {device}
        assert got[name].dtype == a.dtype and got[name].shape == a.shape
        assert np.array_equal(np.asarray(got[name]).reshape(-1).view(np.uint8),
                              a.reshape(-1).view(np.uint8)), name
    # Host memory: two 4 KiB slots, not the 313 KB offered.
    total = nbytes(_specs(arrays))
    assert peak < total / 4, (peak, total)


def test_a_staged_relay_sends_on_what_passes_through_its_stage():
    """Two slots: the relay's own pull waits for its downstream to send each piece on."""
    arrays = _arrays()
    specs = _specs(arrays)
    bulk = BulkServer("127.0.0.1")
    uuid, _ = bulk.offer(list(arrays.values()), 30)
    relay = BulkServer("127.0.0.1")
    second = []
    downstream = threading.Thread(target=lambda: second.extend(
        pull(relay.address, 2718, specs, 30)))
    downstream.start()
    offer = relay_offer(relay, 2718, nbytes(specs), 30)
    first, _ = pull(bulk.address, uuid, specs, 30, relay=offer, onto=jax.devices()[0])
    downstream.join(30)
    for name, a in arrays.items():
        assert np.array_equal(np.asarray(first[name]).reshape(-1).view(np.uint8),
                              a.reshape(-1).view(np.uint8))
        assert np.array_equal(second[0][name].reshape(-1).view(np.uint8),
                              a.reshape(-1).view(np.uint8))
    # The relay counts a send once its last sendall returns, which may be after the
    # downstream pull has read every byte and returned: wait for the count, bounded.
    deadline = time.monotonic() + 30
    while offer.sends < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert offer.sends == 1 and offer.mapped == 0


def test_a_relay_nobody_pulls_is_given_up_and_the_pull_goes_on(monkeypatch):
    monkeypatch.setattr(staging, "RELAY_GRACE_S", 0.2)
    monkeypatch.setattr(bulk_module, "LATE_S", 0.5)
    arrays = _arrays()
    specs = _specs(arrays)
    bulk = BulkServer("127.0.0.1")
    uuid, _ = bulk.offer(list(arrays.values()), 30)
    relay = BulkServer("127.0.0.1")
    offer = relay_offer(relay, 1414, nbytes(specs), 30)
    got, _ = pull(bulk.address, uuid, specs, 30, relay=offer, onto=jax.devices()[0])
    assert np.array_equal(np.asarray(got["w"]), arrays["w"])
    assert offer.done.is_set()
    with pytest.raises(ConnectionError):            # too late: its slots were refilled
        pull(relay.address, 1414, specs, 30)


def test_a_server_that_stages_its_pulls_serves_what_it_pulled(monkeypatch):
    """A CPU server made to stage as a GPU server does (serving/weights/pulls.py `stages`): the
    weights it pulls over tcp generate what a local engine holding them generates."""
    from flax import nnx

    from jaxrl.models import Transformer, split_params
    from serving.core.orchestrator import Orchestrator
    from serving.fleet.client import RemoteGeneration
    from serving.frontends.server import Server
    from serving.runner.engine import Engine
    from serving.runner.sampling import SamplingParams
    from serving.weights import pulls
    from tests.serving.common import CFG, ENGINE

    monkeypatch.setattr(pulls, "stages", lambda devices: True)
    params = split_params(Transformer(CFG, rngs=nnx.Rngs(0)))[1]
    other = jax.tree.map(lambda x: x * 1.5 + 0.01, params)
    server = Server(Orchestrator(Engine(CFG, ENGINE), params, version=0, eos_id=1).start(),
                    port=0, update_token="t").start()
    remote = RemoteGeneration(server.address, token="t", transfer="tcp")
    try:
        assert remote.update_params(other, 1, timeout=60).version == 1
        sampling = SamplingParams(max_tokens=8, temperature=0.0, stop_at_eos=False)
        with Orchestrator(Engine(CFG, ENGINE), other, version=1, eos_id=1) as want:
            expected = want.submit([3, 4, 5], sampling).result()[0].tokens
        [sample] = remote.submit([3, 4, 5], sampling).result()
        assert sample.tokens == expected and set(sample.versions) == {1}
    finally:
        remote.close()
        server.stop(0)


def test_only_a_server_on_one_accelerator_stages():
    """A CPU engine serves from the slab itself; weights sharded over several devices are placed
    from the slab shard by shard (staged whole onto one device, they might not fit)."""
    from types import SimpleNamespace

    from serving.weights.pulls import stages

    gpu, tpu, cpu = (SimpleNamespace(platform=p) for p in ("gpu", "tpu", "cpu"))
    assert stages([gpu]) and stages([tpu])
    assert not stages([cpu]) and not stages([gpu, gpu]) and not stages([tpu] * 4)
