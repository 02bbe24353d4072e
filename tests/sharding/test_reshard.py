"""Weights from the trainer's mesh to a disjoint serving mesh, cast to the serving dtype."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import sharding.reshard as reshard_module
from jaxrl.models import ModelConfig, Transformer, abstract_model, param_axes, split_params
from serving.runner.engine import Engine, EngineConfig
from sharding.mesh import MeshConfig, make_mesh, tree_shardings
from sharding.reshard import WeightUpdateError, reshard

pytestmark = pytest.mark.multi_device

CFG = ModelConfig(vocab_size=32, embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, mlp_dim=64)


def test_trainer_mesh_to_serving_mesh_in_bfloat16():
    params = split_params(Transformer(CFG, rngs=nnx.Rngs(0)))[1]
    trainer = make_mesh(MeshConfig(fsdp=4), jax.devices()[:4])
    trained = jax.device_put(params, tree_shardings(param_axes(CFG),
                                                    split_params(abstract_model(CFG))[1], trainer))
    engine = Engine(CFG, EngineConfig(max_len=32, max_prefill_length=16, prefill_chunk=8,
                                      dtype="bfloat16"),
                    mesh=make_mesh(MeshConfig(fsdp=1, tensor=2), jax.devices()[4:6]))
    served = reshard(trained, engine.param_target, chunk_bytes=4096)  # many small chunks
    up = served["layers"]["up_proj"]
    assert up.dtype == jnp.bfloat16 and up.sharding.spec == P(None, None, "tensor")
    assert {d.id for d in up.devices()} == {jax.devices()[4].id, jax.devices()[5].id}
    for a, b in zip(jax.tree.leaves(served), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b).astype(jnp.bfloat16))


def test_host_arrays_and_rejections():
    params = split_params(Transformer(CFG, rngs=nnx.Rngs(0)))[1]
    engine = Engine(CFG, EngineConfig(max_len=32, max_prefill_length=16, prefill_chunk=8))
    host = jax.tree.map(np.asarray, params)
    served = reshard(host, engine.param_target)
    assert served["embed"].sharding == engine.param_target["embed"].sharding
    host["layers"]["v_proj"] = host["layers"]["v_proj"].copy()
    host["layers"]["v_proj"][0, 0, 0, 0] = np.inf
    with pytest.raises(WeightUpdateError, match="layers/v_proj contains NaN or Inf"):
        reshard(host, engine.param_target)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e4m3fn"])
def test_the_finiteness_check_finds_each_bad_leaf_on_host_and_on_devices(dtype, monkeypatch):
    """Host arrays (numpy, CPU devices) are checked by numpy a block at a time (7 elements
    here: a bad value in a later block too), others by one compiled program: both name the
    same leaves, against numpy on float64 copies."""
    monkeypatch.setattr(reshard_module, "_BLOCK", 7)
    rng = np.random.default_rng(0)
    leaves = [rng.standard_normal((3, 5)).astype(np.float32) for _ in range(5)]
    leaves[1][2, 4], leaves[3][0, 0], leaves[4][1, 1] = np.nan, np.inf, -np.inf
    if dtype == "float8_e4m3fn":    # no infinities in e4m3fn: they become NaN
        leaves[3][0, 0] = leaves[4][1, 1] = np.nan
    leaves = [np.asarray(jnp.asarray(x, dtype)) for x in leaves]
    want = [bool(np.isfinite(x.astype(np.float64)).all()) for x in leaves]
    assert want == [True, False, True, False, False]
    assert reshard_module.finite(leaves).tolist() == want
    assert reshard_module.finite([jnp.asarray(x) for x in leaves]).tolist() == want
    assert np.asarray(reshard_module._all_finite(leaves)).tolist() == want   # devices' path
    assert reshard_module.finite([np.arange(20, dtype=np.int8)]).tolist() == [True]
