"""Serving on a tensor=2 mesh of CPU devices equals serving on one device."""

import jax
from jax.sharding import PartitionSpec as P
import numpy as np

from serving.engine import Engine
from serving.orchestrator import Orchestrator
from serving.sampling import SamplingParams
from sharding.mesh import MeshConfig, make_mesh

from tests.serving.common import CFG, ENGINE, prompts


def test_tensor_parallel_serving_equals_one_device(params, orchestrator):
    mesh = make_mesh(MeshConfig(fsdp=1, tensor=2), jax.devices()[2:4])
    engine = Engine(CFG, ENGINE, mesh=mesh)
    placed = engine.load_params(params)
    assert placed["layers"]["q_proj"].sharding.spec == P(None, None, "tensor", None)
    # Keys at even, values at odd heads: each device holds whole kv heads, keys and values.
    assert engine.init_decode_state().kv.sharding.spec == P(None, None, None, "tensor", None)
    ps = prompts(7, 23, 12, seed=11)
    sampling = [SamplingParams(temperature=0.0, max_tokens=10),
                SamplingParams(temperature=1.0, seed=5, max_tokens=10),
                SamplingParams(temperature=0.8, top_k=8, n=2, seed=6, max_tokens=10)]
    with Orchestrator(engine) as sharded:
        for p, s in zip(ps, sampling):
            want = orchestrator.generate(p, s)
            got = sharded.generate(p, s)
            for a, b in zip(got, want):
                assert a.tokens == b.tokens
                np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
