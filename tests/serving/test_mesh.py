"""Serving on a tensor=2 mesh of CPU devices equals serving on one device."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from serving.core.orchestrator import Orchestrator
from serving.runner.engine import Engine
from serving.runner.sampling import SamplingParams
from sharding.mesh import MeshConfig, make_mesh
from tests.serving.common import CFG, ENGINE, prompts

pytestmark = pytest.mark.multi_device


def test_tensor_parallel_serving_equals_one_device(params, orchestrator):
    mesh = make_mesh(MeshConfig(fsdp=1, tensor=2), jax.devices()[2:4])
    engine = Engine(CFG, ENGINE, mesh=mesh)
    placed = engine.prepare_params(params)
    assert placed["layers"]["q_proj"].sharding.spec == P(None, None, "tensor", None)
    # Keys at even, values at odd heads: each device holds whole kv heads, keys and values.
    heads = jax.sharding.NamedSharding(mesh, P(None, None, None, "tensor", None))
    assert engine.init_decode_state().kv.sharding.is_equivalent_to(heads, 5)
    ps = prompts(7, 23, 12, seed=11)
    sampling = [SamplingParams(temperature=0.0, max_tokens=10),
                SamplingParams(temperature=1.0, seed=5, max_tokens=10),
                SamplingParams(temperature=0.8, top_k=8, n=2, seed=6, max_tokens=10)]
    with Orchestrator(engine, placed) as sharded:
        for p, s in zip(ps, sampling):
            want = orchestrator.generate(p, s)
            got = sharded.generate(p, s)
            for a, b in zip(got, want):
                assert a.tokens == b.tokens
                np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_replicas_serve_as_one_engine_and_update_together(params, orchestrator):
    """Two replicas, each tensor-parallel over 2 devices: groups go to both, every output
    equals the one-device engine's, an update reaches both, a refused one changes neither."""
    import jax.numpy as jnp
    import pytest

    from serving.fleet.replicas import Replicas
    from sharding.reshard import WeightUpdateError

    engines = []
    for devices in (jax.devices()[4:6], jax.devices()[6:8]):
        engines.append(Engine(CFG, ENGINE, mesh=make_mesh(MeshConfig(fsdp=1, tensor=2),
                                                          devices)))
    members = [Orchestrator(e, params) for e in engines]
    replicas = Replicas(members).start()
    try:
        ps = prompts(5, 9, 14, 20, seed=3)
        sampling = SamplingParams(temperature=0.9, seed=2, n=2, max_tokens=12)
        streams = [replicas.submit(p, sampling) for p in ps]
        for p, stream in zip(ps, streams):
            want = orchestrator.generate(p, sampling)
            for a, b in zip(stream.result(), want):
                assert a.tokens == b.tokens
        assert min(replicas.metrics()["replica_requests_done"]) > 0
        version = replicas.newest_version + 1
        replicas.update_params(params, version)
        assert [o.version for o in members] == [version, version]
        bad = jax.tree.map(lambda a: jnp.full(a.shape, jnp.nan, a.dtype), params)
        with pytest.raises(WeightUpdateError):
            replicas.update_params(bad, version + 1)
        assert [o.version for o in members] == [version, version]
        assert replicas.newest_version == version
    finally:
        replicas.stop()
